"""Capture files with every v2 record written back as the v1 record it stands for (addon/record_v2.py).

    python -m reconstruct expand CAPTURES... -o FOLDER

A person or a tool that reads the wire as it was reads the output: each input file becomes one file of the same name
in FOLDER, its v1 records copied as they are and its v2 records expanded, byte for byte the v1 line the writer would
have written for that call. A file already in FOLDER is never replaced: the run is refused before it writes anything.
What cannot be expanded is left out and counted: a torn last line, a v2 line that does
not parse or fails its checksum (corrupt), and a v2 record whose base record was torn or lost (unresolved).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from addon import record_v2
from reconstruct._errors import ConfigError
from reconstruct._io import discover, parse_v2
from reconstruct.files import write_atomic

__all__ = ["ExpandCounts", "expand_captures"]


@dataclasses.dataclass
class ExpandCounts:
    files: int = 0
    lines: int = 0  # whole lines read
    expanded: int = 0  # v2 records written back as v1
    corrupt: int = 0  # v2 lines that do not parse or fail their checksum: left out
    unresolved: int = 0  # v2 records whose base record was torn or lost: left out
    torn: int = 0  # unterminated last lines: left out


def expand_captures(captures: list[Path], output: Path) -> ExpandCounts:
    """Write each capture file under ``captures`` to ``output`` with its v2 records expanded; what was done."""
    files = discover(captures)
    output = output.resolve()
    if any(path.resolve().parent == output for path in files):
        raise ConfigError(f"{output}: the output folder holds capture files it would overwrite; give another")
    counts = ExpandCounts(files=len(files))
    names: set[str] = set()
    for path in files:  # every refusal comes before the first write: a refused run writes nothing
        if path.name in names:
            raise ConfigError(
                f"{path}: two capture files named {path.name}; expand each of their folders into its own -o folder"
            )
        names.add(path.name)
        if (output / path.name).exists():
            raise ConfigError(
                f"{output / path.name} exists, not written by this run: expand into a new -o folder (nothing "
                "is replaced)"
            )
    for path in files:
        lines = _expanded(path, counts)
        try:
            write_atomic(output / path.name, b"".join(line + b"\n" for line in lines), replace=False)
        except FileExistsError as e:  # made by someone else since the check above
            raise ConfigError(f"{output / path.name} appeared while expanding; it was left as it is") from e
    return counts


def _expanded(path: Path, counts: ExpandCounts) -> list[bytes]:
    expander = record_v2.Expander()
    out: list[bytes] = []
    with path.open("rb") as f:
        for raw in f:  # binary iteration splits on b"\n" only
            if not raw.endswith(b"\n"):
                counts.torn += 1
                continue
            counts.lines += 1
            line = raw[:-1]
            if not line.startswith(record_v2.V2_START):
                out.append(line)
                continue
            record = parse_v2(bytearray(line))
            try:
                if record is None:
                    raise ValueError("corrupt")
                out.append(expander.expand(record))
                counts.expanded += 1
            except record_v2.Unresolved:
                counts.unresolved += 1
            except ValueError:
                counts.corrupt += 1
    return out
