"""Statistics, the recorders' logs, tables (rich and Markdown) and notes for ``python -m tests.bench.litellm``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from rich.table import Table

from tests.bench.litellm_proxy import PIP_SPEC
from tests.bench.report import METRICS, summarize

__all__ = [
    "Logs",
    "count_lines",
    "log_problems",
    "markdown",
    "metrics_table",
    "notes",
    "ratio_rows",
    "summarize",
    "targets_table",
    "token_counts",
    "versions",
]

PATHS = {"direct": "direct", "mitmdump": "bare mitmdump", "addon": "mitmdump + addon", "litellm": "LiteLLM + logger"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(v: float | None, decimals: int) -> str:
    return "-" if v is None else f"{v:,.{decimals}f}"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


# ---------------------------------------------------------------- what the recorders logged


def token_counts(value: Any) -> tuple[int, int, int]:
    """(prompt token ids, sampled token ids, sampled-token log-probs) found anywhere in a JSON value.

    Strings holding JSON or an SSE stream (the addon keeps the upstream's body as text) are read
    too. Ids count under ``prompt_token_ids`` and ``token_ids`` keys; log-probs are the entries of
    ``logprobs.content`` lists (one per sampled token; their ``top_logprobs`` are not counted).
    """
    prompt = sampled = logprobs = 0

    def walk(v: Any) -> None:
        nonlocal prompt, sampled, logprobs
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "prompt_token_ids" and isinstance(x, list):
                    prompt += len(x)
                elif k == "token_ids" and isinstance(x, list):
                    sampled += len(x)
                elif k == "logprobs" and isinstance(x, dict) and isinstance(x.get("content"), list):
                    logprobs += len(x["content"])
                else:
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str) and v[:1] == "{":
            parsed = None
            with contextlib.suppress(ValueError):  # text that only looks like JSON
                parsed = json.loads(v)
            walk(parsed)
        elif isinstance(v, str) and v.startswith("data: "):
            for event in v.split("\n\n"):
                data = event.strip().removeprefix("data: ")
                if data[:1] == "{":
                    walk(data)

    walk(value)
    return prompt, sampled, logprobs


def count_lines(path: Path) -> int:
    """Newline-terminated lines in a file (0 when it does not exist): a line being written does not count."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


# The columns of the keeps table: where the token data was counted.
_KEEPS = {
    "upstream": "upstream sent",
    "addon": "addon record",
    "litellm_answer": "LiteLLM's answer to the client",
    "litellm": "LiteLLM log",
}


@dataclasses.dataclass
class _Scan:
    records: int = 0
    bytes: int = 0
    keeps: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # kind -> token_counts


def _scan(files: Sequence[Path], is_stream: Callable[[Any], bool], body: Callable[[Any], Any]) -> _Scan:
    """One pass over JSONL files: complete records, bytes, and the token counts of the first
    non-streamed and the first streamed record (only those are parsed: the logs run to 100s of MB)."""
    s = _Scan()
    for f in files:
        s.bytes += f.stat().st_size
        with f.open("rb") as fh:
            for line in fh:
                if not line.endswith(b"\n") or not line.strip():  # a torn or blank line is no record
                    continue
                s.records += 1
                if len(s.keeps) < 2:
                    rec = json.loads(line)
                    s.keeps.setdefault("streamed" if is_stream(rec) else "non-streamed", token_counts(body(rec)))
    return s


@dataclasses.dataclass
class Logs:
    """What each recorder wrote: records against calls sent, size, and the token data it kept."""

    sent: dict[str, int]  # calls sent through each recording path (warm-up included)
    records: dict[str, int]  # complete JSONL lines each wrote
    bytes: dict[str, int]
    keeps: dict[str, dict[str, tuple[int, int, int]]]  # upstream | addon | litellm -> kind -> token_counts

    @classmethod
    def read(
        cls,
        polar_dir: Path,
        litellm_log: Path,
        *,
        sent: dict[str, int],
        answers: dict[str, dict[str, tuple[int, int, int]]],
    ) -> Logs:
        """``answers``: token counts of what the upstream sent (``upstream``) and what LiteLLM passed on
        to its client (``litellm_answer``), for the columns beside the logs."""
        addon = _scan(sorted(polar_dir.rglob("*.jsonl")), lambda r: bool(r.get("streamed")), lambda r: r)
        litellm = _scan([litellm_log] if litellm_log.exists() else [], lambda r: bool(r.get("stream")), lambda r: r)
        return cls(
            sent=sent,
            records={"addon": addon.records, "litellm": litellm.records},
            bytes={"addon": addon.bytes, "litellm": litellm.bytes},
            keeps=answers | {"addon": addon.keeps, "litellm": litellm.keeps},
        )

    def invalid(self) -> list[str]:
        out = [
            f"{name} logged {self.records[name]} records for {self.sent[name]} calls"
            for name in ("addon", "litellm")
            if self.records[name] != self.sent[name]
        ]
        return out

    def _keeps(self, who: str, kind: str) -> str:
        c = self.keeps[who].get(kind)
        return "-" if c is None else f"{c[0]} prompt ids, {c[1]} sampled ids, {c[2]} log-probs"

    def _size(self, who: str) -> str:
        n = self.records[who]
        return f"{n} for {self.sent[who]} calls, {self.bytes[who] / n / 1000:.0f} KB each" if n else "none"

    def rows(self) -> list[list[str]]:
        return [
            ["non-streamed answer"] + [self._keeps(w, "non-streamed") for w in _KEEPS],
            [f"streamed answer ({self.keeps['upstream'].get('streamed', (0, 0, 0))[1]} chunks)"]
            + [self._keeps(w, "streamed") for w in _KEEPS],
            ["records", "-", self._size("addon"), "-", self._size("litellm")],
        ]

    def keeps_row(self) -> dict[str, object]:
        """One factual row for the targets table: what LiteLLM's log keeps of what our record keeps."""
        parts = []
        for kind in ("non-streamed", "streamed"):
            ours, theirs = self.keeps["addon"].get(kind), self.keeps["litellm"].get(kind)
            if ours is None or theirs is None:
                parts.append(f"{kind}: not seen")
                continue
            labels = ("prompt ids", "sampled ids", "log-probs")
            kept = [f"{label} {t}/{o}" for label, o, t in zip(labels, ours, theirs, strict=True)]
            parts.append(f"{kind}: " + ", ".join(kept))
        return {
            "name": "LiteLLM log keeps what our record keeps (LiteLLM/addon counts)",
            "value": None,
            "measured": "; ".join(parts),
            "target": "-",
            "result": "info",
        }

    def table(self) -> Table:
        t = Table(title="What each log keeps (first non-streamed and first streamed record)")
        for i, h in enumerate(["", *_KEEPS.values()]):
            t.add_column(h, justify="left" if i == 0 else "right")
        for row in self.rows():
            t.add_row(*row)
        return t

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def log_problems(log: Path | None) -> list[str]:
    """Lines of a proxy's own log that mention errors or warnings (the first 10)."""
    if log is None or not log.exists():
        return []
    words = ("error", "traceback", "exception", "warn")
    return [ln for ln in log.read_text(errors="replace").splitlines() if any(w in ln.lower() for w in words)][:10]


# ---------------------------------------------------------------- tables


def _metric_rows(stats: dict[str, dict[str, float | None]], concurrency: int) -> list[list[str]]:
    rows = []
    for key, label, unit, dec in METRICS:
        vals = [stats.get(p, {}).get(key) for p in PATHS]
        rows.append(
            [f"{label.format(n=concurrency)} ({unit})"]
            + [_fmt(v, dec) for v in vals]
            + [_fmt_ratio(_ratio(vals[2], vals[1])), _fmt_ratio(_ratio(vals[3], vals[2]))]
        )
    return rows


_HEAD = ["metric", *PATHS.values(), "addon / bare", "LiteLLM / addon"]
_THEAD = ["target", "measured", "limit", "result"]


def ratio_rows(stats: dict[str, dict[str, float | None]], concurrency: int) -> list[dict[str, object]]:
    """One "info" row per metric: LiteLLM's value over the addon's (above 1: LiteLLM takes more, or serves more)."""
    a, lt = stats.get("addon", {}), stats.get("litellm", {})
    out: list[dict[str, object]] = []
    for key, label, _, _ in METRICS:
        r = _ratio(lt.get(key), a.get(key))
        out.append(
            {
                "name": f"LiteLLM / addon, {label.format(n=concurrency)}",
                "value": r,
                "measured": _fmt_ratio(r),
                "target": "-",
                "result": "n/a" if r is None else "info",
            }
        )
    return out


def metrics_table(stats: dict[str, dict[str, float | None]], concurrency: int) -> Table:
    t = Table(title="LiteLLM proxy vs the capture addon (loopback, same upstream)")
    for i, h in enumerate(_HEAD):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in _metric_rows(stats, concurrency):
        t.add_row(*row)
    return t


def targets_table(rows: list[dict[str, object]]) -> Table:
    t = Table(title="Targets (none: where we stand)")
    for i, h in enumerate(_THEAD):
        t.add_column(h, justify="left" if i == 0 else "right")
    colour = {"info": "dim", "n/a": "yellow"}
    for r in rows:
        res = str(r["result"])
        t.add_row(str(r["name"]), str(r["measured"]), str(r["target"]), f"[{colour[res]}]{res}[/]")
    return t


def markdown(
    stats: dict[str, dict[str, float | None]],
    concurrency: int,
    logs: Logs,
    rows: list[dict[str, object]],
    notes: Sequence[str],
) -> str:
    """Three Markdown tables (metrics per path, what each log keeps, targets) and the notes."""

    def table(head: list[str], body: list[list[str]]) -> list[str]:
        align = ["---"] + ["---:"] * (len(head) - 1)
        return ["| " + " | ".join(r) + " |" for r in [head, align, *body]]

    lines = [*table(_HEAD, _metric_rows(stats, concurrency)), ""]
    lines += ["What each log keeps (first non-streamed and first streamed record):", ""]
    lines += [*table(["", *_KEEPS.values()], logs.rows()), ""]
    lines += table(_THEAD, [[str(r["name"]), str(r["measured"]), str(r["target"]), str(r["result"])] for r in rows])
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- notes


def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "mitmproxy": version("mitmproxy"),
        "httpx": version("httpx"),
        "litellm": PIP_SPEC,
    }


def notes(
    *,
    quick: bool,
    rounds: int,
    seq: int,
    streams: int,
    conc: int,
    body_kb: int,
    concurrency: int,
    chunks: int,
    elapsed: float,
) -> list[str]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    v = versions()
    return [
        (
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {'quick' if quick else 'full'} run ({elapsed:.0f} s measuring, "
            f"startup and a first venv install not counted), {platform.machine()} with {cpus} CPUs shared by client, "
            f"upstream and proxies; Python {v['python']}, mitmproxy {v['mitmproxy']}, httpx {v['httpx']}, {v['litellm']} "
            "(in .venv-litellm, same Python)."
        ),
        (
            f"{rounds} rounds rotating the order of the four paths; per path and round: {seq} non-streamed "
            f"{body_kb} KB agent requests on one keep-alive connection, {streams} streams of {chunks} SSE chunks "
            f"({body_kb} KB requests), {conc} requests over {concurrency} keep-alive connections. Every answer is "
            "checked (the upstream's text, whole; a stream's deltas joined and its final [DONE]); a wrong one counts as a failure."
        ),
        (
            "Latency percentiles pool all rounds; requests/s is the median over rounds. Proxy CPU is the user + system time "
            "of the proxy's process tree, read before and after each workload once it stops growing (up to 1 s), so work "
            "done after answering (LiteLLM logs in background tasks) is charged to the calls that caused it. Bare "
            "mitmdump buffers SSE, so its first byte is its total time."
        ),
        (
            "LiteLLM: `litellm --config` with the upstream as the OpenAI-compatible model `openai/bench-model` "
            "(api_base = the fake upstream), one uvicorn worker (its default; mitmdump is one process too), a master key "
            "(it refuses to start without one; no database, so no virtual keys or spend logs), otherwise its defaults "
            "(uvloop, one access-log line per request). Its recorder is a custom callback (tests/bench/litellm_logger.py) "
            "appending LiteLLM's `standard_logging_object` as one JSON line per call, serialised as its S3 and "
            "generic-API loggers do: the same payload LiteLLM's built-in loggers ship, written to a local file as our "
            "addon writes its records (LiteLLM has no local-file logger; the built-in ones need a remote service)."
        ),
        (
            "Both recorders see the same upstream answers: the fake upstream sends prompt token ids, sampled token ids "
            "and log-probs on every answer, whatever the request asks (the addon also asks for them; LiteLLM is not "
            "asked to). The keeps table counts them in the first non-streamed and first streamed record of each log, "
            "wherever they sit in it (inside text fields too), and in what LiteLLM passed on to its client. LiteLLM logs a "
            "stream as the response its stream_chunk_builder rebuilds from the chunks, which keeps the text, tool calls "
            "and usage but neither the ids nor the log-probs, though it forwards both to the client."
        ),
    ]
