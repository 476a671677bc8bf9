"""Captured model calls → token-faithful trajectories: ``python -m reconstruct`` (see __main__.py).

Layers, each in its own module, pure except the edges (``_io``, ``_build``'s file writing):

- ``_lines.LineIndexer`` splits capture files into record lines; ``addon.sse.SSEDecoder`` splits event streams;
  ``_chat.ChatAssembler`` turns one upstream answer into completions (all ``decode(chunk)`` / ``flush()``).
- ``_extract.extract`` turns one capture record into model calls, per wire API (``EXTRACTORS``), rebuilding
  ids with ``_retokenize.Retokenizer`` when the record has none.
- ``_merge.merge`` turns one session's calls into traces (prefix merging, drift handling, break causes).
- ``_build.reconstruct`` runs it over capture files into the table of ``reconstruct.schema``.
- ``_audit.audit`` re-scores a table with a model.
"""

from addon.sse import SSEDecoder, SSEEvent
from reconstruct._audit import AuditReport, audit, score_trace
from reconstruct._build import parse_shard, reconstruct, stats_path, write_trajectories
from reconstruct._calls import Call, Completion, Problem
from reconstruct._chat import ChatAssembler
from reconstruct._errors import CaptureError, ConfigError, ReconstructError, RetokenizeError
from reconstruct._extract import EXTRACTORS, extract, register_native
from reconstruct._io import CaptureIndex, discover, read_sessions
from reconstruct._lines import LineIndexer, LineRef, parse_head
from reconstruct._merge import CAUSES, Trace, merge, vote_eot
from reconstruct._retokenize import Retokenizer, detect_eot, parse_eot
from reconstruct._stats import Stats, file_stats
from reconstruct._tokens import TokenText, cut_array

__all__ = [
    "CAUSES",
    "EXTRACTORS",
    "AuditReport",
    "Call",
    "CaptureError",
    "CaptureIndex",
    "ChatAssembler",
    "Completion",
    "ConfigError",
    "LineIndexer",
    "LineRef",
    "Problem",
    "ReconstructError",
    "RetokenizeError",
    "Retokenizer",
    "SSEDecoder",
    "SSEEvent",
    "Stats",
    "TokenText",
    "Trace",
    "audit",
    "cut_array",
    "detect_eot",
    "discover",
    "extract",
    "file_stats",
    "merge",
    "parse_eot",
    "parse_head",
    "parse_shard",
    "read_sessions",
    "reconstruct",
    "register_native",
    "score_trace",
    "stats_path",
    "vote_eot",
    "write_trajectories",
]
