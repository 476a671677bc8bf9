"""Captured model calls → token-faithful trajectories in Parquet (format: reconstruct/schema.py).

    python -m reconstruct CAPTURES... -o trajectories.parquet [--tokenizer DIR_OR_NAME] [--sessions sessions.parquet]
        [--mode prefix|per-request] [--eot-token TOKEN] [--on-drift split|keep] [--shard I/N] [--jobs N]
        [--skip-sessions lost.parquet]
    python -m reconstruct stats trajectories.parquet
    python -m reconstruct audit trajectories.parquet --model DIR [--threshold 0.01]
    python -m reconstruct expand CAPTURES... -o FOLDER    # v2 records written back as the v1 records they stand for

The first form writes the table and ``trajectories.stats.json`` next to it, and prints the stats (sessions,
calls, traces, tokens, chain breaks by cause). Exit status 0 on success, 2 on bad options or unreadable input, and
2 without writing anything when the captures hold no usable model call (a folder of garbage is not an empty run;
``--allow-empty`` lets captures with no line at all write an empty table).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
from rich.console import Console

from reconstruct._errors import ReconstructError
from reconstruct.schema import SchemaError

console = Console(stderr=True)


@dataclasses.dataclass
class Build:
    """Rebuild trajectories from capture files."""

    captures: tyro.conf.Positional[tuple[Path, ...]]
    """Capture files, or folders whose *.jsonl files (current and rotated) are all read."""
    output: Annotated[Path, tyro.conf.arg(aliases=("-o",))] = Path("trajectories.parquet")
    """Trajectory Parquet to write (atomically); its stats go next to it as <stem>.stats.json."""
    # ---- tokens
    tokenizer: str | None = None
    """Tokenizer (local dir or cached hub name) to rebuild ids of calls recorded without them, and to find the
    end-of-turn token. Without it such calls are counted as dropped."""
    eot_token: str | None = None
    """End-of-turn token (text or id) that cuts drifted turns under --on-drift keep; default: from the chat
    template, else voted from the calls that stopped naturally."""
    # ---- merging
    mode: Literal["prefix", "per-request"] = "prefix"
    """prefix: merge calls that extend each other's prompts into long traces; per-request: one trace per call."""
    on_drift: Literal["split", "keep"] = "split"
    """When a prompt re-renders the previous sampled turn differently: split starts a new trace (training context =
    rollout context); keep merges it and lists the turn in drift_turns."""
    # ---- scope
    sessions: Path | None = None
    """Sessions table (session_id, task_id[, sample_id]) to fill task_id and sample_id."""
    shard: str | None = None
    """I/N: only the sessions whose stable hash is I modulo N (run N processes, one per shard)."""
    skip_sessions: Path | None = None
    """Parquet table whose session_id column lists sessions to leave out: a Ray round's lost.parquet, the attempts
    that lost their worker and were run again (their partial records must not be trained on)."""
    jobs: int | None = None
    """Worker processes that build sessions in parallel (the output is the same for any number); default: one
    per CPU, up to 8, once the captures pass 256 MB of v1 records or 32 MB of v2 ones, else 1 (starting a worker
    costs about half a second)."""
    progress: bool = True
    """Show a progress bar over sessions (on a terminal)."""
    allow_empty: bool = False
    """Write an empty table (exit 0) when the captures hold no line at all: sessions that never called the model
    (a harness that crashed first) are an empty run. Lines that hold no usable model call still exit 2."""

    def __post_init__(self) -> None:
        if not self.captures:
            raise ReconstructError("give at least one capture file or folder")
        if self.jobs is not None and self.jobs < 1:
            raise ReconstructError(f"--jobs must be >= 1, not {self.jobs}")


@dataclasses.dataclass
class StatsCommand:
    """Print the stats of a trajectory file."""

    file: tyro.conf.Positional[Path]
    """Trajectory Parquet written by python -m reconstruct."""


@dataclasses.dataclass
class Audit:
    """Re-score trainable tokens with a model; compare with the captured log-probs."""

    file: tyro.conf.Positional[Path]
    """Trajectory Parquet written by python -m reconstruct."""
    model: str
    """Model (local dir or cached hub name) that served the captured calls."""
    threshold: float = 1e-2
    """Report the share of trainable tokens whose |model - captured| log-prob exceeds this."""
    chunk: int = 1024
    """Positions per output-head chunk: bounds the logits held at once to chunk x vocabulary."""
    max_traces: int | None = None
    """Audit only the first N traces."""
    device: str = "auto"
    """cpu, cuda, cuda:1, ...; auto: cuda when available."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for scoring (the log-softmax is always float32)."""

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.threshold < 0:
            raise ReconstructError("--chunk must be >= 1 and --threshold >= 0")


@dataclasses.dataclass
class Expand:
    """Write capture files back with every v2 record as the v1 record it stands for (addon/record_v2.py)."""

    captures: tyro.conf.Positional[tuple[Path, ...]]
    """Capture files, or folders whose *.jsonl files are all read."""
    output: Annotated[Path, tyro.conf.arg(aliases=("-o",))]
    """Folder to write the files into, each under its own name (not a folder the captures are in). A file already
    there is never replaced: the run is refused before it writes anything."""


def build(config: Build) -> None:
    from tqdm import tqdm

    from reconstruct._build import parse_shard, reconstruct, stats_path, write_trajectories
    from reconstruct._io import read_session_ids, read_session_tasks
    from reconstruct._retokenize import parse_eot

    tokenizer = _tokenizer(config.tokenizer) if config.tokenizer else None
    eot = parse_eot(config.eot_token, tokenizer) if config.eot_token else None
    sessions = read_session_tasks(config.sessions) if config.sessions else None
    skip = read_session_ids(config.skip_sessions) if config.skip_sessions else frozenset()
    started = time.perf_counter()
    df, stats = reconstruct(
        list(config.captures),
        tokenizer=tokenizer,
        sessions=sessions,
        mode=config.mode,
        on_drift=config.on_drift,
        eot_id=eot,
        shard=parse_shard(config.shard) if config.shard else None,
        skip=skip,
        jobs=config.jobs if config.jobs is not None else _auto_jobs(config.captures),
        progress=(lambda names: tqdm(names, unit="session", disable=None)) if config.progress else None,
    )
    if df.height == 0 and not (config.allow_empty and stats.lines == 0):
        raise ReconstructError(_nothing_usable(config.captures, stats))
    write_trajectories(df, stats, config.output)
    if skip:
        console.print(f"left out the sessions listed in {config.skip_sessions} ({len(skip):,})", markup=False)
    console.print(stats.table(f"{config.output} ({time.perf_counter() - started:.1f} s)"))
    console.print(f"wrote {config.output} and {stats_path(config.output)}", markup=False, soft_wrap=True)


def _nothing_usable(captures: tuple[Path, ...], stats: Any) -> str:
    where = ", ".join(map(str, captures)) + (f" (shard {stats.shard})" if stats.shard else "")
    found = (
        f"{stats.lines:,} lines: {stats.corrupt_lines:,} corrupt, {stats.torn_lines:,} torn, "
        f"{stats.unsupported_records:,} of another format version, {stats.duplicate_records:,} duplicates, "
        f"{stats.other_records:,} not model calls; {stats.calls:,} model calls"
    )
    dropped = ", ".join(f"{n:,} {why.replace('_', ' ')}" for why, n in sorted(stats.dropped.items()))
    hint = " (calls recorded without token ids need --tokenizer)" if "missing_ids" in stats.dropped else ""
    return (
        f"no usable model call in {where}: {found}"
        + (f", dropped: {dropped}{hint}" if dropped else "")
        + "; nothing written"
    )


# Capture bytes past which worker processes pay for their start. A v2 byte carries about 8 times a v1 byte's work
# (measured, tests/bench/reconstruct.py, quiet 2-core box: 15 MB of v2 took 0.50 s in one process and 0.73 s with
# --jobs 2; 46 MB 1.64 s and 1.32 s; 153 MB 4.86 s and 3.20 s), so a v2 file counts 8 times its size.
PARALLEL_BYTES = 256 << 20
V2_WEIGHT = 8


def _auto_jobs(captures: tuple[Path, ...]) -> int:
    from addon.record_v2 import V2_START
    from reconstruct._io import discover

    work = 0
    for path in discover(list(captures)):
        with open(path, "rb") as f:
            v2 = f.read(len(V2_START)) == V2_START  # a file counts in its first record's format
        work += path.stat().st_size * (V2_WEIGHT if v2 else 1)
    return min(8, os.cpu_count() or 1) if work > PARALLEL_BYTES else 1


def stats(config: StatsCommand) -> None:
    from reconstruct import schema
    from reconstruct._build import stats_path
    from reconstruct._json import loads
    from reconstruct._stats import Stats, file_stats

    df = schema.read(config.file)
    sidecar = stats_path(config.file)
    saved = Stats.from_dict(loads(sidecar.read_bytes())) if sidecar.is_file() else None
    if saved is None:
        note = f"{sidecar} is missing: chain breaks and dropped calls are unknown"
        console.print(note, style="yellow", markup=False, soft_wrap=True)
    console.print(file_stats(df, saved).table(str(config.file)))


def audit(config: Audit) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from reconstruct import schema
    from reconstruct._audit import audit as run_audit

    device = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    df = schema.read(config.file, columns=["prompt_ids", "response_ids", "loss_mask", "logprobs"])
    if config.max_traces is not None:
        df = df.head(config.max_traces)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=getattr(torch, config.dtype))
    # transformers types .to() through a decorator that drops the bound self: any argument is "not a model".
    model = model.to(device).eval()  # type: ignore[arg-type]
    bar = lambda rows: tqdm(rows, total=df.height, disable=None)  # noqa: E731
    report = run_audit(df, model, threshold=config.threshold, chunk=config.chunk, progress=bar)
    console.print(report.table())


# Model types whose folders naming the generic tokenizer class (tokenizer_config.json) AutoTokenizer loads as that
# class, with no quirk of its own: the tiny model (qwen3) and SmolLM2 (llama) as eval/upstream/models.py builds them.
GENERIC_TOKENIZER_TYPES = frozenset({"qwen3", "llama"})


def _tokenizer(name: str) -> Any:
    """``AutoTokenizer.from_pretrained(name)``. A local folder whose tokenizer is the generic class for a model type
    of GENERIC_TOKENIZER_TYPES is loaded as that class directly: the same tokenizer, without the ~1.7 CPU-s of
    torch that importing AutoTokenizer costs (its config classes import it); the demo starts one per split."""
    folder = Path(name)
    if folder.is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local dir needs no hub; never wait on a network
        if _generic_tokenizer(folder):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _generic_tokenizer(folder: Path) -> bool:
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    generic = settings.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    return generic and "auto_map" not in settings and model_type in GENERIC_TOKENIZER_TYPES


def expand(config: Expand) -> None:
    from reconstruct._expand import expand_captures

    counts = expand_captures(list(config.captures), config.output)
    console.print(
        f"wrote {counts.files} files to {config.output}: {counts.lines:,} lines, {counts.expanded:,} v2 records "
        f"expanded; left out: {counts.corrupt:,} corrupt, {counts.unresolved:,} whose base record was lost, "
        f"{counts.torn:,} torn",
        markup=False,
        soft_wrap=True,
    )


COMMANDS = {"stats": (StatsCommand, stats), "audit": (Audit, audit), "expand": (Expand, expand)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_type, run = COMMANDS.get(argv[0], (Build, build)) if argv else (Build, build)
    args = argv[1:] if argv and argv[0] in COMMANDS else argv
    prog = "python -m reconstruct" + (f" {argv[0]}" if argv and argv[0] in COMMANDS else "")
    try:
        run(tyro.cli(config_type, args=args, prog=prog))  # type: ignore[operator]
    except (ReconstructError, SchemaError, OSError) as e:
        console.print(f"error: {e}", style="red", markup=False, highlight=False, soft_wrap=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
