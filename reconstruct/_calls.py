"""The typed rows between parsing and merging: what one upstream answer held, and one model call ready to merge."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any

from reconstruct._json import dumps
from reconstruct._tokens import TokenText

__all__ = ["Call", "Completion", "Problem", "Request"]


class Problem:
    """Why a call has no usable tokens (it then appears in the stats, never in a trace)."""

    ERROR = "error"  # no answer, or an error status / error event before any token
    MISSING_IDS = "missing_ids"  # no token ids from the upstream and no tokenizer to rebuild them
    TEMPLATE = "template_error"  # the chat template could not render the call for retokenization
    NATIVE = "native_untranslated"  # a native-API call recorded without a Chat Completions exchange


@dataclasses.dataclass(eq=False)
class Completion:
    """One choice of one Chat Completions answer, as the upstream sent it."""

    index: int
    prompt: TokenText | None  # prompt_token_ids (vLLM top level, SGLang per choice or sglext input_ids)
    token_ids: list[int] | None  # the sampled ids
    logprobs: list[float] | None  # their sampling log-probs, one per id
    finish_reason: str | None
    assemble: Callable[[], dict[str, Any]] = dataclasses.field(repr=False)  # builds ``message`` when first read
    swallowed: int = 0  # streamed ids whose text the upstream's tool-call parser held back and never sent

    @functools.cached_property
    def message(self) -> dict[str, Any]:
        """The assistant message: role, content, reasoning, tool_calls (a stream's deltas are only joined when
        someone reads it: most calls' messages are never needed)."""
        return self.assemble()

    def __eq__(self, other: object) -> bool:
        fields = ("index", "prompt", "token_ids", "logprobs", "finish_reason", "message")
        return isinstance(other, Completion) and all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None  # type: ignore[assignment]


class Request:
    """What a call sent: the model asked for, and the messages and tools in Chat Completions form. Read from the
    capture record when first asked for: merging works on token ids, and the request bodies are the larger half
    of a record line, so for most calls they are never parsed."""

    __slots__ = ("_parts", "_read")

    def __init__(self, read: Callable[[], tuple[str | None, list[Any] | None, list[Any] | None]]) -> None:
        self._read: Callable[[], tuple[str | None, list[Any] | None, list[Any] | None]] | None = read
        self._parts: tuple[str | None, list[Any] | None, list[Any] | None] | None = None

    @classmethod
    def known(cls, model: str | None, messages: list[Any] | None, tools: list[Any] | None) -> Request:
        return cls(lambda: (model, messages, tools))

    def parts(self) -> tuple[str | None, list[Any] | None, list[Any] | None]:
        if self._parts is None:
            assert self._read is not None
            self._parts, self._read = self._read(), None
        return self._parts


@dataclasses.dataclass(slots=True)
class Call:
    """One model call (one choice of one captured exchange) as merging sees it."""

    exchange_id: str  # record id; "<id>#<choice>" when the answer had several choices
    session_id: str
    order: tuple[float, str, int]  # (t_start, record id, choice): the session's call order
    api: str
    request: Request  # model, messages, tools: see the properties below
    prompt: TokenText | None
    output_ids: list[int] | None  # sampled ids (loss mask 1)
    logprobs: list[float] | None  # None when any sampled id has none
    finish_reason: str | None
    complete: bool  # the exchange finished (no broken stream, no client gone)
    source: str  # "captured" | "retokenized"
    completion: Completion | None  # what it got back (None when nothing came back)
    problem: str | None = None  # a Problem value when there are no usable tokens
    detail: str = ""  # free text for the problem
    notes: list[str] = dataclasses.field(default_factory=list)  # anomalies the stats count (see _extract)
    swallowed: bool = False  # a streamed client never saw part of the sampled text (see Completion.swallowed)
    constrained: bool = False  # decoded under a constraint: its log-probs are not the policy's (dropped)
    usage_prompt: int | None = None  # the prompt token count the upstream's usage reported, checked after merging
    agent: str | None = None  # what identifies the agent (see agent_key); computed when first asked for

    @property
    def model(self) -> str | None:
        """The model the client asked for."""
        return self.request.parts()[0]

    @property
    def messages(self) -> list[Any] | None:
        """The request's messages (Chat Completions form, as sent upstream)."""
        return self.request.parts()[1]

    @property
    def tools(self) -> list[Any] | None:
        return self.request.parts()[2]

    @property
    def answer(self) -> dict[str, Any] | None:
        """The assistant message it got back."""
        return self.completion.message if self.completion is not None else None

    def agent_key(self) -> str:
        if self.agent is None:
            self.agent = agent_key(self.messages or [], self.tools)
        return self.agent

    @property
    def usable(self) -> bool:
        return self.problem is None and self.prompt is not None and self.output_ids is not None


def agent_key(messages: list[Any], tools: Any) -> str:
    """The leading system message and the tools: equal for one agent across compactions, different for a
    sub-agent with its own instructions."""
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    system = first.get("content") if first.get("role") in ("system", "developer") else None
    return hashlib.blake2b(dumps([system, tools]).encode("utf-8"), digest_size=8).hexdigest()
