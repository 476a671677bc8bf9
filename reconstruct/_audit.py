"""Re-score trajectories with a model and compare with the captured log-probs on every trainable token.

    report = audit(df, model, threshold=1e-2)     # df: a trajectory table; model: a transformers causal LM

Each trace is teacher-forced once (``prompt_ids ‖ response_ids``); the final hidden states go through the output
head ``chunk`` positions at a time, so the (T, V) logits never exist at once. Against the reference server
(``python -m eval serve``, float32, same weights) the differences are float noise (~1e-5); against a real vLLM they
measure the train/inference mismatch that importance-sampling corrections must absorb. Traces without log-probs
(retokenized) are skipped and counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import polars as pl
from rich.table import Table

__all__ = ["AuditReport", "audit", "score_trace"]

QUANTILES = (0.5, 0.9, 0.99)


@dataclasses.dataclass
class AuditReport:
    traces: int = 0
    skipped: int = 0  # traces without captured log-probs
    tokens: int = 0  # trainable tokens compared
    mean: float = 0.0
    quantiles: dict[str, float] = dataclasses.field(default_factory=dict)  # of |model - captured|
    max: float = 0.0
    threshold: float = 0.0
    above: int = 0  # tokens whose difference exceeds the threshold

    @property
    def share_above(self) -> float:
        return self.above / self.tokens if self.tokens else 0.0

    def table(self) -> Table:
        t = Table(title="audit: |model log-prob − captured log-prob| on trainable tokens", show_header=False)
        t.add_column("what")
        t.add_column("value", justify="right")
        t.add_row("traces audited / skipped (no log-probs)", f"{self.traces:,} / {self.skipped:,}")
        t.add_row("trainable tokens", f"{self.tokens:,}")
        t.add_row("mean", f"{self.mean:.3g}")
        for q, v in self.quantiles.items():
            t.add_row(q, f"{v:.3g}")
        t.add_row("max", f"{self.max:.3g}")
        t.add_row(f"share above {self.threshold:g}", f"{self.share_above:.2%} ({self.above:,})")
        return t


def score_trace(model: Any, prompt_ids: list[int], response_ids: list[int], *, chunk: int = 1024) -> Any:
    """The model's log-prob of each response token given everything before it: a float32 tensor (R,)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + response_ids], device=device)  # (1, T)
    with torch.inference_mode():
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]  # (T, H)
        head = model.get_output_embeddings()
        cap = getattr(model.config, "final_logit_softcapping", None)
        start = len(prompt_ids) - 1  # the position whose logits predict the first response token
        targets = ids[0, len(prompt_ids) :]  # (R,)
        out = []
        for i in range(0, len(response_ids), chunk):
            h = hidden[start + i : start + i + chunk]  # (C, H)
            logits = head(h).float()  # (C, V)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            logp = torch.log_softmax(logits, dim=-1)  # (C, V)
            out.append(logp.gather(1, targets[i : i + chunk, None])[:, 0])  # (C,)
        return torch.cat(out).cpu() if out else torch.zeros(0)


def audit(
    df: pl.DataFrame,
    model: Any,
    *,
    threshold: float = 1e-2,
    chunk: int = 1024,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> AuditReport:
    import torch

    report = AuditReport(threshold=threshold)
    diffs = []
    rows = df.select("prompt_ids", "response_ids", "loss_mask", "logprobs").iter_rows()
    for prompt, response, mask, captured in progress(rows) if progress else rows:
        if captured is None:
            report.skipped += 1
            continue
        scored = score_trace(model, prompt, response, chunk=chunk)  # (R,)
        keep = torch.tensor(mask, dtype=torch.bool)  # (R,)
        diffs.append((scored[keep] - torch.tensor(captured, dtype=torch.float32)[keep]).abs())
        report.traces += 1
    if diffs:
        d = torch.cat(diffs).double()
        report.tokens = int(d.numel())
        if report.tokens:
            report.mean = float(d.mean())
            report.max = float(d.max())
            values = np.quantile(d.numpy(), QUANTILES)
            report.quantiles = {f"p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, values, strict=True)}
            report.above = int((d > threshold).sum())
    return report
