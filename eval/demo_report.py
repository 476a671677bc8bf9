"""Numbers and views of a demo run folder (``python -m eval.demo``): its summary, report.html, a trace's tokens.

    python -m eval.demo_report [RUN]               # recount summary.json and report.html after rerunning a phase

    from eval import demo_report
    run = demo_report.find_run()                   # the newest runs/demo/<time>/, or find_run("runs/demo/...")
    numbers = demo_report.summary(run)             # what summary.json holds, recomputed from the files
    html = demo_report.trace_html(row, tokenizer)  # a trace's response tokens coloured by loss mask, drift marked

eval/demo.py writes summary.json and report.html with these; the notebooks in notebooks/ call them and read the
run's files, nothing else. The run folder's layout is in eval/demo.py's docstring. Charts are plain SVG, like
eval/report.py's, so the demo needs no plotting library.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

import polars as pl
import tyro
from rich.console import Console
from rich.table import Table

from eval.report import svg_chart
from eval.runs import read_rewards, read_sessions
from reconstruct import Stats, discover, file_stats, schema, stats_path

__all__ = [
    "ADAPTER_NAME",
    "PHASES",
    "conversation_html",
    "find_run",
    "metrics",
    "metrics_svg",
    "note",
    "pass_rate_svg",
    "phase_numbers",
    "report_html",
    "rewards",
    "sessions",
    "side_by_side",
    "summary",
    "summary_rows",
    "trace_html",
    "train_numbers",
    "trajectories_path",
    "write_summary",
]

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("before", "after")  # rollouts of the base model, then of the base model with the trained adapter
ADAPTER_NAME = "demo-adapter"  # the name the adapter is served under (vLLM's lora_name)
CHARTED = ("loss/total", "reward/mean", "policy/entropy", "policy/approx_kl", "optim/grad_norm", "perf/tokens_per_s")


def find_run(path: str | Path | None = None) -> Path:
    """``path``, or the newest run under runs/demo/ that has a summary.json."""
    if path:
        return Path(path)
    runs = sorted(p.parent for p in (ROOT / "runs" / "demo").glob("*/summary.json"))
    if not runs:
        raise FileNotFoundError(f"no finished demo run under {ROOT / 'runs' / 'demo'}: run `make demo` first")
    return runs[-1]


def trajectories_path(run: Path, phase: str) -> Path:
    """The trainer's input is RUN/trajectories.parquet (before); the after phase's is RUN/trajectories.after.parquet."""
    return run / ("trajectories.parquet" if phase == "before" else f"trajectories.{phase}.parquet")


# ---- numbers


def phase_numbers(run: Path, phase: str) -> dict[str, Any]:
    """One rollout phase: sessions, captured calls, traces, tokens, chain breaks, rewards, pass rate."""
    sessions_df, rewards_df = read_sessions(run / phase), read_rewards(run / phase)
    traj = schema.read(trajectories_path(run, phase))
    saved = Stats.from_dict(json.loads(stats_path(trajectories_path(run, phase)).read_text()))
    stats = file_stats(traj, saved)
    captured = sum(1 for f in discover([run / "captures" / phase]) for line in f.read_bytes().split(b"\n") if line)
    graded, resolved = rewards_df.height, int(rewards_df["resolved"].fill_null(False).sum())
    return {
        "sessions": sessions_df.height,
        "statuses": dict(sorted(sessions_df["status"].value_counts().iter_rows())),
        "calls_captured": captured,
        "calls_in_traces": stats.merged_calls,
        "traces": stats.traces,
        "sessions_traced": stats.sessions,
        "calls_per_trace_mean": round(stats.calls_per_trace, 3),
        "calls_per_trace_max": stats.max_calls_per_trace,
        "tokens_prompt": stats.tokens_prompt,
        "tokens_trainable": stats.tokens_trainable,
        "tokens_masked": stats.tokens_masked,
        "chain_breaks": {cause: n for cause, n in stats.breaks.items() if n},
        "dropped_calls": stats.dropped,
        "rewarded_traces": traj.filter(pl.col("reward").is_not_null()).height,
        "graded": graded,
        "resolved": resolved,
        "pass_rate": resolved / graded if graded else None,
        "reward_reasons": dict(sorted(rewards_df["reason"].value_counts().iter_rows())),
    }


def metrics(run: Path) -> pl.DataFrame:
    """train/grpo.py's metrics log (RUN/adapter/metrics.jsonl), one row per step; step 0 describes the data."""
    rows = [json.loads(line) for line in (run / "adapter" / "metrics.jsonl").read_text().splitlines() if line]
    return pl.DataFrame(rows, infer_schema_length=None)


def train_numbers(run: Path) -> dict[str, Any]:
    """What GRPO did: groups with a learning signal, steps run, and the per-step metrics worth reading."""
    df = metrics(run)
    data = df.filter(pl.col("step") == 0).row(0, named=True)
    steps = df.filter(pl.col("step") > 0)
    groups = int(data["data/groups"])
    return {
        "sessions": int(data["data/sessions"]),
        "groups": groups,
        "groups_with_signal": round(groups * (1 - data["reward/zero_std_frac"])),
        "steps": steps.height,
        "per_step": steps.select([c for c in ("step", *CHARTED) if c in steps.columns]).to_dicts(),
    }


def summary(run: Path) -> dict[str, Any]:
    """Every number of summary.json, from the run's files."""
    return {"run": str(run), **{phase: phase_numbers(run, phase) for phase in PHASES}, "train": train_numbers(run)}


def _rate(numbers: dict[str, Any]) -> str:
    rate = numbers["pass_rate"]
    return f"{numbers['resolved']} / {numbers['graded']}" + ("" if rate is None else f" ({rate:.0%})")


def note(numbers: dict[str, Any]) -> str:
    """The honest reading of a run, in a sentence or two."""
    before, after, train = numbers["before"], numbers["after"], numbers["train"]
    if train["steps"] == 0:
        return (
            f"No learning signal: within every task the {before['graded'] // max(train['groups'], 1)} samples got the "
            f"same reward (resolved {_rate(before)}), so GRPO skipped all {train['groups']} groups and the adapter is "
            "the starting LoRA, identical to the base model. The loop ran end to end; the after numbers are sampling "
            "noise, not learning."
        )
    return (
        f"GRPO ran {train['steps']} step(s) on {train['groups_with_signal']} of {train['groups']} groups. Pass rate "
        f"before {_rate(before)}, after {_rate(after)}: with this few samples a difference is noise unless it is "
        "large; the demo shows the machinery, not a claim of improvement."
    )


def summary_rows(numbers: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(what, before, after) rows of the summary table; training rows fill the before column."""
    b, a, t = numbers["before"], numbers["after"], numbers["train"]

    def both(key: str, fmt: str = "{:,}") -> tuple[str, str]:
        return fmt.format(b[key]), fmt.format(a[key])

    def breaks(n: dict[str, Any]) -> str:
        return ", ".join(f"{cause} {k}" for cause, k in n["chain_breaks"].items()) or "none"

    rows = [
        ("sessions (tasks x samples)", *both("sessions")),
        ("session statuses", *(", ".join(f"{s} {k}" for s, k in n["statuses"].items()) for n in (b, a))),
        ("model calls captured", *both("calls_captured")),
        ("traces (sessions traced)", *(f"{n['traces']:,} ({n['sessions_traced']})" for n in (b, a))),
        (
            "calls per trace: mean / max",
            *(f"{n['calls_per_trace_mean']:.2f} / {n['calls_per_trace_max']}" for n in (b, a)),
        ),
        ("chain breaks", breaks(b), breaks(a)),
        (
            "response tokens trainable / masked",
            *(f"{n['tokens_trainable']:,} / {n['tokens_masked']:,}" for n in (b, a)),
        ),
        ("rewarded traces", *both("rewarded_traces")),
        ("resolved / graded (pass rate)", _rate(b), _rate(a)),
        ("GRPO groups with a signal", f"{t['groups_with_signal']} of {t['groups']}", ""),
        ("GRPO steps", str(t["steps"]), ""),
    ]
    for step in t["per_step"]:
        loss, reward, grad = step.get("loss/total"), step.get("reward/mean"), step.get("optim/grad_norm")
        cells = [f"loss {loss:+.4f}" if loss is not None else "loss -", f"reward {reward:.2f}" if reward is not None
                 else "", f"grad {grad:.3g}" if grad is not None else ""]  # fmt: skip
        rows.append((f"  step {step['step']}", "  ".join(c for c in cells if c), ""))
    return rows


# ---- tables for the notebooks


def sessions(run: Path, phase: str) -> pl.DataFrame:
    """One row per session of a phase: task, sample, status, reward and what reconstruction made of it."""
    traces = (
        schema.read(trajectories_path(run, phase), columns=["session_id", "n_calls", "loss_mask"])
        .group_by("session_id")
        .agg(traces=pl.len(), calls=pl.col("n_calls").sum(), trainable=pl.col("loss_mask").list.sum().sum())
    )
    rewards_df = read_rewards(run / phase).select("session_id", "reward", "reason")
    return (
        read_sessions(run / phase)
        .select("session_id", "task_id", "sample_id", "harness", "status", "duration_s")
        .join(rewards_df, on="session_id", how="left", maintain_order="left")
        .join(traces, on="session_id", how="left", maintain_order="left")
        .with_columns(pl.lit(phase).alias("phase"))
    )


def rewards(run: Path) -> pl.DataFrame:
    """Mean reward and resolved count by phase, harness and task."""
    frames = [read_rewards(run / phase).with_columns(pl.lit(phase).alias("phase")) for phase in PHASES]
    return (
        pl.concat(frames)
        .group_by("phase", "harness", "task_id", maintain_order=True)
        .agg(samples=pl.len(), resolved=pl.col("resolved").fill_null(False).sum(), mean_reward=pl.col("reward").mean())
    )


# ---- views

_STYLE = (
    "<style>.tok{white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.6}"
    ".m1{background:#c9f2c7}.m0{color:#777}.drift{outline:2px solid #e15759}"
    ".msg{border-left:3px solid #aaa;margin:6px 0;padding:2px 8px;font-family:sans-serif;font-size:12px}"
    ".msg pre{white-space:pre-wrap;margin:2px 0}.role{font-weight:bold}</style>"
)


def trace_html(row: dict[str, Any], tokenizer: Any) -> str:
    """A trace as the trainer sees it: prompt folded, then each response token, green where it is trained on
    (loss mask 1, sampled), grey where masked (tool results, template glue); a sampled turn listed in drift_turns
    is outlined red. ``row`` is a trajectories row (schema.read(...).row(i, named=True))."""
    drift, turn, previous = set(row["drift_turns"] or []), -1, 0
    spans = []
    for token, mask in zip(row["response_ids"], row["loss_mask"], strict=True):
        turn += mask == 1 and previous == 0  # each run of sampled tokens is the next call's answer
        previous = mask
        css = "m1 drift" if mask and turn in drift else "m1" if mask else "m0"
        spans.append(f'<span class="{css}">{escape(tokenizer.decode([token]))}</span>')
    prompt = escape(tokenizer.decode(row["prompt_ids"]))
    head = (
        f"<b>{escape(row['trace_id'])}</b>: task {escape(str(row['task_id']))}, reward {row['reward']}, "
        f"{row['n_calls']} calls, {len(row['prompt_ids'])} prompt tokens, {sum(row['loss_mask'])} trained / "
        f"{len(row['loss_mask']) - sum(row['loss_mask'])} masked response tokens"
        + (f", chain {row['chain_index']} of its session (the chain broke before it)" if row["chain_index"] else "")
    )
    return (
        f"{_STYLE}<div>{head}<details><summary>prompt</summary><div class='tok'>{prompt}</div></details>"
        f"<div class='tok'>{''.join(spans)}</div></div>"
    )


def conversation_html(messages: str) -> str:
    """A trace's ``messages`` column (the last call's request and its answer) as the harness exchanged it."""
    parts = [_STYLE]
    for m in json.loads(messages)["messages"]:
        body = [f"<div class='role'>{escape(m['role'])}</div>"]
        for key in ("reasoning", "content"):
            text = m.get(key)
            if isinstance(text, list):  # content parts
                text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
            if text:
                body.append(f"<pre>{'(reasoning) ' if key == 'reasoning' else ''}{escape(text[:3000])}</pre>")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            body.append(f"<pre>→ {escape(fn.get('name', ''))}({escape(str(fn.get('arguments', '')))})</pre>")
        parts.append(f"<div class='msg'>{''.join(body)}</div>")
    return "".join(parts)


def side_by_side(left: str, right: str) -> str:
    return (
        "<div style='display:flex;gap:16px'><div style='flex:1;min-width:0'>"
        f"{left}</div><div style='flex:1;min-width:0'>{right}</div></div>"
    )


def pass_rate_svg(numbers: dict[str, Any]) -> str:
    """Bars: resolved share before (base model) and after (adapter)."""
    labels = {"before": "before: base model", "after": f"after: {ADAPTER_NAME}"}
    frame = pl.DataFrame(
        {"harness": [labels[p] for p in PHASES], "pass@1": [numbers[p]["pass_rate"] for p in PHASES]},
        schema={"harness": pl.String, "pass@1": pl.Float64},
    )
    return svg_chart(frame, (1,), "pass rate (resolved / graded sessions)")


def metrics_svg(per_step: list[dict[str, Any]]) -> str:
    """One small line chart per training metric, x = optimizer step."""
    panels, w, h, pad = [], 240, 140, 30
    for key in CHARTED:
        points = [(r["step"], r[key]) for r in per_step if r.get(key) is not None]
        if not points:
            continue
        lo, hi = min(v for _, v in points), max(v for _, v in points)
        span, steps = (hi - lo) or 1.0, max(s for s, _ in points)
        xy = [(pad + (w - 2 * pad) * (s - 1) / max(steps - 1, 1), h - pad - (h - 2 * pad) * (v - lo) / span)
              for s, v in points]  # fmt: skip
        x0 = len(panels) * (w + 10)
        dots = "".join(f'<circle cx="{x0 + x:.1f}" cy="{y:.1f}" r="3" fill="#4e79a7"/>' for x, y in xy)
        line = " ".join(f"{x0 + x:.1f},{y:.1f}" for x, y in xy)
        panels.append(
            f'<text x="{x0 + pad}" y="14">{escape(key)}</text>'
            f'<rect x="{x0 + pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#ddd"/>'
            f'<polyline points="{line}" fill="none" stroke="#4e79a7"/>{dots}'
            f'<text x="{x0 + 2}" y="{pad + 4}" font-size="9">{hi:.3g}</text>'
            f'<text x="{x0 + 2}" y="{h - pad}" font-size="9">{lo:.3g}</text>'
            f'<text x="{x0 + w / 2}" y="{h - 8}" font-size="9" text-anchor="middle">step 1..{steps}</text>'
        )
    width = max(len(panels), 1) * (w + 10)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" font-family="sans-serif" '
        f'font-size="11">{"".join(panels)}</svg>'
    )


def report_html(numbers: dict[str, Any]) -> str:
    """report.html: the note, the summary table, both charts and the command of every phase (``phases``)."""
    table = "".join(
        f"<tr><td>{escape(what)}</td><td>{escape(b)}</td><td>{escape(a)}</td></tr>"
        for what, b, a in summary_rows(numbers)
    )
    steps = numbers["train"]["per_step"]
    training = metrics_svg(steps) if steps else "<p>No optimizer step ran (no group had reward variance).</p>"
    rerun = "".join(
        f"<li>{escape(p['phase'])} ({p['seconds']:.0f} s)<pre>{escape(chr(10).join(p['commands']))}</pre></li>"
        for p in numbers["phases"]
        if p["commands"]
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>polar-rl demo {escape(Path(numbers["run"]).name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:24px auto}}td{{padding:2px 12px}}
tr:nth-child(even){{background:#f4f4f4}}pre{{background:#f4f4f4;padding:6px;white-space:pre-wrap}}</style></head>
<body><h1>polar-rl demo: {escape(numbers["run"])}</h1>
<p>{escape(note(numbers))}</p>
<table><tr><th></th><th>before (base model)</th><th>after ({ADAPTER_NAME})</th></tr>{table}</table>
<h2>Pass rate</h2>{pass_rate_svg(numbers)}
<h2>Training metrics</h2>{training}
<h2>Rerun a phase</h2><ol>{rerun}</ol>
</body></html>
"""


# ---- summary.json and report.html


def write_summary(run: Path, record: dict[str, Any]) -> dict[str, Any]:
    """summary.json and report.html of ``run``: ``record`` (phases with commands and seconds, config, model) plus
    every number recounted from the files, and the note. Returns what summary.json holds."""
    numbers = summary(run)
    full = {**record, **numbers, "note": note(numbers)}
    (run / "summary.json").write_text(json.dumps(full, indent=1) + "\n")
    (run / "report.html").write_text(report_html(full))
    return full


def summary_table(numbers: dict[str, Any]) -> Table:
    table = Table(title=f"demo summary: {numbers['run']}")
    for column in ("", "before (base model)", f"after ({ADAPTER_NAME})"):
        table.add_column(column)
    for row in summary_rows(numbers):
        table.add_row(*row)
    return table


def main(run: tyro.conf.Positional[Path | None] = None) -> None:
    """Recount RUN's numbers (the newest run by default), rewrite summary.json and report.html, print the table."""
    run = find_run(run)
    record = json.loads((run / "summary.json").read_text())
    full = write_summary(run, {k: record[k] for k in ("model", "config", "phases", "seconds") if k in record})
    console = Console()
    console.print(summary_table(full))
    console.print(full["note"], highlight=False)
    print(f"wrote {run / 'summary.json'} and {run / 'report.html'}")


if __name__ == "__main__":
    tyro.cli(main, prog="python -m eval.demo_report")
