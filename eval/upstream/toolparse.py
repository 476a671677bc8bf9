"""Incremental text stages of eval.upstream.server: stop strings, then reasoning and Hermes tool-call parsing.

Both take text deltas as they are decoded and hold back any tail that might be the start of a marker, so a
stream never shows text it would later have to take back (as vLLM's parsers do):

    stops = StopStrings(["\\n\\n"]);  text, hit = stops.feed(delta)      # ...; stops.flush() at the end
    parser = OutputParser(parse_tools=True);  events = parser.feed(text)  # ...; events += parser.flush()

``<think>…</think>`` becomes ``Reasoning`` (vLLM's qwen3 reasoning parser) and ``<tool_call>{json}</tool_call>``
becomes ``ToolCall`` (vLLM's hermes tool parser); everything else is ``Content``. Newlines next to the
markers are dropped (content and reasoning are each stripped of leading and trailing newlines, exactly the
strip that eval.upstream.models.CHAT_TEMPLATE applies), so a parsed message renders back to the text it came from.
"""

from __future__ import annotations

import dataclasses
import json

__all__ = ["Content", "Event", "OutputParser", "Reasoning", "StopStrings", "ToolCall"]

_THINK, _END_THINK = "<think>", "</think>"
_TOOL, _END_TOOL = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object, as OpenAI's ``function.arguments``."""


Event = Content | Reasoning | ToolCall


def _partial_len(text: str, markers: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    for n in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class StopStrings:
    """Cuts the text at the first stop string; the stop string itself is not output (vLLM's default)."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns the text that is safe to output, and whether a stop string was hit."""
        text = self._held + text
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        keep = _partial_len(text, self._stops)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text


class OutputParser:
    """Splits generated text into content, reasoning and tool calls, one delta at a time."""

    def __init__(self, *, parse_tools: bool) -> None:
        # vLLM only runs its tool parser when the request has tools and tool_choice is not "none".
        self._openers = [_THINK, _TOOL] if parse_tools else [_THINK]
        self._state: type[Content | Reasoning] | None = Content  # None: inside <tool_call>
        self._buf = ""  # undecided text: a possible marker start, or a tool call body
        self._held_newlines = {Content: "", Reasoning: ""}  # output only if more text of that kind follows
        self._started = {Content: False, Reasoning: False}

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._state is None:
                end = self._buf.find(_END_TOOL)
                if end < 0:
                    return events
                body, self._buf, self._state = self._buf[:end], self._buf[end + len(_END_TOOL) :], Content
                call = _parse_call(body)
                events += [call] if call else self._text(_TOOL + body + _END_TOOL)
                continue
            markers = [_END_THINK] if self._state is Reasoning else self._openers
            found = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
            if not found:
                cut = len(self._buf) - _partial_len(self._buf, markers)
                events += self._text(self._buf[:cut])
                self._buf = self._buf[cut:]
                return events
            start, marker = min(found)
            events += self._text(self._buf[:start])
            self._buf = self._buf[start + len(marker) :]
            self._state = {_THINK: Reasoning, _END_THINK: Content, _TOOL: None}[marker]

    def flush(self) -> list[Event]:
        """Outputs what is still held at the end of generation: a tail that never became a marker, or an
        unclosed tool call (a tool call if its body is complete JSON, as vLLM's hermes parser does, else text)."""
        buf, self._buf = self._buf, ""
        if self._state is None:
            self._state = Content
            call = _parse_call(buf)
            return [call] if call else self._text(_TOOL + buf)
        return self._text(buf)

    def _text(self, text: str) -> list[Event]:
        kind = self._state
        assert kind is not None
        text = self._held_newlines[kind] + text
        if not self._started[kind]:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self._held_newlines[kind] = text[len(body) :]
        if not body:
            return []
        self._started[kind] = True
        return [kind(body)]


def _parse_call(body: str) -> ToolCall | None:
    """The tool call in a ``<tool_call>`` body, or None when it is not a {"name", "arguments"} object (the
    markup then stays in the content, as with vLLM's hermes parser)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    return ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))
