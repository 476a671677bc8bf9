"""Incremental assembler of a Chat Completions answer (vLLM and SGLang, streamed or not) into its completions.

    asm = ChatAssembler(streamed=True)
    for chunk in network_chunks: asm.decode(chunk)   # bytes or text, split anywhere
    completions = asm.flush()                        # one Completion per choice; asm.usage / .error / .torn

Where the token fields come from (``../shared/reference/stack.md`` §2):

- vLLM, non-streamed: top-level ``prompt_token_ids``, ``choices[i].token_ids``, ``choices[i].logprobs.content``.
- vLLM, streamed: ``prompt_token_ids`` on the first chunk, ``token_ids`` and ``logprobs.content`` of each chunk's
  tokens on every chunk, ``usage`` in a last ``choices: []`` chunk.
- SGLang, non-streamed: ``choices[i].prompt_token_ids`` and ``token_ids`` (or ``response_token_ids``), and
  ``choices[i].meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples).
- SGLang, streamed: per-chunk ``logprobs.content``; the ids in one ``sglext`` chunk
  (``{"choices": [], "sglext": {"input_ids": [...], "output_ids": [[...]]}}``), also as a named
  ``event: sglext_ids``.
- With ``return_tokens_as_token_ids`` each log-prob entry's ``token`` is ``"token_id:<id>"``: used when ids lack.

The prompt id array is lifted out of the text before parsing (``_tokens.cut_array``) and kept as text. Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from addon.record_v2 import Stream
from addon.sse import SSEDecoder, SSEEvent
from reconstruct._calls import Completion
from reconstruct._json import dumps, loads
from reconstruct._tokens import TokenText, cut_array, find_array

__all__ = ["ChatAssembler"]

_PROMPT_KEY = "prompt_token_ids"
_LIFTED = '"prompt_token_ids":null'  # where the array was when _io.parse_record lifted it out of the line
_NOTHING = {"content": ""}  # the delta of a token whose text a parser holds back: nothing to assemble
# The stream fast path (ChatAssembler._fast): what it reads, and what sends it to the exact path.
_IDS = re.compile(r'"token_ids":\s*\[(\s*[0-9][0-9,\s]*)\]')  # never an empty list: joined as is
_LOGPROB = re.compile(r'"logprob":\s*(-?[0-9][0-9.eE+-]*|-?Infinity|NaN)')
_FINISH = re.compile(r'"finish_reason":\s*"([^"\\]*)"')
_OTHER_INDEX = re.compile(r'"index":\s*[1-9]')  # a second choice, or a second tool call: the exact path
_ODD = ("\r", "\nevent:", '"error":', '"sglext":')  # CR line ends, named events, errors, SGLang: the exact path
_EMPTY_DELTA = re.compile(r'"delta":\s*\{\}')  # vLLM's for held-back text; beyond the final chunk's: the exact path
# A stream stored column-wise (addon/record_v2.py Stream): where a literal piece of its template leaves a slot whose
# values the fast path would read across (then the text decides), and the columns it reads.
_INDEX_SLOT = re.compile(r'"index":\s*$')
# A column of values each of which _IDS (after its key) captures whole but for its brackets, or _LOGPROB whole.
_ONE_ID_EACH = re.compile(r"\[[0-9]+\](?:\n\[[0-9]+\])*")
_NUMBER_EACH = re.compile(r"-?[0-9][0-9.eE+-]*(?:\n-?[0-9][0-9.eE+-]*)*")
_KEY_SLOT = re.compile(r"^\s*:")  # a slot before it is a key: only a delta's (addon/record_v2.py) is read across
_DELTA_KEYS = {'"content"', '"reasoning"', '"reasoning_content"'}
_IDS_KEY, _LOGPROB_KEY, _FINISH_KEY = '"token_ids"', '"logprob"', '"finish_reason"'


class _Choice:
    __slots__ = ("deltas", "finish", "ids", "logprobs", "message_", "prompt", "swallowed", "tokens")

    def __init__(self) -> None:
        self.ids: list[int] | None = None
        self.logprobs: list[Any] = []
        self.tokens: list[str] = []  # log-prob entries' token strings ("token_id:123" when asked for)
        self.deltas: list[dict[str, Any]] = []  # streamed: assembled into the message at the end
        self.message_: dict[str, Any] | None = None  # non-streamed: the message as sent
        self.finish: str | None = None
        self.prompt: TokenText | None = None
        self.swallowed = 0  # streamed ids that came with an empty delta and no finish reason (see completion)

    def add_logprobs(self, logprobs: Any, *, tokens: bool) -> None:
        """Log-probs of one chunk's tokens; their token strings too when the chunk carried no ids."""
        if not isinstance(logprobs, dict):
            return
        content = logprobs.get("content")
        if isinstance(content, list):
            try:
                self.logprobs += [entry["logprob"] for entry in content]
            except (KeyError, TypeError):  # an entry without a log-prob: the call then has none
                self.logprobs += [None] * len(content)
            if tokens:
                self.tokens += [entry.get("token") or "" if isinstance(entry, dict) else "" for entry in content]
        elif isinstance(logprobs.get("token_logprobs"), list):  # the legacy completions shape
            self.logprobs += logprobs["token_logprobs"]

    def message(self) -> dict[str, Any]:
        if self.message_ is not None:
            return self.message_
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        for delta in self.deltas:
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            thought = delta.get("reasoning") or delta.get("reasoning_content")
            if isinstance(thought, str):
                reasoning.append(thought)
            for call in delta.get("tool_calls") or ():
                if not isinstance(call, dict):
                    continue
                empty = {"id": "", "type": "function", "name": "", "arguments": ""}
                slot = calls.setdefault(call.get("index", len(calls)), empty)
                slot["id"] = slot["id"] or call.get("id") or ""
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
        return {
            "role": "assistant",
            "content": "".join(content) or None,
            "reasoning": "".join(reasoning) or None,
            "tool_calls": [
                {"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(calls.items())
            ],
        }

    def completion(self, index: int, prompt: TokenText | None) -> Completion:
        ids = self.ids
        if ids is None and self.tokens and all(t.startswith("token_id:") for t in self.tokens):
            ids = [int(t[9:]) for t in self.tokens]
        logprobs: list[float] | None = self.logprobs
        if ids is None or len(self.logprobs) != len(ids) or not _numbers(self.logprobs):
            logprobs = None
        completion = Completion(index, self.prompt or prompt, ids, logprobs, self.finish, self.message)
        # vLLM's tool-call parser holds back text it takes for the start of a call (empty deltas ``{}`` while ids
        # flow); when no call came of it, the streamed client never saw that text (issue 15).
        if self.swallowed and not completion.message["tool_calls"]:
            completion.swallowed = self.swallowed
        return completion


class ChatAssembler:
    """Feeds on the response body of one Chat Completions exchange; ``flush`` returns its completions.

    A vLLM stream sends one chunk per token, so parsing every chunk costs more than everything else together.
    ``flush`` first reads such a stream's ids and log-probs with three regular expressions over the whole text
    and keeps the result only when it checks out exactly (one choice, as many ids as log-probs as the usage
    count says, no error, no SGLang extension); anything else, and the message of a stream (read lazily), goes
    through the exact path: event by event. ``fast=False`` forces the exact path."""

    def __init__(self, *, streamed: bool, fast: bool = True, prompt: TokenText | None = None) -> None:
        self.streamed = streamed
        self.fast = fast
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None  # an error body or error event
        self.torn = False  # the stream (or the JSON body) ended before it was complete
        self.model: str | None = None
        self.path = "exact"  # which path read the answer (fast: see above)
        self._parts: list[Any] = []  # the body so far
        self._choices: dict[int, _Choice] = {}
        self._prompt = prompt  # lifted out of the record line before parsing: the body holds null in its place
        self._sglext_output: Any = None
        self._stream: tuple[Stream, str] | None = None

    def decode(self, chunk: bytes | str) -> list[Completion]:
        self._parts.append(chunk)
        return []

    def decode_stream(self, stream: Stream, raw: str) -> None:
        """The whole answer, a stream stored column-wise (addon/record_v2.py): its ids and log-probs are read from
        the columns when the fast path would read them from its text; else its text is built and read."""
        self._stream = (stream, raw)

    def flush(self) -> list[Completion]:
        if self._stream is not None:
            stream, raw = self._stream
            self._stream = None
            if self.fast and (found := self._fast_columns(stream, raw)) is not None:
                return found
            self._parts = [stream.text(raw)]
        parts, self._parts = self._parts, []
        text = b"".join(parts).decode("utf-8", "replace") if parts and isinstance(parts[0], bytes) else "".join(parts)
        if not self.streamed:
            self._body(text)
        elif self.fast and (found := self._fast(text)) is not None:
            return found
        else:
            sse = SSEDecoder()
            self._events(sse.decode(text))
            sse.flush()
            self.torn = sse.torn or self.torn
        if self._sglext_output is not None:
            outputs = self._sglext_output
            if outputs and not isinstance(outputs[0], list):
                outputs = [outputs]
            for index, ids in enumerate(outputs):
                choice = self._choices.setdefault(index, _Choice())
                if choice.ids is None and isinstance(ids, list):
                    choice.ids = list(ids)
        return [choice.completion(index, self._prompt) for index, choice in sorted(self._choices.items())]

    def _fast(self, text: str) -> list[Completion] | None:
        span = find_array(text, _PROMPT_KEY)
        if span is not None:
            cut, stop = span
            prompt = TokenText.from_json(text[cut:stop])
        elif self._prompt is not None and (at := text.find(_LIFTED)) >= 0:
            cut, stop, prompt = at + len(_LIFTED) - 4, at + len(_LIFTED), self._prompt
        else:
            return None
        # The stream is scanned in place around the prompt array (the first chunk's start, then all after the
        # array): no copy of a text this long, and no scan of the prompt.
        head = text[:cut]
        if any(m in head or text.find(m, stop) >= 0 for m in _ODD) or _OTHER_INDEX.search(head):
            return None
        if len(_EMPTY_DELTA.findall(text, stop)) > 1:
            return None
        end = text.rfind('"usage"')
        start = text.rfind("\ndata: {", 0, end) + 7
        if end < stop or start < 7 or _OTHER_INDEX.search(text, stop):
            return None
        try:
            last = loads(text[start : text.index("\n", start)])
            ids = loads("[" + ",".join(_IDS.findall(head) + _IDS.findall(text, stop)) + "]")
            logprobs = list(map(float, _LOGPROB.findall(head) + _LOGPROB.findall(text, stop)))
        except ValueError:
            return None
        usage = last.get("usage") if isinstance(last, dict) else None
        if not (isinstance(usage, dict) and usage.get("completion_tokens") == len(ids) == len(logprobs) > 0):
            return None
        self.usage, self.model, self.path = usage, last.get("model"), "fast"
        message = lambda: _exact_message(head + "null" + text[stop:])  # noqa: E731 - read only when asked for
        return [Completion(0, prompt, ids, logprobs, _last_finish(text), message)]

    def _fast_columns(self, stream: Stream, raw: str) -> list[Completion] | None:
        """What ``_fast`` reads from the stream's text, read from its columns and the rest of its text (the same
        answer, or None exactly where ``_fast`` may not give one: then the text is built and read)."""
        literals, n = stream.literals, stream.n
        if self._prompt is None or not stream.gaps or stream.gaps[0][0] != 0:
            return None
        first = raw[: stream.gaps[0][1]]  # the text before the first templated event: the prompt ids' event
        at = first.find(_LIFTED)
        if at < 0:
            return None
        cut, stop = at + len(_LIFTED) - 4, at + len(_LIFTED)
        head, after = first[:cut], [first[stop:]]  # the text around the lifted array, in order
        rest: list[tuple[int, str]] = []  # the other raw pieces, each with the templated event it comes before
        done = stream.gaps[0][1]
        for i, size in stream.gaps[1:]:
            rest.append((i, raw[done : done + size]))
            after.append(raw[done : done + size])
            done += size
        reading = _template_reading(literals)
        if reading is None:
            return None
        slots, key_slots, empty_per_event = reading
        if (
            any(m in head or any(m in t for t in after) for m in _ODD)
            or any(t.startswith("event:") for _, t in rest)
            or _OTHER_INDEX.search(head)
            or any(_OTHER_INDEX.search(t) for t in after)
            or any(not set(stream.columns[j].split("\n")) <= _DELTA_KEYS for j in key_slots)
        ):
            return None
        # Each templated event, and each raw piece before one, ends an event: no pattern reads across into the next
        # (only a key's colon and blanks could, and "event:" after a line break).
        lefts = [first] + [t for i, t in rest if i < n]
        if any(not t.endswith("\n\n") or t.rstrip().endswith(":") for t in lefts):
            return None
        empty = n * empty_per_event + sum(len(_EMPTY_DELTA.findall(t)) for t in after)
        if empty > 1 or not rest or rest[-1][0] != n:
            return None
        columns = {key: (prefix, stream.columns[j]) for key, (prefix, j) in slots.items()}
        last_text = rest[-1][1]
        end = last_text.rfind('"usage"')
        if end < 0:
            return None
        found = last_text.rfind("\ndata: {", 0, end)
        start = found + 7 if found >= 0 else 6 if last_text.startswith("data: {") else -1
        newline = last_text.find("\n", start) if start >= 0 else -1
        if newline < 0:
            return None
        try:
            last = loads(last_text[start:newline])
            ids = loads("[" + ",".join(_in_order(_IDS, head, after, rest, columns[_IDS_KEY], n)) + "]")
            logprobs = list(map(float, _in_order(_LOGPROB, head, after, rest, columns[_LOGPROB_KEY], n)))
        except (ValueError, _Misfit):
            return None
        usage = last.get("usage") if isinstance(last, dict) else None
        if not (isinstance(usage, dict) and usage.get("completion_tokens") == len(ids) == len(logprobs) > 0):
            return None
        finish = _columns_finish(first, rest, columns.get(_FINISH_KEY), n)
        self.usage, self.model, self.path = usage, last.get("model"), "fast"
        message = lambda: _exact_message(stream.text(raw))  # noqa: E731 - read only when asked for
        return [Completion(0, self._prompt, ids, logprobs, finish, message)]

    # ---- streamed
    def _events(self, events: list[SSEEvent]) -> None:
        datas: list[str] = []
        names: list[str] = []
        for event in events:
            data = event.data
            if data == "[DONE]":
                continue
            if self._prompt is None and _PROMPT_KEY in data:
                data, array = cut_array(data, _PROMPT_KEY)
                if array is not None:
                    self._prompt = TokenText.from_json(array)
            datas.append(data)
            names.append(event.event)
        if not datas:
            return
        try:  # one parse for the whole batch: per-token chunks are many and small
            objects = loads("[" + ",".join(datas) + "]")
        except ValueError:
            objects = []
            for data in datas:
                try:
                    objects.append(loads(data))
                except ValueError:
                    objects.append(None)
                    self.torn = True  # a damaged event: the stream is not whole
        for name, obj in zip(names, objects, strict=True):
            if isinstance(obj, dict):
                self._chunk(obj, name)

    def _chunk(self, obj: dict[str, Any], name: str) -> None:
        choices = obj.get("choices")
        if not choices:
            self._extra(obj, name)
            return
        for raw in choices:  # one pass per token chunk: kept to plain dict reads
            if not isinstance(raw, dict):
                continue
            choice = self._choices.get(raw.get("index", 0))
            if choice is None:
                choice = self._choices[raw.get("index", 0)] = _Choice()
            ids = raw.get("token_ids")
            if isinstance(ids, list):
                if choice.ids is None:
                    choice.ids = []
                choice.ids += ids
            logprobs = raw.get("logprobs")
            if logprobs:
                content = logprobs.get("content") if isinstance(logprobs, dict) else None
                if ids and isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
                    choice.logprobs.append(content[0].get("logprob"))  # vLLM's one token per chunk
                else:
                    choice.add_logprobs(logprobs, tokens=not isinstance(ids, list))
            delta = raw.get("delta")
            if isinstance(delta, dict) and delta and delta != _NOTHING:
                choice.deltas.append(delta)
            elif delta == {} and ids and not raw.get("finish_reason"):  # the final chunk's end-of-turn id: not text
                choice.swallowed += len(ids)
            if raw.get("finish_reason"):
                choice.finish = raw["finish_reason"]
        if obj.get("usage"):  # vLLM's continuous_usage_stats: on every chunk, the last one counts
            self.usage = obj["usage"]

    def _extra(self, obj: dict[str, Any], name: str) -> None:
        """A chunk without choices: an error, the usage, SGLang's ids."""
        if name == "error" or "error" in obj:
            self.error = self.error or _error_text(obj.get("error", obj))
            return
        self.model = self.model or obj.get("model")
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        ext = obj.get("sglext") if "sglext" in obj else obj if name == "sglext_ids" else None
        if isinstance(ext, dict):
            if self._prompt is None and isinstance(ext.get("input_ids"), list):
                self._prompt = TokenText.from_ids(ext["input_ids"])
            if isinstance(ext.get("output_ids"), list):
                self._sglext_output = ext["output_ids"]

    # ---- non-streamed
    def _body(self, text: str) -> None:
        text, array = cut_array(text, _PROMPT_KEY)
        if array is not None:
            self._prompt = TokenText.from_json(array)
        try:
            body = loads(text)
        except ValueError:
            self.torn = True
            return
        if not isinstance(body, dict):
            self.error = "the answer is not a JSON object"
            return
        if "error" in body or body.get("object") == "error":
            self.error = _error_text(body.get("error", body))
            return
        self.model = body.get("model")
        self.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        ext = body.get("sglext")
        if isinstance(ext, dict):
            if self._prompt is None and isinstance(ext.get("input_ids"), list):
                self._prompt = TokenText.from_ids(ext["input_ids"])
            self._sglext_output = ext.get("output_ids")
        for raw in body.get("choices") or []:
            if isinstance(raw, dict):
                self._choices[raw.get("index", len(self._choices))] = _full_choice(raw)


def _full_choice(raw: dict[str, Any]) -> _Choice:
    choice = _Choice()
    if isinstance(raw.get("prompt_token_ids"), list):  # SGLang, choices after the one cut_array lifted
        choice.prompt = TokenText.from_ids(raw["prompt_token_ids"])
    ids = raw.get("token_ids") if raw.get("token_ids") is not None else raw.get("response_token_ids")
    choice.ids = list(ids) if isinstance(ids, list) else None
    choice.add_logprobs(raw.get("logprobs"), tokens=choice.ids is None)
    meta = raw.get("meta_info")
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if isinstance(triples, list) and all(isinstance(t, list) and len(t) >= 2 for t in triples):
        if choice.ids is None:
            choice.ids = [t[1] for t in triples]
        if len(choice.logprobs) != len(choice.ids):
            choice.logprobs = [t[0] for t in triples]
    message = m if isinstance(m := raw.get("message"), dict) else {}
    calls = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") or {}
            args = fn.get("arguments")
            arguments = args if isinstance(args, str) else "" if args is None else dumps(args)
            function = {"name": fn.get("name") or "", "arguments": arguments}
            calls.append({"id": call.get("id") or "", "type": call.get("type") or "function", "function": function})
    choice.message_ = {
        "role": "assistant",
        "content": message.get("content") if isinstance(message.get("content"), str) else None,
        "reasoning": message.get("reasoning") or message.get("reasoning_content"),
        "tool_calls": calls,
    }
    choice.finish = raw.get("finish_reason")
    return choice


@functools.lru_cache(maxsize=256)
def _template_reading(literals: tuple[str, ...]) -> tuple[dict[str, tuple[str, int]], list[int], int] | None:
    """What the fast path reads from a stream template's literal pieces (a session's streams share one): for each
    key it reads, the text before its values and its column; the columns of slots in a key's place (a delta's key,
    whose values are checked); the empty deltas in each event. None when the literals alone rule it out: a marker
    it refuses, a value it reads that is not a slot of its own, an event that does not end in a blank line."""
    joined = "\0".join(literals)
    if (
        any(m in joined for m in _ODD)
        or "\nevent:" in "\n" + literals[0]
        or '"usage"' in joined
        or _LIFTED[:-5] in joined
        or _OTHER_INDEX.search(joined)
        or any(_INDEX_SLOT.search(lit) for lit in literals[:-1])
        or not literals[-1].endswith("\n\n")
        or literals[-1].rstrip().endswith(":")
    ):
        return None
    slots = {}
    for key in (_IDS_KEY, _LOGPROB_KEY, _FINISH_KEY):
        count = joined.count(key)
        found = [j for j, lit in enumerate(literals[:-1]) if lit.rstrip().endswith(key + ":")]
        if count == 1 and len(found) == 1:
            literal = literals[found[0]]
            slots[key] = (literal[literal.rindex(key) :], found[0])
        elif count or key != _FINISH_KEY:
            return None
    key_slots = [j for j, lit in enumerate(literals[1:]) if _KEY_SLOT.match(lit)]
    return slots, key_slots, len(_EMPTY_DELTA.findall(joined))


class _Misfit(Exception):
    """A column the fast path cannot read value for value (then the stream's text decides)."""


def _in_order(
    pattern: re.Pattern[str], head: str, after: list[str], rest: list[tuple[int, str]], column: tuple[str, str], n: int
) -> list[str]:
    """What ``pattern`` finds in the stream's text, in order: in the text before and after the lifted prompt array,
    in the templated events (the column's values, each after its key as the literal has it) and in the raw pieces
    between them. ``_Misfit`` when a value is not found exactly once (an empty id list)."""
    key, values = column
    if pattern is _IDS and _ONE_ID_EACH.fullmatch(values):  # what findall would capture, without a scan
        found = values[1:-1].split("]\n[")
    elif pattern is _LOGPROB and _NUMBER_EACH.fullmatch(values):
        found = values.split("\n")
    else:
        found = pattern.findall(key + values.replace("\n", "\n" + key))
    if len(found) != n:
        raise _Misfit
    out = pattern.findall(head) + pattern.findall(after[0])
    done = 0
    for i, text in rest:
        out += found[done:i]
        out += pattern.findall(text)
        done = max(done, i)
    return out + found[done:]


def _columns_finish(first: str, rest: list[tuple[int, str]], column: tuple[str, str] | None, n: int) -> str | None:
    """``_last_finish`` of the stream's text, from its end: the raw pieces and the finish reasons of the templated
    events between them."""
    values = column[1].split("\n") if column is not None else None
    bounds = [(0, first), *rest]  # each raw piece comes before the templated event it names
    stop = n
    for i, text in reversed(bounds):
        if values is not None:
            for value in reversed(values[i:stop]):
                if value[0] == '"' and "\\" not in value and '"' not in value[1:-1]:
                    return value[1:-1]
        stop = min(stop, i)
        if (found := _last_finish(text)) is not None:
            return found
    return None


def _last_finish(text: str) -> str | None:
    """The last finish reason a stream sent (what the exact path keeps), searched from the end: a stream sends
    it in its last chunks, and every chunk before them says ``null``."""
    end = len(text)
    while (i := text.rfind('"finish_reason":', 0, end)) >= 0:
        if found := _FINISH.match(text, i):
            return found[1]
        end = i
    return None


def _exact_message(text: str) -> dict[str, Any]:
    asm = ChatAssembler(streamed=True, fast=False)
    asm.decode(text)
    found = asm.flush()
    return found[0].message if found else {"role": "assistant", "content": None, "reasoning": None, "tool_calls": []}


def _numbers(values: list[Any]) -> bool:
    try:
        sum(values)  # C speed; a None (an entry without a log-prob) or a string raises
    except TypeError:
        return False
    return True


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
