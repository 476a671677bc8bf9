"""train/logprobs.py: chunked log-probs equal the full-logits ones, and never keep (N, V) logits for the backward."""

import pytest
import torch

from train.logprobs import full_logits_logprobs, fused_token_loss, token_logprobs

N, H, V = 37, 16, 1000


@pytest.fixture
def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(H, V, bias=True)


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_chunked_values_and_gradients_match_full_logits(head, chunk):
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    g = torch.randn(N)
    logp, entropy = token_logprobs(hidden, targets, head, chunk=chunk, temperature=0.7, with_entropy=True)
    (logp * g).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad = head.weight.grad = head.bias.grad = None
    ref = full_logits_logprobs(hidden, targets, head, temperature=0.7)
    (ref * g).sum().backward()
    torch.testing.assert_close(logp, ref)
    for a, b in zip(grads, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(a, b)
    p = torch.softmax(head(hidden).detach() / 0.7, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    assert not entropy.requires_grad


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_fused_loss_value_and_gradient_match_autograd_through_full_logits(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)  # frozen, as under LoRA
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    adv, old = torch.randn(N), -7 + torch.randn(N) * 0.3

    def token_loss(logp, sl):  # clipped and non-linear, like the real one
        ratio = torch.exp(logp - old[sl])
        return -torch.minimum(ratio * adv[sl], ratio.clamp(0.8, 1.28) * adv[sl]) + 0.1 * logp**2

    loss, logp, entropy = fused_token_loss(
        hidden, targets, head, token_loss, chunk=chunk, temperature=1.3, with_entropy=True
    )
    (3.0 * loss).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    ref_logp = full_logits_logprobs(hidden, targets, head, temperature=1.3)
    ref = token_loss(ref_logp, slice(None)).sum()
    (3.0 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logp, ref_logp.detach())
    torch.testing.assert_close(grad, hidden.grad)
    assert entropy.shape == (N,) and not logp.requires_grad
    empty = torch.randn(3, H, requires_grad=True)
    loss, logp, _ = fused_token_loss(empty[:0], targets[:0], head, token_loss)
    assert loss.item() == 0 and loss.requires_grad and logp.shape == (0,)


def _largest_saved(fn, params) -> int:
    """The largest tensor autograd keeps for the backward, not counting the (already resident) parameters."""
    sizes = [0]
    ptrs = {p.data_ptr() for p in params}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: sizes.append(0 if t.data_ptr() in ptrs else t.numel()) or t, lambda t: t
    ):
        fn()
    return max(sizes)


def test_the_backward_keeps_hidden_states_not_logits(head):
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    params = list(head.parameters())
    assert _largest_saved(lambda: full_logits_logprobs(hidden, targets, head), params) >= N * V
    assert _largest_saved(lambda: token_logprobs(hidden, targets, head, chunk=8), params) == 8 * H  # one chunk
    head.requires_grad_(False)
    loss, _, _ = fused_token_loss(hidden, targets, head, lambda lp, sl: lp, chunk=8)
    assert [t.shape for t in loss.grad_fn.saved_tensors] == [(N, H)]  # the hidden states' gradient, nothing else


def test_no_grad_and_empty_inputs(head):
    with torch.no_grad():
        logp, entropy = token_logprobs(torch.randn(N, H), torch.randint(0, V, (N,)), head, chunk=5)
    assert logp.shape == (N,) and entropy.shape == (0,)
    hidden = torch.randn(4, H, requires_grad=True)
    empty, _ = token_logprobs(hidden[:0], torch.zeros(0, dtype=torch.long), head)
    assert empty.shape == (0,) and empty.requires_grad  # a padding pass still reaches the parameters
    empty.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() == 0
