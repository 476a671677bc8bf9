"""Incremental Server-Sent Events splitter: bytes or text chunks in, complete events out.

    decoder = SSEDecoder()
    events = decoder.decode(chunk)   # for each network chunk, split anywhere (mid-UTF-8, mid-line, mid-JSON)
    events += decoder.flush()        # at the end; ``decoder.torn`` then says whether a partial event was cut off

Follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; ``data:`` lines of one event are joined
with newlines; ``:`` starts a comment; a blank line dispatches; an event still open at the end of the stream
is discarded (a broken stream's last event is incomplete JSON). Pure: no I/O, standard library only, so the addon
(``native.ChatStream``, the untranslated-answer converters) and reconstruction (``reconstruct._chat``) split streams
the same way.
"""

from __future__ import annotations

import codecs
import dataclasses
import re

__all__ = ["SSEDecoder", "SSEEvent"]

_EOL = re.compile(r"\r\n|\r|\n")


@dataclasses.dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"  # the ``event:`` field, "message" when none was sent
    id: str | None = None


class SSEDecoder:
    """Splits an event stream into events; feed ``bytes`` or ``str`` chunks, never a mix of both."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._rest = ""  # an unterminated line
        self._after_cr = False  # the last chunk ended in CR: a leading LF belongs to it
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._open = False  # a field line was seen since the last dispatch
        self.torn = False

    def decode(self, chunk: bytes | str) -> list[SSEEvent]:
        text = self._utf8.decode(chunk) if isinstance(chunk, bytes | bytearray) else chunk
        if not text:
            return []
        if self._after_cr and text[0] == "\n":
            text = text[1:]
        self._after_cr = text.endswith("\r")
        out: list[SSEEvent] = []
        if "\r" not in text and not self._open:
            # LF-only streams of one-line ``data:`` events (what vLLM and SGLang send): split by event at C speed.
            blocks = (self._rest + text).split("\n\n")
            self._rest = blocks.pop()
            lines = []
            for i, block in enumerate(blocks):
                if block[:6] == "data: " and "\n" not in block:
                    out.append(SSEEvent(block[6:], "message", self._id))
                else:  # anything else, from here on, line by line
                    lines = [*"\n\n".join(blocks[i:]).split("\n"), ""]
                    break
        else:
            lines = (self._rest + text).split("\n") if "\r" not in text else _EOL.split(self._rest + text)
            self._rest = lines.pop()
        data = self._data
        for line in lines:
            if line[:6] == "data: ":  # the common field first
                data.append(line[6:])
                self._open = True
            elif line:
                self._field(line)
            elif self._open:
                if data:
                    joined = data[0] if len(data) == 1 else "\n".join(data)
                    out.append(SSEEvent(joined, self._event or "message", self._id))
                data = self._data = []
                self._event, self._open = "", False
        return out

    def flush(self) -> list[SSEEvent]:
        """Nothing more is complete at the end; records whether an event (or a line) was left open."""
        tail = self._utf8.decode(b"", final=True)
        self.torn = bool(self._rest or tail or self._open)
        self._rest, self._data, self._event, self._open = "", [], "", False
        return []

    def _field(self, line: str) -> None:
        if line[0] == ":":
            return  # comment
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        self._open = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
