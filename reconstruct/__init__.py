"""Captured model calls → token-faithful trajectories: ``python -m reconstruct`` (see __main__.py).

The public surface is below and in two modules: ``reconstruct.schema`` (the trajectory table: columns, ``read``,
``write``) and ``reconstruct.files`` (atomic writes and versioned Parquet tables, for any table of the project).

Layers, each in its own private module, pure except the edges (``_io``, ``_build``'s file writing):

- ``_lines.LineIndexer`` splits capture files into record lines; ``addon.sse.SSEDecoder`` splits event streams;
  ``_chat.ChatAssembler`` turns one upstream answer into completions (all ``decode(chunk)`` / ``flush()``).
- ``_extract.extract`` turns one capture record into model calls, per wire API (``addon/apis.py``), rebuilding
  ids with ``_retokenize.Retokenizer`` when the record has none.
- ``_merge.merge`` turns one session's calls into traces (prefix merging, drift handling, break causes).
- ``_build.reconstruct`` runs it over capture files into the table of ``reconstruct.schema``.
- ``_audit.audit`` re-scores a table with a model.
"""

from reconstruct._audit import AuditReport, audit, score_trace
from reconstruct._build import reconstruct, stats_path, write_trajectories
from reconstruct._errors import CaptureError, ConfigError, ReconstructError, RetokenizeError
from reconstruct._extract import register_native
from reconstruct._io import discover, read_session_tasks
from reconstruct._merge import CAUSES
from reconstruct._stats import Stats, file_stats

__all__ = [
    "CAUSES",
    "AuditReport",
    "CaptureError",
    "ConfigError",
    "ReconstructError",
    "RetokenizeError",
    "Stats",
    "audit",
    "discover",
    "file_stats",
    "read_session_tasks",
    "reconstruct",
    "register_native",
    "score_trace",
    "stats_path",
    "write_trajectories",
]
