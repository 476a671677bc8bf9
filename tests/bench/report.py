"""Statistics, targets and tables (rich and Markdown) for ``python -m tests.bench.proxy``.

Pure functions over plain dicts: ``summarize`` one path's samples, ``evaluate`` the targets,
``console_tables`` and ``markdown`` render them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["METRICS", "PATHS", "console_tables", "evaluate", "markdown", "percentile", "summarize", "write_results"]

# "streaming" is mitmdump with streaming on and nothing recorded: the fair baseline for streams, which bare
# mitmdump buffers whole (the addon streams them, chunk by chunk).
# "hooks" is mitmdump with a script that has the addon's per-call hooks, each doing nothing: what mitmproxy itself
# costs per call to host them, so that addon - hooks is the addon's own work.
PATHS = {
    "direct": "direct",
    "mitmdump": "bare mitmdump",
    "streaming": "mitmdump, streaming on",
    "hooks": "mitmdump + empty hooks",
    "addon": "mitmdump + addon",
}
OPTIONAL_PATHS = ("streaming", "hooks")  # shown when measured

# (key in a summary, label, unit, decimals)
METRICS = [
    ("latency_median_ms", "non-streamed latency, median", "ms", 2),
    ("latency_p99_ms", "non-streamed latency, p99", "ms", 2),
    ("first_byte_median_ms", "stream first byte, median", "ms", 2),
    ("stream_total_median_ms", "stream total, median", "ms", 2),
    ("rps_c1", "requests/s, concurrency 1", "req/s", 0),
    ("rps_cn", "requests/s, concurrency {n}", "req/s", 0),
    ("cpu_ms_latency", "proxy CPU per non-streamed request", "ms", 2),
    ("cpu_ms_stream", "proxy CPU per stream", "ms", 2),
    ("cpu_ms_concurrent", "proxy CPU per request, concurrency {n}", "ms", 2),
]


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None when there are no samples."""
    if not xs:
        return None
    s = sorted(xs)
    rank = -(-q * len(s) // 100)  # ceil(q/100 * n)
    return float(s[min(len(s), max(1, int(rank))) - 1])


def summarize(
    *,
    lat_ms: Sequence[float],
    ttfb_ms: Sequence[float],
    stream_ms: Sequence[float],
    rps1: Sequence[float],
    rpsn: Sequence[float],
    cpu_ms: dict[str, float],
) -> dict[str, float | None]:
    """Pooled latency percentiles over all rounds; throughput is the median of the per-round values;
    ``cpu_ms`` maps a workload (latency, stream, concurrent) to the proxy's CPU ms per request."""
    return {
        "latency_median_ms": percentile(lat_ms, 50),
        "latency_p99_ms": percentile(lat_ms, 99),
        "first_byte_median_ms": percentile(ttfb_ms, 50),
        "stream_total_median_ms": percentile(stream_ms, 50),
        "rps_c1": statistics.median(rps1) if rps1 else None,
        "rps_cn": statistics.median(rpsn) if rpsn else None,
        **{f"cpu_ms_{k}": cpu_ms.get(k) for k in ("latency", "stream", "concurrent")},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def evaluate(stats: dict[str, dict[str, float | None]], concurrency: int) -> list[dict[str, object]]:
    """The targets with their measured value and PASS / MISS ("n/a" when a path has no data)."""
    d, b, s, h, u, a = (stats.get(k, {}) for k in ("direct", "mitmdump", "streaming", "hooks", "unrecorded", "addon"))
    fb_a, fb_d = a.get("first_byte_median_ms"), d.get("first_byte_median_ms")
    rows: list[tuple[str, float | None, str | None, float, str]] = [
        (
            "addon / bare, median latency",
            _ratio(a.get("latency_median_ms"), b.get("latency_median_ms")),
            "<=",
            1.10,
            "x",
        ),
        ("addon / bare, p99 latency", _ratio(a.get("latency_p99_ms"), b.get("latency_p99_ms")), None, 0, "x"),
        # Less sensitive to other load on the machine than wall-clock time.
        (
            "addon / bare, proxy CPU per request",
            _ratio(a.get("cpu_ms_latency"), b.get("cpu_ms_latency")),
            "<=",
            1.10,
            "x",
        ),
        (
            "addon / streaming on, proxy CPU per stream",
            _ratio(a.get("cpu_ms_stream"), s.get("cpu_ms_stream")),
            "<=",
            1.3,
            "x",
        ),
        # Context: bare mitmdump buffers a stream and sends it in one piece, which costs less than passing it on.
        ("addon / bare, proxy CPU per stream", _ratio(a.get("cpu_ms_stream"), b.get("cpu_ms_stream")), None, 0, "x"),
        ("addon - direct, stream first byte", _diff(fb_a, fb_d), "<=", 5.0, "ms"),
        # The fair one: mitmproxy's own handling of a ~100 KB request comes before any first byte.
        ("addon - streaming on, stream first byte", _diff(fb_a, s.get("first_byte_median_ms")), "<=", 5.0, "ms"),
        # Context for the row above: what bare mitmdump adds to a request of this size on this machine.
        (
            "bare - direct, non-streamed median",
            _diff(b.get("latency_median_ms"), d.get("latency_median_ms")),
            None,
            0,
            "ms",
        ),
        # Where the CPU per request goes: mitmproxy hosting the addon's hooks, the addon's request handling, recording.
        *(
            (
                f"{num} - {den}, proxy CPU per request",
                _diff(x.get("cpu_ms_latency"), y.get("cpu_ms_latency")),
                None,
                0,
                "ms",
            )
            for num, x, den, y in (
                ("hooks", h, "bare", b),
                ("unrecorded", u, "hooks", h),
                ("addon", a, "unrecorded", u),
            )
        ),
        ("addon / bare, req/s at concurrency 1", _ratio(a.get("rps_c1"), b.get("rps_c1")), ">=", 0.90, "x"),
        (
            f"addon / bare, req/s at concurrency {concurrency}",
            _ratio(a.get("rps_cn"), b.get("rps_cn")),
            ">=",
            0.90,
            "x",
        ),
    ]
    out: list[dict[str, object]] = []
    for name, value, op, limit, unit in rows:
        if value is None:
            result = "n/a"
        elif op is None:
            result = "info"
        else:
            result = "PASS" if (value <= limit if op == "<=" else value >= limit) else "MISS"
        target = "-" if op is None else f"{op} {limit:g} {unit}" if unit == "ms" else f"{op} {limit:g}x"
        out.append({"name": name, "value": value, "unit": unit, "target": target, "result": result})
    return out


def _fmt(v: float | None, decimals: int) -> str:
    return "-" if v is None else f"{v:,.{decimals}f}"


def _fmt_value(row: dict[str, object]) -> str:
    v = row["value"]
    if not isinstance(v, float):
        return "-"
    return f"{v:+.2f} ms" if row["unit"] == "ms" else f"{v:.2f}x"


# (numerator, denominator, heading) of the ratio columns
_RATIOS = [("mitmdump", "direct", "bare / direct"), ("addon", "mitmdump", "addon / bare")]
_STREAMING_RATIO = ("addon", "streaming", "addon / streaming on")
_HOOKS_RATIOS = [("hooks", "mitmdump", "empty hooks / bare"), ("addon", "hooks", "addon / empty hooks")]


def _columns(stats: dict[str, dict[str, float | None]]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The paths and ratio columns of the metrics table; the optional paths' only when they were measured."""
    paths = [p for p in PATHS if p not in OPTIONAL_PATHS or p in stats]
    ratios = [
        *_RATIOS,
        *([_STREAMING_RATIO] if "streaming" in stats else []),
        *(_HOOKS_RATIOS if "hooks" in stats else []),
    ]
    return paths, ratios


def _metric_rows(stats: dict[str, dict[str, float | None]], concurrency: int) -> list[list[str]]:
    paths, ratios = _columns(stats)
    rows = []
    for key, label, unit, dec in METRICS:
        vals = {p: stats.get(p, {}).get(key) for p in paths}
        rs = [_ratio(vals[num], vals[den]) for num, den, _ in ratios]
        rows.append(
            [f"{label.format(n=concurrency)} ({unit})"]
            + [_fmt(vals[p], dec) for p in paths]
            + ["-" if r is None else f"{r:.2f}x" for r in rs]
        )
    return rows


def _head(stats: dict[str, dict[str, float | None]]) -> list[str]:
    paths, ratios = _columns(stats)
    return ["metric", *(PATHS[p] for p in paths), *(heading for _, _, heading in ratios)]


_THEAD = ["target", "measured", "limit", "result"]


def console_tables(
    stats: dict[str, dict[str, float | None]], targets: list[dict[str, object]], concurrency: int
) -> tuple[Table, Table]:
    t1 = Table(title="Proxy overhead (loopback)")
    for i, h in enumerate(_head(stats)):
        t1.add_column(h, justify="left" if i == 0 else "right")
    for row in _metric_rows(stats, concurrency):
        t1.add_row(*row)
    t2 = Table(title="Targets")
    for i, h in enumerate(_THEAD):
        t2.add_column(h, justify="left" if i == 0 else "right")
    colour = {"PASS": "green", "MISS": "red", "n/a": "yellow", "info": "dim"}
    for r in targets:
        res = str(r["result"])
        t2.add_row(str(r["name"]), _fmt_value(r), str(r["target"]), f"[{colour[res]}]{res}[/]")
    return t1, t2


def markdown(
    stats: dict[str, dict[str, float | None]],
    targets: list[dict[str, object]],
    concurrency: int,
    notes: Sequence[str],
    extra: Sequence[str] = (),
) -> str:
    """Two Markdown tables (metrics per path, targets) followed by notes, for the README to include;
    ``extra`` lines (another table) go between the two."""

    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        align = ["---"] + ["---:"] * (len(head) - 1)
        return ["| " + " | ".join(r) + " |" for r in [head, align, *rows]]

    lines = [*table(_head(stats), _metric_rows(stats, concurrency)), ""]
    lines += [*extra, ""] if extra else []
    lines += table(_THEAD, [[str(r["name"]), _fmt_value(r), str(r["target"]), str(r["result"])] for r in targets])
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_results(
    console: Console,
    out: Path,
    config: Any,
    tables: Sequence[tuple[list[str], list[list[str]]]],
    notes: list[str],
    data: dict[str, Any],
) -> None:
    """Print ``tables`` ((head, rows) pairs); write them and ``notes`` as Markdown to ``out``, and ``data`` with the
    config (a dataclass) and the notes as JSON next to it: what tests.bench.server and tests.bench.train write."""
    lines: list[str] = []
    for head, rows in tables:
        table = Table(*head)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        lines += ["| " + " | ".join(r) + " |" for r in [head, ["---"] + ["---:"] * (len(head) - 1), *rows]] + [""]
    lines += [f"- {n}" for n in notes]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
    doc = {"config": settings, **data, "notes": notes}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
