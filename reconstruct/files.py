"""Files that readers never see half-written, and the versioned Parquet tables built on them.

    write_atomic(path, b"...")                            # or a writer: write_atomic(path, lambda tmp: ...)
    write_new({folder / "report.json": b"...", ...})      # replaces nothing: a taken name gets a number
    write_versioned_parquet(df, path, "polar.x.version", 1)
    df = read_versioned_parquet(path, "polar.x.version", 1, kind="x table", error=XError)

A write goes to a temporary file beside ``path`` and is renamed over it, so a reader (or a rerun after a crash)
finds the old file or the new one, never a torn one. :func:`write_new` writes a set of files into a folder that
may hold an earlier run's: a name taken by other bytes moves the whole set to ``<stem>-<n><suffix>`` (issue 37). A
versioned table carries its format version in the Parquet key-value metadata and is written deterministically
(same rows, same bytes: no min/max statistics). The trajectory table (``reconstruct.schema``) and the stats file
are written here; eval's run tables can be too.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import polars as pl

__all__ = ["conform_table", "read_versioned_parquet", "write_atomic", "write_new", "write_versioned_parquet"]


def write_atomic(path: Path, content: bytes | Callable[[Path], None], *, replace: bool = True) -> Path:
    """Write ``content`` (bytes, or a function that writes the file at the path it is given) to ``path``
    atomically, creating its folder; the temporary file is removed if the write fails. ``replace=False``:
    ``FileExistsError`` if ``path`` exists, even one made while this was writing (a hard link never replaces; on a
    file system without hard links the name is first taken with ``O_EXCL``, and is empty until renamed over)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if isinstance(content, bytes):
            with os.fdopen(fd, "wb") as f:
                f.write(content)
        else:
            os.close(fd)
            content(Path(tmp))
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _link_new(tmp: str, path: Path) -> None:
    """``tmp`` renamed to ``path``, which must not exist: ``FileExistsError`` if it does."""
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):  # EPERM: no hard links on this file system
            raise
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # the name is ours from here on
        try:
            os.replace(tmp, path)
        except BaseException:
            path.unlink(missing_ok=True)  # the empty file this made, no one else's
            raise
    else:
        os.unlink(tmp)


def write_new(contents: Mapping[Path, bytes]) -> dict[Path, Path]:
    """Write each file of ``contents`` (its bytes by the path it should have) replacing none: at its own path, or,
    when one of the set's paths holds other bytes, the whole set at ``<stem>-<n><suffix>`` with the first n where
    none does, so the files of one call share a number. A file that already holds the same bytes is kept as it is.
    Returns the path each file has. Each is written by :func:`write_atomic` with ``replace=False``: a name taken
    between the check and the write moves the set on to the next number (the set's files already written stay)."""
    n = 0
    while True:
        targets = {path: path.with_name(f"{path.stem}-{n}{path.suffix}") if n else path for path in contents}
        if not any(target.exists() and not _holds(target, contents[path]) for path, target in targets.items()):
            try:
                for path, target in targets.items():
                    if not target.exists():
                        write_atomic(target, contents[path], replace=False)
                return targets
            except FileExistsError:
                pass
        n += 1


def _holds(path: Path, content: bytes) -> bool:
    """Whether ``path`` is a file of exactly ``content`` (its size first: a file of another size is not read)."""
    return path.is_file() and path.stat().st_size == len(content) and path.read_bytes() == content


def write_versioned_parquet(table: pl.DataFrame, path: Path, version_key: str, version: int) -> Path:
    """Write ``table`` atomically with ``version`` under ``version_key`` in its metadata."""
    metadata = {version_key: str(version)}
    return write_atomic(
        path, lambda tmp: table.write_parquet(tmp, compression="zstd", statistics=False, metadata=metadata)
    )


def read_versioned_parquet(
    path: Path,
    version_key: str,
    version: int,
    *,
    kind: str,
    error: type[ValueError],
    columns: Sequence[str] | None = None,
) -> pl.DataFrame:
    """A table written by :func:`write_versioned_parquet` with this ``version`` (``columns``: only those).
    ``error`` (naming the file) when it is not a readable Parquet file or has another version; ``kind`` says
    what the table is in that message ("trajectory", "run table")."""
    path = Path(path)
    try:
        found = pl.read_parquet_metadata(path).get(version_key)
    except (OSError, pl.exceptions.ComputeError) as e:
        raise error(f"{path}: not a readable Parquet file: {e}") from e
    if found != str(version):
        raise error(f"{path}: {kind} format version {found!r}, expected {version}")
    return pl.read_parquet(path, columns=list(columns) if columns is not None else None)


def conform_table(
    df: pl.DataFrame, schema: pl.Schema, *, source: str, kind: str, error: type[ValueError]
) -> pl.DataFrame:
    """``df`` with exactly ``schema``'s columns, in order and cast to its types; ``error`` naming ``source`` for
    missing or extra columns, or one that does not cast to the ``kind`` schema."""
    missing = [c for c in schema if c not in df.columns]
    extra = [c for c in df.columns if c not in schema]
    if missing or extra:
        raise error(f"{source}: missing columns {missing}, unexpected columns {extra}")
    try:
        return df.select([pl.col(name).cast(dtype, strict=True) for name, dtype in schema.items()])
    except pl.exceptions.InvalidOperationError as e:
        raise error(f"{source}: a column does not cast to the {kind} schema: {e}") from e
