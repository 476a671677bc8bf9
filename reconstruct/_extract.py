"""From one capture record to the model calls it holds, per wire API.

``EXTRACTORS`` maps a record's ``api`` to a function ``(record, retokenizer) -> list[Call]``, one per wire API
of the addon's registry (addon/apis.py):

- ``chat``: the upstream exchange is Chat Completions (``ChatAssembler``): vLLM or SGLang, streamed or not.
- an API with a translator (``anthropic``, ``responses``, ``google``): once the addon translates it, the record
  carries the Chat Completions exchange it had with the upstream (``upstream_request`` and ``response_body``),
  and the chat extractor reads it. A record of a native call passed through untranslated (``polar_translate=
  never``, or transparent capture-only mode in front of a closed API) is rewritten as a chat exchange first
  (:func:`convert_untranslated`); ``register_native(api, converter)`` replaces that for one API, where
  ``converter(record)`` returns the record rewritten as a chat exchange (or None when it cannot).
- Records of other paths (``/v1/models``, ``count_tokens``) are not model calls: ``extract`` returns None.

Pure: no I/O (the tokenizer, when given, is already loaded).
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

from addon import apis, native
from addon.constrained import constraints
from addon.record import upstream_body
from reconstruct._calls import Call, Completion, Problem, Request
from reconstruct._chat import ChatAssembler
from reconstruct._errors import RetokenizeError
from reconstruct._io import has_upstream_request, lifted_prompt, stored_stream
from reconstruct._json import dumps
from reconstruct._retokenize import Retokenizer
from reconstruct._tokens import TokenText

__all__ = [
    "EXTRACTORS",
    "NATIVE_CONVERTERS",
    "check_prompt_count",
    "convert_untranslated",
    "extract",
    "register_native",
]

Extractor = Callable[[dict[str, Any], Retokenizer | None], list[Call]]
Converter = Callable[[dict[str, Any]], dict[str, Any] | None]

# Notes a call can carry, counted in the stats.
IDS_DISAGREE = "captured ids disagree with usage"  # the upstream dropped ids (vllm#27482): rebuilt or dropped
USAGE_MISMATCH = "retokenized counts disagree with usage"
CONSTRAINED = "constrained decoding: log-probs dropped"  # not the policy's (addon/constrained.py): recomputed


def extract(record: dict[str, Any], retokenizer: Retokenizer | None) -> list[Call] | None:
    """The calls of one record, or None when it is not a model call."""
    path = str(record.get("path") or "").partition("?")[0].rstrip("/")
    extractor = EXTRACTORS.get(str(record.get("api")))
    if extractor is None or path.endswith("/count_tokens"):
        return None
    return extractor(record, retokenizer)


def register_native(api: str, converter: Converter) -> None:
    NATIVE_CONVERTERS[api] = converter


# Upstream modes (the record's ``upstream``) whose usage counts tokens the way our tokenizer would.
_OPEN_UPSTREAMS = ("vllm", "sglang")
_OPTIONS = native.Options(model="", upstream="vllm")


def convert_untranslated(record: dict[str, Any], translator: native.Translator) -> dict[str, Any] | None:
    """A native call recorded untranslated, as the Chat Completions exchange the chat extractor reads; None when
    the request does not translate or the answer holds nothing.

    - ``upstream_request``: the Chat Completions body the addon's own translator makes of the native request, so
      retokenization renders what a translated call would have sent;
    - ``response_body``: the translator's ``to_chat_completion`` of the native answer, streamed or not: the
      assistant message, its finish reason, token ids only where the answer has them (vLLM's Responses API), and
      usage only when the upstream is an open server (a closed API counts with another tokenizer).
    """
    request, text = record.get("request"), record.get("response_body")
    if not isinstance(request, dict) or not isinstance(text, str) or record.get("status") != 200:
        return None
    try:
        translation = translator.start(request, str(record.get("path") or ""), {}, _OPTIONS)
    except native.BadRequest:
        return None
    if isinstance(translation, native.LocalAnswer):  # count_tokens answers locally: not a model call
        return None
    body = translator.to_chat_completion(text, bool(record.get("streamed")))
    if body is None:
        return None
    if record.get("upstream") not in _OPEN_UPSTREAMS:
        body.pop("usage", None)
    return {
        **record,
        "upstream_request": translation.chat_body,
        "injected": {},
        "response_body": dumps(body),
        "streamed": False,
    }


NATIVE_CONVERTERS: dict[str, Converter] = {
    api.name: functools.partial(convert_untranslated, translator=api.translator)
    for api in apis.APIS
    if api.translator is not None
}


def extract_translated(record: dict[str, Any], retokenizer: Retokenizer | None) -> list[Call]:
    if _was_translated(record):
        return extract_chat(record, retokenizer)
    converter = NATIVE_CONVERTERS.get(str(record.get("api")))
    converted = converter(record) if converter is not None else None
    if converted is not None:
        return extract_chat(converted, retokenizer)
    return [_failed(record, Problem.NATIVE, f"{record.get('api')} call without a Chat Completions exchange")]


def _was_translated(record: dict[str, Any]) -> bool:
    """Whether the native call went upstream as Chat Completions: the record says so (a head field: no body is
    parsed); older records tell by their upstream body (Anthropic bodies have ``messages`` too, so the client's
    request alone proves nothing, and a passed-through call can have an upstream body of its own API)."""
    if isinstance(translated := record.get("translated"), bool):
        return translated
    if not has_upstream_request(record):
        return False
    body = record.get("upstream_request")
    return isinstance(body, dict) and isinstance(body.get("messages"), list)


def extract_chat(record: dict[str, Any], retokenizer: Retokenizer | None) -> list[Call]:
    if record.get("request_raw") is not None:  # a head field: the bodies need not be parsed to know
        return [_failed(record, Problem.ERROR, "the request is not a Chat Completions body (not JSON)")]
    status = record.get("status")
    stream = stored_stream(record) if status == 200 else None
    text = _response_text(record) if stream is None else ""
    if text is None or status != 200:
        reason = (record.get("error") or {}).get("message") if isinstance(record.get("error"), dict) else None
        return [_failed(record, Problem.ERROR, f"status {status}: {reason or (text or '')[:200]}")]
    if stream is not None:  # an event stream stored column-wise (addon/record_v2.py): read from its columns
        asm = ChatAssembler(streamed=True, prompt=lifted_prompt(record))
        asm.decode_stream(*stream)
    else:
        asm = ChatAssembler(streamed=not text.lstrip().startswith("{"), prompt=lifted_prompt(record))
        asm.decode(text)
    said = ("content", "reasoning", "tool_calls")
    completions = [c for c in asm.flush() if c.token_ids or any(c.message.get(k) for k in said)]
    if not completions:
        return [_failed(record, Problem.ERROR, asm.error or "the answer holds no completion")]
    complete = record.get("complete") is True and not asm.torn and asm.error is None
    ids_ok = _ids_agree_with_usage(completions, asm.usage)
    request = Request(lambda: _request_parts(record))  # parsed only if someone reads it (see _calls.Request)
    constrained = _constrained(record)
    calls = []
    for comp in completions:
        call = _call(record, request, comp, complete, len(completions))
        if ids_ok and comp.prompt is not None and comp.token_ids:
            call.prompt, call.output_ids, call.logprobs = comp.prompt, comp.token_ids, comp.logprobs
            call.usage_prompt = asm.usage.get("prompt_tokens") if asm.usage else None
        elif retokenizer is not None:
            _retokenize(call, upstream_body(record), comp, retokenizer, asm.usage if len(completions) == 1 else None)
        else:
            call.problem, call.detail = Problem.MISSING_IDS, "no token ids in the answer and no --tokenizer"
        if not ids_ok:
            call.notes.append(IDS_DISAGREE)
        call.swallowed = comp.swallowed > 0
        if constrained:  # the trace's log-probs become null: the trainer recomputes them under the policy
            call.constrained = True
            if call.logprobs is not None:
                call.logprobs = None
                call.notes.append(CONSTRAINED)
        calls.append(call)
    return calls


def _constrained(record: dict[str, Any]) -> bool:
    """Whether the upstream decoded the call under a constraint: the record's ``constrained`` list; records
    written before it existed are judged by the body sent upstream."""
    found = record.get("constrained")
    return bool(found) if isinstance(found, list) else bool(constraints(upstream_body(record)))


def _request_parts(record: dict[str, Any]) -> tuple[str | None, list[Any] | None, list[Any] | None]:
    """(model asked for, messages, tools) of a record: the messages and tools of the Chat Completions body sent
    upstream, the model of the client's own request (for a translated call, the native model name)."""
    body = upstream_body(record)
    request = record.get("request")
    model = request.get("model") if isinstance(request, dict) else None
    if not isinstance(body, dict):
        return (model if isinstance(model, str) else None), None, None
    messages = body.get("messages") if isinstance(body.get("messages"), list) else None
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    return (model if isinstance(model, str) else None), messages, tools


def _call(record: dict[str, Any], request: Request, comp: Completion, complete: bool, n: int) -> Call:
    rid = str(record.get("id"))
    return Call(
        exchange_id=rid if n == 1 else f"{rid}#{comp.index}",
        session_id=str(record.get("session_id")),
        order=(float(record.get("t_start") or 0.0), rid, comp.index),
        api=str(record.get("api")),
        request=request,
        prompt=None,
        output_ids=None,
        logprobs=None,
        finish_reason=comp.finish_reason,
        complete=complete,
        source="captured",
        completion=comp,
    )


def _retokenize(
    call: Call, body: Any, comp: Completion, retokenizer: Retokenizer, usage: dict[str, Any] | None
) -> None:
    if not (isinstance(body, dict) and isinstance(body.get("messages"), list)):
        call.problem, call.detail = Problem.TEMPLATE, "the request is not a Chat Completions body"
        return
    kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else None
    finish = comp.finish_reason if call.complete else None
    try:
        prompt = retokenizer.prompt_ids(body["messages"], call.tools, kwargs)
        output = retokenizer.output_ids(body["messages"], call.tools, kwargs, comp.message, finish)
    except RetokenizeError as e:
        call.problem, call.detail = Problem.TEMPLATE, str(e)
        return
    sampled = usage.get("completion_tokens") if usage else None
    if finish == "length" and isinstance(sampled, int) and 0 < sampled < len(output):
        # The template closed the cut turn (a "</think>", a quote) where the model had sampled nothing more:
        # the usage count says how many ids were really sampled.
        output = output[:sampled]
    call.prompt, call.output_ids, call.logprobs, call.source = TokenText.from_ids(prompt), output, None, "retokenized"
    if usage and (usage.get("prompt_tokens"), usage.get("completion_tokens")) != (len(prompt), len(output)):
        call.notes.append(USAGE_MISMATCH)


def _ids_agree_with_usage(completions: list[Completion], usage: dict[str, Any] | None) -> bool:
    """vLLM can drop sampled ids from a stream (a reasoning parser with include_reasoning=false, vllm#27482): the
    usage counts tell. No usage (a torn stream) is no evidence against the ids. The prompt's count is checked
    after merging (``check_prompt_count``), where it comes for free."""
    if not usage or any(c.token_ids is None or c.prompt is None for c in completions):
        return True
    sampled = sum(len(c.token_ids or []) for c in completions)
    return usage.get("completion_tokens") in (None, sampled)


def check_prompt_count(call: Call) -> None:
    """Note a call whose prompt ids disagree in number with the usage the upstream reported. Run once merging
    has parsed the prompt's tail (or the whole of a trace's first prompt), so the count costs nothing."""
    if call.usage_prompt is not None and call.prompt is not None and call.usage_prompt != call.prompt.n:
        call.notes.append(IDS_DISAGREE)


def _failed(record: dict[str, Any], problem: str, detail: str) -> Call:
    rid = str(record.get("id"))
    return Call(
        exchange_id=rid,
        session_id=str(record.get("session_id")),
        order=(float(record.get("t_start") or 0.0), rid, 0),
        api=str(record.get("api")),
        request=Request(lambda: _request_parts(record)),
        prompt=None,
        output_ids=None,
        logprobs=None,
        finish_reason=None,
        complete=False,
        source="captured",
        completion=None,
        problem=problem,
        detail=detail,
    )


def _response_text(record: dict[str, Any]) -> str | None:
    if isinstance(body := record.get("response_body"), str):
        return body
    if isinstance(record.get("response_b64"), str):  # not UTF-8: torn inside a character, most likely
        return base64.b64decode(record["response_b64"]).decode("utf-8", "replace")
    return None


EXTRACTORS: dict[str, Extractor] = {
    api.name: extract_chat if api.translator is None else extract_translated for api in apis.APIS
}
