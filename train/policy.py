"""The model both training scripts train: a base model with a LoRA adapter behind one forward that returns
per-token log-probs (and the loss), never the (T, V) logits; the settings it reads, checked in one place.

train/grpo.py and train/sft.py each declare these settings in their own ``Config`` (with their own defaults and
reasons); ``PolicyConfig`` is the part of either that ``load_policy``, ``Policy`` and the packing read.

How traces share a forward pass depends on the architecture, and is decided once, at load (``choose_batching``):

- ``packed``: every layer is (full or sliding-window) attention, so traces packed in one row are kept apart by
  their restarting position ids (train/attention.py attends within each trace's span).
- ``varlen``: some layers carry a state along the row (Qwen3.5's Gated DeltaNet: a recurrent state and a causal
  convolution) and flash-linear-attention and causal-conv1d are installed (GPU): traces are packed, and their
  boundaries reach those kernels as ``cu_seq_lens`` and ``seq_idx``, which restart the state at each trace.
- ``padded``: such layers without those kernels (the CPU). A mask cannot stop a recurrent state or a convolution
  from carrying one trace into the next, so each trace gets its own row, right-padded (train/data.py).

``--share-prefix`` works the same on all three: a family's prompt is computed once and branched into its traces'
tails, right-padded rows (train/prefix.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict

import torch

from train import attention
from train.data import DataError, Trace
from train.logprobs import TokenLoss, fused_token_loss, token_logprobs
from train.precision import choose_dtype
from train.prefix import Branch, PrefixStates, Record, SharedPrefix, bridge_gradient
from train.runtime import TrainConfigError

__all__ = [
    "Batching",
    "Policy",
    "PolicyConfig",
    "check_lora_targets",
    "check_policy_config",
    "check_vocabulary",
    "choose_batching",
    "enable_checkpointing",
    "load_policy",
    "lora_target_names",
]

Batching = Literal["packed", "varlen", "padded"]
# Layer kinds (a config's ``layer_types``) that see other tokens only through the attention mask.
_MASKED_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
# Model types whose stateful layers transformers runs with varlen kernels when they are installed: the kernels read
# ``cu_seq_lens_q`` (flash-linear-attention's chunk_gated_delta_rule) and ``seq_idx`` (causal-conv1d).
_VARLEN_MODEL_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}


class PolicyConfig(Protocol):
    """The model, LoRA, length and memory settings of a training config (grpo.Config, sft.Config)."""

    @property
    def model(self) -> str: ...
    @property
    def adapter(self) -> Path | None: ...
    @property
    def dtype(self) -> Literal["auto", "float32", "bfloat16"]: ...
    @property
    def attn_implementation(self) -> str | None: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def temperature(self) -> float: ...
    @property
    def max_len(self) -> int: ...
    @property
    def micro_batch_tokens(self) -> int: ...
    @property
    def share_prefix(self) -> bool: ...
    @property
    def logprob_chunk(self) -> int: ...
    @property
    def lora_r(self) -> int: ...
    @property
    def lora_alpha(self) -> int: ...
    @property
    def lora_dropout(self) -> float: ...
    @property
    def lora_targets(self) -> tuple[str, ...]: ...


def check_policy_config(cfg: PolicyConfig) -> None:
    """The rules these settings keep whichever script declares them (called from each ``__post_init__``)."""
    for name in ("max_len", "micro_batch_tokens", "logprob_chunk", "lora_r", "lora_alpha"):
        if getattr(cfg, name) < 1:
            raise TrainConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.max_len > cfg.micro_batch_tokens:
        raise TrainConfigError(f"--max-len {cfg.max_len} must fit --micro-batch-tokens {cfg.micro_batch_tokens}")
    if cfg.share_prefix and cfg.attn_implementation is not None:
        raise TrainConfigError(
            f"--share-prefix runs on the trainer's own attention (train/attention.py), which attends tails to their "
            f"prefix; leave --attn-implementation unset, not {cfg.attn_implementation}"
        )
    if not 0 <= cfg.lora_dropout < 1:
        raise TrainConfigError("--lora-dropout must be in [0, 1)")


class _Chunking(TypedDict):
    chunk: int
    temperature: float
    with_entropy: bool


class Policy(torch.nn.Module):
    """Decoder + LoRA, returning log-probs of the selected positions' next tokens, never the (T, V) logits.

    Given ``token_loss`` it also returns the loss, computed with the log-probs chunk by chunk (logprobs.py).
    Everything the loss uses runs inside this forward, so DDP, FSDP and DeepSpeed wrap and sync exactly it.
    """

    def __init__(self, peft_model: Any, cfg: PolicyConfig) -> None:
        super().__init__()
        self.peft = peft_model
        self.batching, self.batching_reason = choose_batching(peft_model.get_base_model())
        self.dtype_reason = ""  # load_policy says which dtype the weights took, and why
        self.chunk, self.temperature = cfg.logprob_chunk, cfg.temperature
        # FSDP wraps the layers the model says must not be split (its decoder layers).
        self._no_split_modules = list(getattr(peft_model.get_base_model(), "_no_split_modules", None) or [])
        # Prefixes computed by a family's first chunk for its later ones (train/prefix.py): the live states and their
        # detached copies, by (family, reference, gradients on).
        self._prefixes: dict[tuple[int, bool, bool], tuple[PrefixStates, PrefixStates]] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        sel: torch.Tensor,
        targets: torch.Tensor,
        prefix: SharedPrefix | None = None,
        reference: bool = False,
        with_entropy: bool = False,
        token_loss: TokenLoss | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(logp, entropy, loss)`` of the ``sel`` positions' next tokens; loss only with ``token_loss``.
        ``prefix``: the rows are tails of one family, after that shared prefix (train/prefix.py)."""
        base = self.peft.get_base_model()
        lm_head = base.get_output_embeddings()
        head = lm_head
        if cap := getattr(base.config, "final_logit_softcapping", None):  # Gemma-style logit soft-capping
            head = functools.partial(_softcapped, lm_head, cap)
        opts = _Chunking(chunk=self.chunk, temperature=self.temperature, with_entropy=with_entropy)
        with self.peft.disable_adapter() if reference else contextlib.nullcontext():
            gathered = None
            if prefix is None:
                hidden = self._rows(base, input_ids, position_ids)
            else:
                states, gathered = self._prefix_states(base, prefix, reference)
                branch = Branch(states, len(input_ids))
                tails = base.get_decoder()(
                    input_ids=input_ids, position_ids=position_ids, cache=branch, use_cache=False
                ).last_hidden_state.flatten(0, 1)  # (k * L, H)
                assert states.hidden is not None
                hidden = torch.cat([states.hidden, tails]) if prefix.first else tails  # the first trains the prefix
            hidden = hidden[sel]  # (N, H): sel indexes the rows one after another
            if token_loss is None:
                return *token_logprobs(hidden, targets, head, **opts), None
            if not any(p.requires_grad for p in lm_head.parameters()):  # LoRA: the output layer is frozen
                loss, logp, entropy = fused_token_loss(hidden, targets, head, token_loss, **opts)
            else:  # a trained output layer: checkpointing
                logp, entropy = token_logprobs(hidden, targets, head, **opts)
                loss, logp = token_loss(logp, slice(None)).sum(), logp.detach()
            if gathered is not None:  # the earlier chunks' gradient goes into the prefix with this loss's backward
                loss = bridge_gradient(loss, states, gathered)
            return logp, entropy, loss

    def _rows(self, base: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's (B * T, H) output on rows of packed or padded traces."""
        bounds = _trace_bounds(position_ids) if self.batching == "varlen" else {}
        if base.config._attn_implementation == attention.NAME and self.batching != "padded":
            bounds["trace_spans"] = attention.trace_spans(position_ids)
        out = base.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden.flatten(0, 1)

    def _prefix_states(
        self, base: Any, prefix: SharedPrefix, reference: bool
    ) -> tuple[PrefixStates, PrefixStates | None]:
        """The states this chunk's tails read and, on a family's last chunk when training, the detached copies the
        earlier ones read, whose gathered gradient its loss hands on (train/prefix.py)."""
        grad = torch.is_grad_enabled()
        key = (prefix.family, reference, grad)
        if prefix.first:
            states = self._prefix(base, prefix.input_ids)
            if prefix.last:
                return states, None
            # The live states (with their graph when training) wait for the last chunk; the chunks before it read
            # detached copies, so the backward runs through the prefix once.
            read = states.detached(requires_grad=grad)
            self._prefixes[key] = (states, read)
            return read, None
        if key not in self._prefixes:
            raise RuntimeError(f"a later chunk of shared-prefix family {prefix.family} came before its first chunk")
        live, read = self._prefixes[key]
        if not prefix.last:
            return read, None
        del self._prefixes[key]
        return (live, read) if grad else (read, None)

    def _prefix(self, base: Any, input_ids: torch.Tensor) -> PrefixStates:
        """The (1, P) prefix through the decoder, every layer's states recorded."""
        states = PrefixStates()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        out = base.get_decoder()(input_ids=input_ids, position_ids=positions, cache=Record(states), use_cache=False)
        states.hidden = out.last_hidden_state[0]  # (P, H)
        return states


def _trace_bounds(position_ids: torch.Tensor) -> dict[str, Any]:
    """The traces of a packed row (1, T), found where positions restart at 0, in the forms the varlen kernels read:
    cumulative lengths (n + 1,) and each token's trace index (1, T)."""
    starts = position_ids[0] == 0  # (T,)
    cu = torch.cat([starts.nonzero()[:, 0], starts.new_tensor([starts.numel()], dtype=torch.long)]).int()  # (n + 1,)
    longest = int((cu[1:] - cu[:-1]).max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "seq_idx": (starts.cumsum(0) - 1).int()[None],  # (1, T)
    }


def _missing_varlen_kernels() -> list[str]:
    """The varlen kernel packages that transformers would not use: absent, too old (its own checks), or failing to
    import (its kernel wrapper then falls back to torch, which refuses trace bounds)."""
    from transformers.utils.import_utils import is_causal_conv1d_available, is_flash_linear_attention_available

    missing = []
    for package, usable in (
        ("fla", is_flash_linear_attention_available),
        ("causal_conv1d", is_causal_conv1d_available),
    ):
        try:
            ok = usable() and importlib.import_module(package) is not None
        except (ImportError, OSError, RuntimeError):  # a broken install: missing symbols, CUDA libraries
            ok = False
        if not ok:
            missing.append(package)
    return missing


def lora_target_names(model: Any) -> list[str]:
    """What ``--lora-targets all-linear`` resolves to: the leaf names of every linear layer of the decoder, the
    output layer aside (the form vLLM expects)."""
    head = model.get_output_embeddings()
    linear = (n for n, m in model.get_decoder().named_modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return sorted({n.rsplit(".", 1)[-1] for n in linear})


def choose_batching(model: Any) -> tuple[Batching, str]:
    """How traces may share a forward pass of ``model`` (see the module doc), and why, from its config and modules."""
    text = model.config.get_text_config()
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) - _MASKED_LAYERS)
    parts = [f"{', '.join(kinds)} layers"] if kinds else []
    if any(isinstance(m, torch.nn.Conv1d) for m in model.get_decoder().modules()):
        parts.append("convolutions")
    if not parts:
        return "packed", "every layer is attention: traces packed in a row are kept apart by mask"
    stateful = f"{text.model_type}'s {' and '.join(parts)} carry state along a row"
    kernels = _missing_varlen_kernels()
    if text.model_type in _VARLEN_MODEL_TYPES and torch.cuda.is_available() and not kernels:
        return "varlen", f"{stateful}: packed, their varlen kernels restart it at each trace"
    missing = (
        "no CUDA device"
        if not torch.cuda.is_available()
        else f"{' and '.join(kernels)} not installed"
        if kernels
        else "no varlen kernels known for it"
    )
    return "padded", f"{stateful} and a mask cannot stop it ({missing}): one trace a row, right-padded"


def _softcapped(head: torch.nn.Module, cap: float, hidden: torch.Tensor) -> torch.Tensor:
    return torch.tanh(head(hidden) / cap) * cap


def enable_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in the backward (non-reentrant), keeping the cache argument by which
    ``--share-prefix`` records and branches a prefix (transformers drops it from checkpointed layers otherwise)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.activation_checkpointing_enable({"use_reentrant": False})
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer._can_checkpoint_with_cache = True


def load_policy(cfg: PolicyConfig, mixed_precision: str) -> Policy:
    """The base model, in the dtype ``--dtype`` gives (train/precision.py: auto measures bf16 on the CPU), with a
    fresh LoRA, or with --adapter made trainable."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype, dtype_reason = choose_dtype(cfg.dtype, mixed_precision)
    # Unset, the trainer's own backend: each packed trace attends within its bounds, with no (T, T) mask.
    backend = cfg.attn_implementation or attention.register()
    base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, attn_implementation=backend)
    if backend == attention.NAME and getattr(base.config.get_text_config(), "attn_logit_softcapping", None):
        raise TrainConfigError(
            f"{cfg.model}: attention logit soft-capping, which the trainer's attention does not apply; "
            "pass --attn-implementation eager"
        )
    base.config.use_cache = False
    if cfg.gradient_checkpointing:
        enable_checkpointing(base)
    with warnings.catch_warnings():
        # peft reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if cfg.adapter is not None:
            peft_model = PeftModel.from_pretrained(base, str(cfg.adapter), is_trainable=True)
        else:
            targets = list(cfg.lora_targets)
            if targets == ["all-linear"]:
                targets = lora_target_names(base)
            lora = LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=targets,
                task_type="CAUSAL_LM",
            )
            peft_model = get_peft_model(base, lora)
    check_lora_targets(peft_model)
    policy = Policy(peft_model, cfg)
    policy.dtype_reason = f"{str(dtype).removeprefix('torch.')} ({dtype_reason})"
    return policy


def check_lora_targets(peft_model: Any) -> None:
    """Refuse, at training start, an adapter that vLLM could not hot-load after the run (docs/training.md).

    vLLM (0.32) loads LoRA weights onto its linear and embedding layers. Qwen3.5's convolution is a ``Conv1d``
    here but a linear layer of another shape in vLLM, and vLLM fuses the Gated DeltaNet projections
    ``in_proj_qkv`` + ``in_proj_z`` into one layer, ``in_proj_qkvz``, where an adapter on ``in_proj_z`` can only
    follow one on ``in_proj_qkv`` (its loader infers the slices a missing member covers as all that remain)."""
    from peft.tuners.lora import LoraLayer

    adapted: dict[str, torch.nn.Module] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            adapted.setdefault(name.rsplit(".", 1)[-1], module.get_base_layer())
    if not adapted:
        raise TrainConfigError("--lora-targets matches no module of the model")
    if other := sorted(n for n, m in adapted.items() if not isinstance(m, torch.nn.Linear | torch.nn.Embedding)):
        kinds = ", ".join(f"{n} ({type(adapted[n]).__name__})" for n in other)
        raise TrainConfigError(f"--lora-targets: vLLM loads LoRA on linear and embedding layers only, not {kinds}")
    if "in_proj_z" in adapted and "in_proj_qkv" not in adapted:
        raise TrainConfigError(
            "--lora-targets adapts in_proj_z but not in_proj_qkv: vLLM fuses the two into in_proj_qkvz and cannot "
            "load an adapter on in_proj_z alone; add in_proj_qkv"
        )


def check_vocabulary(policy: Policy, traces: Sequence[Trace]) -> None:
    """Refuse token ids the model has no embedding for: the data was made with another tokenizer."""
    vocab = policy.peft.get_base_model().get_input_embeddings().num_embeddings
    if (top := max(int(t.tokens.max()) for t in traces)) >= vocab:
        raise DataError(f"token id {top} is outside the model's vocabulary ({vocab}): wrong --model for this data?")
