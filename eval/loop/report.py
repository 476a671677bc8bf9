"""Numbers and views of a loop run folder (``python -m eval loop``, ``make demo``): pass rates per stage with
intervals, the tests of each stage's gain, throughput, training metrics, report.html, TensorBoard scalars, a trace's
tokens.

    python -m eval loop-report [RUN]               # recount summary.json, report.html, TensorBoard after a rerun

    from eval.loop import report as loop_report
    run = loop_report.find_run()                   # the newest runs/demo/<time>/, or find_run("runs/loop/...")
    numbers = loop_report.summary(run)             # what summary.json holds, recomputed from the files
    html = loop_report.trace_html(row, tokenizer)  # a trace's response tokens coloured by loss mask, drift marked

Statistics (eval/stats.py): a stage's pass@1 is resolved / graded sessions (temperature 1) with a 95 % Wilson
score interval, which stays inside [0, 1] and is honest at 0 or n successes where the normal one is not. Two
stages measured on the same tasks are compared task by task (paired): the mean per-task difference, its 95 %
interval by bootstrap over tasks, and the exact sign-flip permutation test over tasks (McNemar's exact test at
one sample a task); a gain is called "improved" only at that test's p < 0.05. Fisher's exact test on the pooled
counts (and Newcombe's interval) stays beside it: it treats the stages as independent samples, so it ignores
that a task easy for one stage tends to be easy for the other, and has less power.

eval/loop/run.py writes summary.json, report.html and the TensorBoard scalars with these after each stage; the
notebooks in notebooks/ call them and read the run's files, nothing else. Charts are plain SVG, like eval/report.py's,
so report.html needs no plotting library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import shutil
from html import escape
from pathlib import Path
from typing import Any

import polars as pl
import tyro
from rich.console import Console
from rich.table import Table

from eval.runs import read_rewards, read_sessions
from eval.stats import fisher_exact, newcombe, paired, wilson
from reconstruct import Stats, discover, file_stats, schema, stats_path

__all__ = [
    "ALPHA",
    "compare",
    "conversation_html",
    "find_run",
    "fisher_exact",
    "metrics",
    "metrics_svg",
    "note",
    "pass_rate_svg",
    "report_html",
    "rewards",
    "sessions",
    "side_by_side",
    "stage_names",
    "stage_numbers",
    "summary",
    "summary_rows",
    "trace_html",
    "train_numbers",
    "trajectories_path",
    "verdict_rows",
    "wilson",
    "write_summary",
]

ROOT = Path(__file__).resolve().parents[2]
ALPHA = 0.05  # the significance level of every verdict
CHARTED = ("loss/total", "reward/mean", "policy/entropy", "policy/approx_kl", "optim/grad_norm", "perf/tokens_per_s")


def stage_names(rounds: int) -> list[str]:
    """base (the model as shipped), sft (after the teacher sessions), then grpo1..grpo<rounds>."""
    return ["base", "sft", *(f"grpo{k}" for k in range(1, rounds + 1))]


def find_run(path: str | Path | None = None) -> Path:
    """``path``, or the newest run under runs/demo/ that has a summary.json."""
    if path:
        return Path(path)
    runs = sorted(p.parent for p in (ROOT / "runs" / "demo").glob("*/summary.json"))
    if not runs:
        raise FileNotFoundError(f"no finished demo run under {ROOT / 'runs' / 'demo'}: run `make demo` first")
    return runs[-1]


def trajectories_path(run: Path, stage: str) -> Path:
    """A stage's trained-task sessions as trajectories (rewards joined): RUN/<stage>/trajectories.parquet."""
    return run / stage / "trajectories.parquet"


def stages_of(run: Path) -> list[str]:
    """The stages a run folder holds, in loop order (teacher first when present)."""
    names = [p.parent.name for p in run.glob("*/trajectories.parquet")]  # not grpo<k>-draw<b>: dynamic sampling's
    grpo = sorted((n for n in names if n.startswith("grpo") and n[4:].isdigit()), key=lambda n: int(n[4:]))
    return [n for n in ("teacher", "base", "sft") if n in names] + grpo


# ---- statistics


def compare(before: dict[str, Any], after: dict[str, Any], what: str, split: str = "trained") -> dict[str, Any]:
    """The verdict on a change of pass rate between two stages' counts on one split (trained or held-out). With
    both stages' per-task counts (``per_task_counts``) the verdict is the paired test over tasks (eval/stats.py:
    sign-flip permutation, interval by bootstrap over tasks), with Fisher's exact test on the pooled counts beside
    it; without them (hand-made numbers), Fisher's alone."""
    fisher = fisher_exact(after["resolved"], after["graded"], before["resolved"], before["graded"])
    unpaired = newcombe(after["resolved"], after["graded"], before["resolved"], before["graded"])
    delta = (after["pass_rate"] or 0.0) - (before["pass_rate"] or 0.0)
    out: dict[str, Any] = {"what": what, "split": split, "from": before["stage"], "to": after["stage"]}
    counts_b, counts_a = before.get("per_task_counts"), after.get("per_task_counts")
    if counts_b is not None and counts_a is not None:
        result = paired({t: (c[0], c[1]) for t, c in counts_b.items()}, {t: (c[0], c[1]) for t, c in counts_a.items()})
        p, test, interval = result.p_value, "paired", result.ci95
        out["paired"] = result.as_dict()
        shown = f"paired p = {p:.2g}, Fisher p = {fisher:.2g}"
    else:
        p, test, interval = fisher, "fisher", unpaired
        shown = f"p = {p:.2g}"
    verdict = ("improved" if delta > 0 else "worse") if p < ALPHA else "no significant change"
    return {
        **out,
        "delta": round(delta, 4),
        "ci95_delta": [round(x, 4) for x in interval],
        "test": test,
        "p_value": p,
        "fisher_p": fisher,
        "ci95_newcombe": [round(x, 4) for x in unpaired],
        "verdict": f"{verdict} ({shown})",
    }


# ---- numbers


def _graded(run_dir: Path, stage: str) -> dict[str, Any]:
    """Resolved / graded sessions of one run folder, overall and per task, with intervals."""
    rewards_df = read_rewards(run_dir)
    resolved, graded = int(rewards_df["resolved"].fill_null(False).sum()), rewards_df.height
    per_task = (
        rewards_df.group_by("task_id", maintain_order=True)
        .agg(graded=pl.len(), resolved=pl.col("resolved").fill_null(False).sum())
        .sort("task_id")
    )
    return {
        "stage": stage,
        "graded": graded,
        "resolved": resolved,
        "pass_rate": resolved / graded if graded else None,
        "ci95": [round(x, 4) for x in wilson(resolved, graded)],
        "per_task": {r["task_id"]: f"{r['resolved']} / {r['graded']}" for r in per_task.iter_rows(named=True)},
        "per_task_counts": {r["task_id"]: [r["resolved"], r["graded"]] for r in per_task.iter_rows(named=True)},
        "reward_reasons": dict(sorted(rewards_df["reason"].value_counts().iter_rows())),
    }


def _traces(run: Path, folder: str) -> dict[str, Any]:
    """What reconstruction made of one run folder's captured calls: traces, prompt lengths, tokens, chain breaks,
    calls dropped (a shipped harness's retries and error answers show here)."""
    path = run / folder / "trajectories.parquet"
    traj = schema.read(path)
    stats = file_stats(traj, Stats.from_dict(json.loads(stats_path(path).read_text())))
    captured = sum(1 for f in discover([run / "captures" / folder]) for line in f.read_bytes().split(b"\n") if line)
    prompts: list[int] = traj["prompt_ids"].list.len().to_list()
    return {
        "calls_captured": captured,
        "calls_in_traces": stats.merged_calls,
        "traces": stats.traces,
        "calls_per_trace_mean": round(stats.calls_per_trace, 3),
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else 0.0,
        "prompt_tokens_max": max(prompts, default=0),
        "tokens_trainable": stats.tokens_trainable,
        "tokens_masked": stats.tokens_masked,
        "chain_breaks": {cause: n for cause, n in stats.breaks.items() if n},
        "dropped_calls": stats.dropped,
    }


def stage_numbers(run: Path, stage: str) -> dict[str, Any]:
    """One stage: pass rate on the trained (or teacher) tasks and the held-out ones, sessions, and what
    reconstruction made of each split's captured calls."""
    sessions_df = read_sessions(run / stage)
    heldout = f"{stage}-heldout"
    measured = (run / heldout / "rewards.parquet").is_file()
    rebuilt = (run / heldout / "trajectories.parquet").is_file()
    return {
        **_graded(run / stage, stage),
        "heldout": {**_graded(run / heldout, stage), **(_traces(run, heldout) if rebuilt else {})}
        if measured
        else None,
        "sessions": sessions_df.height,
        "statuses": dict(sorted(sessions_df["status"].value_counts().iter_rows())),
        **_traces(run, stage),
    }


def metrics(run: Path, adapter: str) -> pl.DataFrame:
    """The metrics log of RUN/adapters/<adapter>/ (train/sft.py or train/grpo.py): one row per step; step 0
    describes the data."""
    path = run / "adapters" / adapter / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return pl.DataFrame(rows, infer_schema_length=None)


def train_numbers(run: Path, adapter: str) -> dict[str, Any]:
    """What one training phase did: its data, steps run, and the per-step metrics worth reading."""
    df = metrics(run, adapter)
    data = df.filter(pl.col("step") == 0).row(0, named=True)
    steps = df.filter(pl.col("step") > 0)
    out: dict[str, Any] = {"steps": steps.height, "sessions": data.get("data/sessions")}
    if "data/groups" in data:  # GRPO
        groups = int(data["data/groups"])
        out |= {"groups": groups, "groups_with_signal": round(groups * (1 - data["reward/zero_std_frac"]))}
    drawn = run / f"{adapter}-sampling.json"  # dynamic sampling (eval/loop/sampling.py, the config's groups)
    if drawn.is_file():
        out["sampling"] = json.loads(drawn.read_text())
    keys = ("step", *CHARTED, "loss/nll")
    out["per_step"] = steps.select([c for c in keys if c in steps.columns]).to_dicts()
    return out


def compared(order: list[str]) -> list[tuple[str, str, str]]:
    """The stages each test compares, (before, after, what), in the order the report lists them: SFT's gain, GRPO's
    own and the whole loop's, then each round against the stage it started from, the SFT stage and the base model."""
    grpo = [n for n in order if n.startswith("grpo")]
    pairs = [("base", "sft", "SFT's gain: after SFT against the base model")] if "sft" in order else []
    if grpo:
        pairs += [
            ("sft", grpo[-1], "GRPO's own gain: last round against the SFT stage"),
            ("base", grpo[-1], "the whole loop: last round against the base model"),
        ]
    for before, after in itertools.pairwise(order):
        if not after.startswith("grpo"):
            continue
        starts = ((before, f"the {before} stage it started from"), ("sft", "the SFT stage"), ("base", "the base model"))
        for start, what in starts:
            if start in order and start != after and not any(p[:2] == (start, after) for p in pairs):
                pairs.append((start, after, f"round {after[4:]}: against {what}"))
    return [p for p in pairs if p[0] in order]


def summary(run: Path) -> dict[str, Any]:
    """Every number of summary.json, from the run's files."""
    names = stages_of(run)
    stages = {name: stage_numbers(run, name) for name in names}
    measured = [stages[n] for n in names if n != "teacher"]
    grpo = [n for n in names if n.startswith("grpo")]
    pairs = compared([n for n in names if n != "teacher"])
    tests = [compare(stages[a], stages[b], what) for a, b, what in pairs]
    tests += [
        compare(stages[a]["heldout"], stages[b]["heldout"], what, "held-out")
        for a, b, what in pairs
        if stages[a]["heldout"] and stages[b]["heldout"]
    ]
    adapters = [a for a in ("sft", *grpo) if (run / "adapters" / a / "metrics.jsonl").is_file()]
    return {
        "run": str(run),
        "stages": stages,
        "order": [m["stage"] for m in measured],
        "tests": tests,
        "train": {a: train_numbers(run, a) for a in adapters},
    }


def _rate(numbers: dict[str, Any] | None) -> str:
    if not numbers:
        return "-"
    rate, (lo, hi) = numbers["pass_rate"], numbers["ci95"]
    return f"{numbers['resolved']}/{numbers['graded']}" + ("" if rate is None else f" {rate:.0%} [{lo:.0%}, {hi:.0%}]")


def _delta(test: dict[str, Any]) -> str:
    lo, hi = test.get("ci95_delta", (None, None))
    interval = "" if lo is None else f" [{lo:+.0%}, {hi:+.0%}]"
    pairs = (
        f", {test['paired']['tasks']} tasks paired ({test['paired']['differing']} differ)" if "paired" in test else ""
    )
    return f"{test['from']} -> {test['to']}: {test['delta']:+.0%}{interval}{pairs}, {test['verdict']}"


def runtime_sentence(runtime: dict[str, Any]) -> str:
    """Where the run's sessions ran (summary.json's ``runtime``, eval/loop/run.py ``Chosen``)."""
    if runtime["sandboxed"]:
        return f"Sessions ran sandboxed (--runtime {runtime['name']}, graded in fresh containers): {runtime['why']}."
    return f"Sessions ran UNSANDBOXED on this machine (--runtime {runtime['name']}): {runtime['why']}."


def note(numbers: dict[str, Any]) -> str:
    """The honest reading of a run, in a few sentences: each stage's share reported apart, each split apart."""
    stages = numbers["stages"]
    tests = {t["from"] + ">" + t["to"]: t for t in numbers["tests"] if t.get("split", "trained") == "trained"}
    heldout_tests = [t for t in numbers["tests"] if t.get("split") == "held-out"]
    order = numbers["order"]
    parts = [runtime_sentence(numbers["runtime"])] if numbers.get("runtime") else []
    parts.append("Pass@1 on the trained tasks: " + ", ".join(f"{s} {_rate(stages[s])}" for s in order) + ".")
    grpo = [s for s in order if s.startswith("grpo")]
    if "base>sft" in tests:
        parts.append(f"SFT on the teacher sessions: {tests['base>sft']['verdict']}.")
    if grpo:
        t = tests[f"sft>{grpo[-1]}"]
        parts.append(
            f"GRPO's own gain ({len(grpo)} round(s), {t['from']} -> {t['to']}, {t['delta']:+.0%}): {t['verdict']}."
        )
        for adapter, tr in numbers["train"].items():
            if "sampling" in tr:
                parts.append(f"Dynamic sampling for {adapter}: {sampling_sentence(tr['sampling'])}.")
        no_signal = [a for a, tr in numbers["train"].items() if a.startswith("grpo") and tr["steps"] == 0]
        if no_signal:
            parts.append(f"{', '.join(no_signal)}: no group had reward variance, so that round trained nothing.")
    heldout = [s for s in order if stages[s].get("heldout")]
    if heldout:
        parts.append(
            "Held-out tasks (never trained on), as they came out: "
            + ", ".join(f"{s} {_rate(stages[s]['heldout'])}" for s in heldout)
            + "."
        )
    for t in heldout_tests:
        parts.append(f"On held-out tasks, {t['what'].split(':')[0]} ({_delta(t)}).")
    timed_out = {s: stages[s].get("statuses", {}).get("timeout", 0) for s in order}
    if any(timed_out.values()):
        parts.append(
            "Sessions killed at the session timeout, counted as failures: "
            + ", ".join(f"{s} {n}" for s, n in timed_out.items() if n)
            + ". Those rates measure the machine's load as much as the model: rerun on a quieter machine or with a"
            " longer --session-timeout."
        )
    return " ".join(parts)


def summary_rows(numbers: dict[str, Any]) -> list[list[str]]:
    """Rows of the summary table: what, then one cell per stage (teacher first when present)."""
    stages = numbers["stages"]
    names = [n for n in ("teacher", *numbers["order"]) if n in stages]

    def row(what: str, cell: Any) -> list[str]:
        return [what, *(cell(stages[n]) for n in names)]

    rows = [
        ["", *names],
        row("trained tasks: resolved / graded, 95 % CI", _rate),
        row("held-out tasks: resolved / graded, 95 % CI", lambda s: _rate(s["heldout"])),
        row("per task", lambda s: ", ".join(f"{t.split('__')[-1]} {v}" for t, v in s["per_task"].items())),
        row("session statuses", lambda s: ", ".join(f"{k} {v}" for k, v in s["statuses"].items())),
        row("model calls captured / in traces", lambda s: f"{s['calls_captured']} / {s['calls_in_traces']}"),
        row("traces, calls per trace", lambda s: f"{s['traces']}, {s['calls_per_trace_mean']:.2f}"),
        row("response tokens trained / masked", lambda s: f"{s['tokens_trainable']:,} / {s['tokens_masked']:,}"),
        row("prompt tokens per trace, mean / max", _prompts),
        row("chain breaks", lambda s: _breaks(s)),
        row("held-out: calls captured / in traces", lambda s: _calls(s["heldout"])),
        row("held-out: prompt tokens per trace, mean / max", lambda s: _prompts(s["heldout"])),
        row("held-out: chain breaks", lambda s: _breaks(s["heldout"])),
    ]
    return rows


def _calls(numbers: dict[str, Any] | None) -> str:
    return f"{numbers['calls_captured']} / {numbers['calls_in_traces']}" if numbers and "traces" in numbers else "-"


def _prompts(numbers: dict[str, Any] | None) -> str:
    if not numbers or "prompt_tokens_mean" not in numbers:
        return "-"
    return f"{numbers['prompt_tokens_mean']:,.0f} / {numbers['prompt_tokens_max']:,}"


def _breaks(numbers: dict[str, Any] | None) -> str:
    if not numbers or "chain_breaks" not in numbers:
        return "-"
    return ", ".join(f"{c} {k}" for c, k in numbers["chain_breaks"].items()) or "none"


def verdict_rows(numbers: dict[str, Any]) -> list[list[str]]:
    """(what, result) rows: each test between stages, then what each training phase did."""
    rows = [[f"{t.get('split', 'trained')} tasks: {t['what']}", _delta(t)] for t in numbers["tests"]]
    for adapter, tr in numbers["train"].items():
        last = tr["per_step"][-1] if tr["per_step"] else {}
        if "groups" in tr:  # GRPO: its loss is 0 at a run's first step by construction (ratios 1, advantages sum 0)
            result = f", {tr['groups_with_signal']} of {tr['groups']} groups with a signal" + (
                f", reward {last['reward/mean']:.2f}, grad norm {last['optim/grad_norm']:.3g}" if last else ""
            )
        else:
            result = f", last loss {last['loss/nll']:.4f}" if last else ""
        rows.append([f"train {adapter}", f"{tr['steps']} step(s){result}"])
        if "sampling" in tr:
            rows.append([f"dynamic sampling for {adapter}", sampling_sentence(tr["sampling"])])
    return rows


def sampling_sentence(record: dict[str, Any]) -> str:
    """A round's dynamic sampling (RUN/grpo<k>-sampling.json) in words."""
    rate = record["pool_pass_rate"]
    return (
        f"{record['informative']} informative groups in {record['draws']} tasks drawn ({record['sessions']} "
        f"sessions, {len(record['batches'])} batch(es), at most {record['max_draws']} of a pool of {record['pool']}), "
        f"pool pass rate {'-' if rate is None else f'{rate:.0%}'}; trained on {len(record['kept'])} of "
        f"{record['groups_asked']} groups asked" + ("" if record["reached"] else " (the draw limit came first)")
    )


# ---- tables for the notebooks


def sessions(run: Path, stage: str) -> pl.DataFrame:
    """One row per session of a stage: task, sample, status, reward and what reconstruction made of it."""
    traces = (
        schema.read(trajectories_path(run, stage), columns=["session_id", "n_calls", "loss_mask"])
        .group_by("session_id")
        .agg(traces=pl.len(), calls=pl.col("n_calls").sum(), trainable=pl.col("loss_mask").list.sum().sum())
    )
    rewards_df = read_rewards(run / stage).select("session_id", "reward", "reason")
    return (
        read_sessions(run / stage)
        .select("session_id", "task_id", "sample_id", "harness", "status", "duration_s")
        .join(rewards_df, on="session_id", how="left", maintain_order="left")
        .join(traces, on="session_id", how="left", maintain_order="left")
        .with_columns(pl.lit(stage).alias("stage"))
    )


def rewards(run: Path) -> pl.DataFrame:
    """Resolved count and mean reward by stage and task, trained and held-out."""
    frames = []
    for stage in stages_of(run):
        trained = "teacher" if stage == "teacher" else "trained"
        for folder, split in ((stage, trained), (f"{stage}-heldout", "held-out")):
            if (run / folder / "rewards.parquet").is_file():
                frames.append(
                    read_rewards(run / folder).with_columns(pl.lit(stage).alias("stage"), pl.lit(split).alias("split"))
                )
    return (
        pl.concat(frames)
        .group_by("stage", "split", "task_id", maintain_order=True)
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
    """Pass@1 per stage with its 95 % interval: trained tasks (blue) and held-out ones (orange)."""
    order, stages = numbers["order"], numbers["stages"]
    w, h, left, top, bottom = 120 * max(len(order), 1) + 160, 300, 48, 40, 40
    plot_h = h - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        (
            f'<text x="{left}" y="20" font-size="14">pass@1 (the mean reward: 1 resolved, 0 not) '
            "per stage, 95 % interval</text>"
        ),
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + plot_h * (1 - tick)
        parts.append(f'<line x1="{left}" x2="{w - 160}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{tick:.2f}</text>')
    for split, color, dx in (("trained", "#4e79a7", -12), ("heldout", "#f28e2b", 12)):
        points = []
        for i, stage in enumerate(order):
            n = stages[stage] if split == "trained" else stages[stage].get("heldout")
            if not n or n["pass_rate"] is None:
                continue
            x = left + 60 + 120 * i + dx
            y, (lo, hi) = top + plot_h * (1 - n["pass_rate"]), n["ci95"]
            points.append(f"{x:.1f},{y:.1f}")
            y_hi, y_lo = top + plot_h * (1 - hi), top + plot_h * (1 - lo)
            parts.append(f'<line x1="{x}" x2="{x}" y1="{y_hi:.1f}" y2="{y_lo:.1f}" stroke="{color}" stroke-width="2"/>')
            parts.append(
                f'<circle cx="{x}" cy="{y:.1f}" r="4" fill="{color}"><title>{escape(stage)} {split}: '
                f"{n['resolved']}/{n['graded']} [{lo:.2f}, {hi:.2f}]</title></circle>"
            )
        if len(points) > 1:
            parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" stroke-dasharray="3,3"/>')
    for i, stage in enumerate(order):
        x = left + 60 + 120 * i
        parts.append(f'<text x="{x}" y="{h - bottom + 18}" text-anchor="middle">{escape(stage)}</text>')
    for j, (label, color) in enumerate((("trained tasks", "#4e79a7"), ("held-out tasks", "#f28e2b"))):
        parts.append(f'<rect x="{w - 150}" y="{top + 16 * j}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{w - 135}" y="{top + 16 * j + 9}">{label}</text>')
    return "\n".join([*parts, "</svg>"]) + "\n"


def metrics_svg(per_step: list[dict[str, Any]]) -> str:
    """One small line chart per training metric, x = optimizer step."""
    panels: list[str] = []
    w, h, pad = 240, 140, 30
    for key in (*CHARTED, "loss/nll"):
        points = [(r["step"], r[key]) for r in per_step if r.get(key) is not None]
        if not points:
            continue
        lo, hi = min(v for _, v in points), max(v for _, v in points)
        span, steps = (hi - lo) or 1.0, max(s for s, _ in points)
        xy = [
            (pad + (w - 2 * pad) * (s - 1) / max(steps - 1, 1), h - pad - (h - 2 * pad) * (v - lo) / span)
            for s, v in points
        ]
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
    """report.html: the note, the summary table, the pass-rate chart, training metrics, and every phase's command."""
    head, *body = summary_rows(numbers)
    table = (
        "<tr>"
        + "".join(f"<th>{escape(c)}</th>" for c in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in body)
    )
    verdicts = "".join(f"<tr><td>{escape(a)}</td><td>{escape(b)}</td></tr>" for a, b in verdict_rows(numbers))
    training = "".join(
        f"<h3>{escape(a)}</h3>"
        + (
            metrics_svg(tr["per_step"])
            if tr["per_step"]
            else "<p>No optimizer step ran (no group had reward variance).</p>"
        )
        for a, tr in numbers["train"].items()
    )
    rerun = "".join(
        f"<li>{escape(p['phase'])} ({p['seconds']:.0f} s)<pre>{escape(chr(10).join(p['commands']))}</pre></li>"
        for p in numbers.get("phases", [])
        if p["commands"]
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>polar-rl demo {escape(Path(numbers["run"]).name)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:24px auto}}td,th{{padding:2px 10px;text-align:left}}
tr:nth-child(even){{background:#f4f4f4}}pre{{background:#f4f4f4;padding:6px;white-space:pre-wrap}}</style></head>
<body><h1>polar-rl demo: {escape(numbers["run"])}</h1>
<p>{escape(note(numbers))}</p>
<h2>Pass rate per stage</h2>{pass_rate_svg(numbers)}
<table>{table}</table>
<h2>Tests and training</h2><table>{verdicts}</table>
<h2>Training metrics</h2>{training}
<h2>Rerun a phase</h2><ol>{rerun}</ol>
</body></html>
"""


# ---- summary.json and report.html


def write_summary(run: Path, record: dict[str, Any]) -> dict[str, Any]:
    """summary.json and report.html of ``run``: ``record`` (phases with commands and seconds, config, model) plus
    every number recounted from the files, and the note. Returns what summary.json holds."""
    numbers = summary(run)
    full = {**record, **numbers, "throughput": throughput(numbers, record.get("phases", ()))}
    full["note"] = note(full)
    (run / "summary.json").write_text(json.dumps(full, indent=1) + "\n")
    (run / "report.html").write_text(report_html(full))
    return full


def throughput(numbers: dict[str, Any], phases: Any) -> dict[str, dict[str, float]]:
    """Per stage: sessions an hour and sampled tokens a second over the stage's wall time (its phase record, named
    after its folder: rollouts of both splits, grading, reconstruction)."""
    seconds = {p["phase"]: p["seconds"] for p in phases}
    out = {}
    for name, stage in numbers["stages"].items():
        if seconds.get(name):
            heldout = stage["heldout"] or {}
            sessions = stage["sessions"] + heldout.get("graded", 0)
            tokens = stage["tokens_trainable"] + heldout.get("tokens_trainable", 0)
            out[name] = {
                "seconds": seconds[name],
                "sessions_per_hour": round(sessions * 3600 / seconds[name], 1),
                "served_tokens_per_s": round(tokens / seconds[name], 1),
            }
    return out


def write_scalars(run: Path, numbers: dict[str, Any]) -> Path:
    """TensorBoard scalars of the stages so far (step = the stage's place in the run: base 0, sft 1, grpo<k> ...):
    pass rates per split, sessions an hour, served tokens/s, chain breaks, and each training phase's last step.
    Rewritten whole each time (a new RUN/tensorboard/ swapped in): they are recounted from the run's files."""
    from torch.utils.tensorboard import SummaryWriter

    target = run / "tensorboard"
    fresh = run / ".tensorboard.partial"
    shutil.rmtree(fresh, ignore_errors=True)
    with contextlib.closing(SummaryWriter(str(fresh))) as writer:
        for step, name in enumerate(numbers["order"]):
            stage = numbers["stages"][name]
            scalars = {
                "pass_rate/trained": stage["pass_rate"],
                "pass_rate/heldout": (stage["heldout"] or {}).get("pass_rate"),
                "sessions/per_hour": numbers["throughput"].get(name, {}).get("sessions_per_hour"),
                "serving/tokens_per_s": numbers["throughput"].get(name, {}).get("served_tokens_per_s"),
                "traces/chain_breaks": sum(stage["chain_breaks"].values()),
                "traces/dropped_calls": sum(stage["dropped_calls"].values()),
            }
            last = (numbers["train"].get(name, {}).get("per_step") or [{}])[-1]
            scalars |= {f"train/{k}": v for k, v in last.items() if k != "step"}
            for key, value in scalars.items():
                if isinstance(value, int | float):
                    writer.add_scalar(key, value, step)
    shutil.rmtree(target, ignore_errors=True)
    fresh.rename(target)
    return target


def summary_table(numbers: dict[str, Any]) -> Table:
    head, *body = summary_rows(numbers)
    runtime = numbers.get("runtime")
    where = f" (--runtime {runtime['name']})" if runtime else ""
    table = Table(title=f"demo summary: {numbers['run']}{where}")
    for column in head:
        table.add_column(column)
    for row in body:
        table.add_row(*row)
    return table


def verdict_table(numbers: dict[str, Any]) -> Table:
    table = Table(show_header=False)
    for row in verdict_rows(numbers):
        table.add_row(*row)
    return table


@dataclasses.dataclass
class Args:
    """Recount RUN's numbers (the newest demo run by default), rewrite summary.json, report.html and the TensorBoard
    scalars, print the table."""

    run: tyro.conf.Positional[Path | None] = None
    """A loop run folder (RUN, the config's out); default: the newest demo run, runs/demo/<time>/."""


def main(args: Args) -> None:
    run = find_run(args.run)
    record = json.loads((run / "summary.json").read_text())
    full = write_summary(
        run, {k: record[k] for k in ("model", "config", "runtime", "phases", "seconds") if k in record}
    )
    write_scalars(run, full)
    console = Console()
    console.print(summary_table(full))
    console.print(verdict_table(full))
    console.print(full["note"], highlight=False)
    print(f"wrote {run / 'summary.json'}, {run / 'report.html'} and {run / 'tensorboard'}")
