"""Every way the trainer can batch traces gives each trace the log-probs and the gradient it has alone, on each
architecture family: dense attention (tiny Qwen3, tiny Llama) and hybrid linear attention (tiny Qwen3.5, whose
Gated DeltaNet layers carry a recurrent state and a convolution along a row, so that packing by mask leaks)."""

import json
import math

import numpy as np
import pytest
import torch

from tests.train.helpers import groups, trace, write
from train import attention, data, grpo, losses, sft
from train.data import Trace
from train.policy import _trace_bounds, load_policy
from train.runtime import TrainConfigError

PEFT_WARNING = "ignore:.*is_gradient_checkpointing:FutureWarning"
pytestmark = pytest.mark.filterwarnings(PEFT_WARNING)
ARCHITECTURES = ["qwen3", "llama", "qwen3.5"]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4102,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


@pytest.fixture
def model_dir(request, tiny_model_dir, long_memory_qwen35_dir, tiny_llama_dir) -> str:
    return str({"qwen3": tiny_model_dir, "qwen3.5": long_memory_qwen35_dir, "llama": tiny_llama_dir}[request.param])


def config(tmp_path, model: str, **overrides) -> grpo.Config:
    values = {"trajectories": (tmp_path / "unused.parquet",), "model": model, "output": tmp_path / "out"}
    values |= {"max_len": 96, "micro_batch_tokens": 256, "lora_r": 4, "lora_alpha": 8, "logprob_chunk": 16}
    return grpo.Config(**{**values, **overrides})  # type: ignore[arg-type]


def make_traces() -> list[Trace]:
    """Traces of varied lengths; 1 and 2 begin with 0's first 24 tokens (one task's samples), 4 is the longest."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 4000, 24)
    tails = [rng.integers(3, 4000, n) for n in (20, 11, 33, 40, 70)]
    tokens = [np.concatenate([prompt, tails[0]]), np.concatenate([prompt, tails[1]])]
    tokens += [np.concatenate([prompt, tails[2]]), tails[3], tails[4]]
    return [
        Trace(
            session=i,
            tokens=t,
            n_prompt=5,
            trained=np.arange(4, len(t) - 1),
            behav_logp=np.full(len(t) - 5, np.nan, dtype=np.float32),
            adv=1.0,
        )
        for i, t in enumerate(tokens)
    ]


def load(tmp_path, model: str, **overrides):
    policy = load_policy(config(tmp_path, model, **overrides), "no")
    policy.train()  # as the scripts train: gradient checkpointing on, replaying each layer in the backward
    torch.manual_seed(1)
    for name, p in policy.named_parameters():  # a non-zero adapter: its gradient flows through every layer
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    return policy


def alone(policy, traces: list[Trace], weights: np.ndarray) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each trace on its own through the plain PEFT model (full logits): its log-probs, and the gradient of the
    weighted NLL of all of them."""
    policy.zero_grad()
    logps = []
    for t, w in zip(traces, weights, strict=True):
        logits = policy.peft(input_ids=torch.from_numpy(t.tokens)[None]).logits[0]  # (T, V)
        logp = logits.log_softmax(-1)[t.trained, t.tokens[t.trained + 1]]  # (n,)
        (-float(w) * logp).sum().backward()
        logps.append(logp.detach())
    return logps, grads(policy)


def batched(policy, mbs: list[data.MicroBatch]) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """The trainer's forward (Policy: fused chunked log-probs and loss) over the micro-batches: each session's
    log-probs, and the summed gradient."""
    policy.zero_grad()
    per_session: dict[int, list[torch.Tensor]] = {}
    for mb in mbs:
        logp, _, loss = policy(
            mb.input_ids,
            mb.position_ids,
            mb.sel,
            mb.targets,
            mb.prefix,
            token_loss=lambda lp, sl, mb=mb: -mb.weight[sl] * lp,
        )
        loss.backward()
        for s in mb.session.unique().tolist():
            per_session.setdefault(s, []).append(logp[mb.session == s])
    return {s: torch.cat(v) for s, v in per_session.items()}, grads(policy)


def grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}


def micro_batches(traces, budget: int, share_prefix: bool, padded: bool) -> list[data.MicroBatch]:
    aggregate = losses.AGGREGATIONS["token_mean"]
    return data.rank_micro_batches(traces, aggregate, 96, budget, 0, 1, share_prefix, padded)


def assert_equal_alone(policy, mbs: list[data.MicroBatch], traces: list[Trace]) -> None:
    weights = np.concatenate([mb.weight.numpy() for mb in mbs])
    sessions = np.concatenate([mb.session.numpy() for mb in mbs])
    weight_of = np.array([weights[sessions == t.session][0] for t in traces])
    expected_logp, expected_grad = alone(policy, traces, weight_of)
    logp, grad = batched(policy, mbs)
    for t, expected in zip(traces, expected_logp, strict=True):
        torch.testing.assert_close(logp[t.session], expected, atol=2e-5, rtol=1e-5)
    for name, g in expected_grad.items():
        torch.testing.assert_close(grad[name], g, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("model_dir", ARCHITECTURES, indirect=True)
@pytest.mark.parametrize("budget", [512, 96], ids=["one-micro-batch", "split"])
def test_the_chosen_batching_gives_each_trace_what_it_has_alone(tmp_path, model_dir, budget):
    policy = load(tmp_path, model_dir)
    expected = "padded" if "qwen3.5" in model_dir else "packed"
    assert policy.batching == expected, policy.batching_reason
    traces = make_traces()
    mbs = micro_batches(traces, budget, share_prefix=False, padded=policy.batching == "padded")
    assert (len(mbs) == 1) == (budget == 512)
    assert_equal_alone(policy, mbs, traces)


@pytest.mark.parametrize("model_dir", ARCHITECTURES, indirect=True)
def test_padded_rows_are_right_for_every_architecture(tmp_path, model_dir):
    policy = load(tmp_path, model_dir)
    traces = make_traces()
    mbs = micro_batches(traces, 256, share_prefix=False, padded=True)
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(3, 70), (2, 40)]  # 3 x 70 <= 256 < 4 x 70
    assert_equal_alone(policy, mbs, traces)


@pytest.mark.parametrize("model_dir", ARCHITECTURES, indirect=True)
@pytest.mark.parametrize(("budget", "chunks"), [(256, 1), (58, 3)], ids=["one-chunk", "three-chunks"])
def test_a_shared_prefix_computed_once_gives_each_trace_what_it_has_alone(tmp_path, model_dir, budget, chunks):
    # Traces 0-2 share a 24-token prompt, which holds trained tokens (4..23): the last chunk trains them, and the
    # earlier chunks' gradient reaches the prefix through it. Trace 3 shares nothing and goes alone.
    policy = load(tmp_path, model_dir, share_prefix=True)
    traces = make_traces()[:4]
    mbs = micro_batches(traces, budget, share_prefix=True, padded=policy.batching == "padded")
    shared = [mb for mb in mbs if mb.prefix is not None]
    assert len(shared) == chunks and shared[0].prefix.first and shared[-1].prefix.last
    assert {mb.prefix.input_ids.shape[1] for mb in shared} == {24}
    assert sorted(len(t.tokens) for t in traces) == [35, 40, 44, 57]
    tails = 33 + 20 + 11 if chunks == 3 else 3 * 33  # right-padded rows
    assert sum(mb.computed_tokens() for mb in mbs) == 24 + tails + 40  # the prefix once, by the first chunk
    assert_equal_alone(policy, mbs, traces)


@pytest.mark.parametrize("model_dir", ["qwen3.5"], indirect=True)
def test_packing_leaks_between_traces_on_linear_attention(tmp_path, model_dir):
    # What the trainer did before it chose the batching: one packed row. The later traces inherit the earlier
    # ones' recurrent state, which the property test above would catch.
    policy = load(tmp_path, model_dir)
    traces = make_traces()
    (mb,) = micro_batches(traces, 256, share_prefix=False, padded=False)
    expected, _ = alone(policy, traces, np.ones(len(traces)))
    with torch.no_grad():
        logp = policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets)[0]
    worst = max(float((logp[mb.session == t.session] - e).abs().max()) for t, e in zip(traces, expected, strict=True))
    assert worst > 1e-3


# ---- through the scripts: the first step is the same whether traces share micro-batches or not


def first_step(output) -> dict:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()][1]


@pytest.mark.slow
def test_sft_and_grpo_first_step_on_qwen35_do_not_depend_on_the_micro_batch_budget(tmp_path, tiny_qwen35_dir, capsys):
    rows = groups(
        {"a": [1, 0, 0.5], "b": [0, 1]}, prompt_len=20, response_len=30, traces=2
    )  # 50 tokens: one a row at 96
    rows.append(trace(session="long", task="b", prompt=list(range(40, 90)), response=list(range(90, 130)), reward=0))
    path = write(tmp_path / "t.parquet", rows)
    common = {"trajectories": (path,), "model": str(tiny_qwen35_dir), "max_len": 96, "lora_r": 4, "lr": 1e-2}
    common |= {"max_steps": 1, "logprob_chunk": 16}
    for script, extra in ((sft, {"sessions_per_step": 99}), (grpo, {"groups_per_step": 2, "save_every": 0})):
        steps = {}
        for budget in (1024, 96):
            out = tmp_path / f"{script.__name__}-{budget}"
            script.main(script.Config(**common, **extra, micro_batch_tokens=budget, output=out))  # type: ignore[attr-defined]
            steps[budget] = first_step(out)
        assert (
            "batching: padded (qwen3_5_text's linear_attention layers and convolutions carry" in capsys.readouterr().out
        )
        loss = "loss/nll" if script is sft else "loss/total"
        assert math.isfinite(steps[1024][loss]) and steps[1024]["optim/grad_norm"] > 0
        assert steps[1024][loss] == pytest.approx(steps[96][loss], rel=1e-5, abs=1e-7)
        assert steps[1024]["optim/grad_norm"] == pytest.approx(steps[96]["optim/grad_norm"], rel=1e-5)


def test_varlen_bounds_are_the_packed_traces():
    # What the varlen kernels read on a GPU (not run here): cu_seqlens restarts the recurrent state, seq_idx the
    # convolution, at each trace of the packed row.
    (mb,) = micro_batches(make_traces(), 512, share_prefix=False, padded=False)
    bounds = _trace_bounds(mb.position_ids)
    lengths = [70, 57, 44, 40, 35]  # packed longest first
    assert bounds["cu_seq_lens_q"].tolist() == np.cumsum([0, *lengths]).tolist() and bounds["max_length_q"] == 70
    assert bounds["cu_seq_lens_q"].dtype == bounds["seq_idx"].dtype == torch.int32
    assert bounds["seq_idx"].tolist() == [np.repeat(np.arange(5), lengths).tolist()]


# ---- LoRA targets: what vLLM can hot-load after the run


@pytest.mark.parametrize("model_dir", ["qwen3.5"], indirect=True)
@pytest.mark.filterwarnings("ignore:LoRA adapter added to ConvNd layer:UserWarning")  # peft, on conv1d
def test_all_linear_on_qwen35_adapts_both_layer_kinds_and_unloadable_targets_fail_at_start(tmp_path, model_dir):
    policy = load(tmp_path, model_dir)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in policy.peft.named_parameters() if "lora_A" in n}
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    linear_attention = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
    assert adapted == attention | linear_attention | {"gate_proj", "up_proj", "down_proj"}
    for targets, rank, message in [
        (("conv1d",), 128, r"linear and embedding layers only, not conv1d \(Conv1d\)"),  # peft: rank % groups
        (("in_proj_z", "out_proj"), 4, "in_proj_z but not in_proj_qkv"),
        (("no_such_layer",), 4, "no_such_layer"),
    ]:
        with pytest.raises((TrainConfigError, ValueError), match=message):
            load_policy(config(tmp_path, model_dir, lora_targets=targets, lora_r=rank), "no")


@pytest.mark.parametrize("model_dir", ["qwen3", "llama"], indirect=True)
def test_packed_traces_attend_within_their_bounds_without_a_row_sized_mask(tmp_path, model_dir, monkeypatch):
    # transformers' sdpa backend keeps packed traces apart with a (T, T) block-diagonal mask (SDPA's dense path,
    # (T, T) scores at every layer); the trainer's backend runs one causal SDPA per trace instead.
    policy = load(tmp_path, model_dir)
    assert policy.peft.get_base_model().config._attn_implementation == attention.NAME
    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[-2], key.shape[-2], attn_mask is not None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    traces = make_traces()
    (mb,) = micro_batches(traces, 512, share_prefix=False, padded=False)
    policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets)
    longest = max(len(t.tokens) for t in traces)
    layers = policy.peft.get_base_model().config.num_hidden_layers
    assert len(calls) == layers * len(traces)  # one causal attention per trace and layer
    assert all(q == k <= longest and not masked for q, k, masked in calls), calls
    assert sorted({q for q, _, _ in calls}) == sorted(len(t.tokens) for t in traces)


def test_attention_soft_capping_is_refused_on_the_trainers_attention(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attn_logit_softcapping=50.0,
    )
    Gemma2ForCausalLM(gemma).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(TrainConfigError, match=r"soft-capping.*--attn-implementation eager"):
        load_policy(config(tmp_path, str(tmp_path / "gemma2")), "no")
