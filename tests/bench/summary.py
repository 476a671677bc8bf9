"""Every benchmark's targets in one table: the last step of ``make bench``.

Run:  .venv/bin/python -m tests.bench.summary

Reads the ``targets`` list of each ``tests/bench/results/<name>.json`` (written by the benchmarks of ``make bench``;
a missing file is named, not skipped silently), prints one table, and writes ``tests/bench/results/summary.md``,
which the README's benchmark section shows. A target row is ``{name, value, unit, limit, result}`` with result
PASS, MISS or info; a MISS may carry ``close``, what would close it. Exit status 0 whatever the results: a MISS is
a finding, not a failure.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
# In the order make bench runs them; each one's JSON has a "targets" list.
BENCHES = ["proxy", "litellm", "reconstruct", "server", "train", "prefix", "dtype", "suite"]
_COLOUR = {"PASS": "green", "MISS": "red", "info": "dim", "n/a": "yellow"}


def _value(row: dict) -> str:
    if isinstance(row.get("measured"), str):  # the bench's own rendering
        return str(row["measured"])
    v, unit = row.get("value"), row.get("unit", "")
    if not isinstance(v, int | float):
        return "-"
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "ms":
        return f"{v:+.2f} ms"
    return f"{v:,.3g} {unit}".strip()


def collect(results: Path = RESULTS) -> tuple[list[list[str]], list[str]]:
    """The rows ``[bench, target, measured, limit, result, close]`` and the benches with no results file."""
    rows, missing = [], []
    for bench in BENCHES:
        path = results / f"{bench}.json"
        if not path.exists():
            missing.append(bench)
            continue
        data = json.loads(path.read_text())
        for t in data.get("targets", []):
            # Older result files call the limit "target".
            limit = str(t.get("limit", t.get("target", "-")))
            rows.append([bench, str(t["name"]), _value(t), limit, str(t["result"]), str(t.get("close", ""))])
    return rows, missing


def markdown(rows: list[list[str]], missing: list[str]) -> str:
    head = ["bench", "target", "measured", "limit", "result", "what would close a miss"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | ---: | ---: | --- | --- |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        "",
        f"- Collected {when} from tests/bench/results/<bench>.json; each bench's .md has its method and notes.",
    ]
    if missing:
        lines.append(f"- No results file for: {', '.join(missing)}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    rows, missing = collect()
    table = Table(title="make bench: targets")
    for i, h in enumerate(["bench", "target", "measured", "limit", "result"]):
        table.add_column(h, justify="right" if i in (2, 3) else "left")
    for bench, name, value, limit, result, close in rows:
        table.add_row(
            bench,
            name + (f"\n[dim]{close}[/]" if close else ""),
            value,
            limit,
            f"[{_COLOUR.get(result, 'white')}]{result}[/]",
        )
    console = Console()
    console.print(table)
    for bench in missing:
        console.print(f"[yellow]no results file: tests/bench/results/{bench}.json[/]")
    (RESULTS / "summary.md").write_text(markdown(rows, missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
