"""OpenAI Chat Completions on the wire: which token fields to ask the upstream for, and the error shape.

The fields per upstream (``polar_upstream``):

- ``vllm``: ``logprobs: true``, ``top_logprobs: 0`` (vLLM needs a value to fill
  ``logprobs.content``; 0 returns the sampled token only), ``return_token_ids: true``; on streams
  ``stream_options.include_usage: true``. vLLM then sends ``prompt_token_ids`` (first chunk) and
  ``choices[].token_ids`` (every chunk).
- ``sglang``: ``logprobs``/``top_logprobs`` as above; non-streamed ``return_prompt_token_ids``,
  ``return_token_ids``, ``return_meta_info``; streamed (where SGLang rejects those) the ``sglext``
  id fields ``return_input_ids_in_sglext``/``return_output_ids_in_sglext`` and
  ``stream_options.include_usage``.
- ``plain``: nothing; the call is only recorded.

A field the client set is never changed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from addon.record import merge_fields

PATH_SUFFIX = "/chat/completions"

_COMMON = {"logprobs": True, "top_logprobs": 0}
TOKEN_FIELDS: dict[str, dict[bool, dict[str, Any]]] = {
    # upstream -> streamed -> fields
    "vllm": {
        False: {**_COMMON, "return_token_ids": True},
        True: {**_COMMON, "return_token_ids": True, "stream_options.include_usage": True},
    },
    "sglang": {
        False: {**_COMMON, "return_prompt_token_ids": True, "return_token_ids": True, "return_meta_info": True},
        True: {
            **_COMMON,
            "return_input_ids_in_sglext": True,
            "return_output_ids_in_sglext": True,
            "stream_options.include_usage": True,
        },
    },
    "plain": {False: {}, True: {}},
}


def is_chat_path(path: str) -> bool:
    return path.partition("?")[0].rstrip("/").endswith(PATH_SUFFIX)


def token_fields(body: dict[str, Any], upstream: str) -> dict[str, Any]:
    """The fields to add to ``body`` (dotted keys for nested ones), leaving the client's own alone."""
    wanted = TOKEN_FIELDS[upstream][body.get("stream") is True]
    added: dict[str, Any] = {}
    for dotted, value in wanted.items():
        parent, _, leaf = dotted.rpartition(".")
        container = body.get(parent) if parent else body
        if (parent and container is None) or (isinstance(container, dict) and leaf not in container):
            added[dotted] = value
    if body.get("logprobs") is False:  # the client said no: top_logprobs alone would be an error
        added.pop("top_logprobs", None)
    return added


_EMPTY_REST = re.compile(rb"[ \t\r\n]*}")


def splice(raw: bytes, body: dict[str, Any], added: dict[str, Any]) -> tuple[bytes, bool]:
    """The upstream body: the client's ``raw`` JSON with ``added`` fields, and whether it is a pure addition.

    New fields are spliced in after the opening brace, so a 100 KB prompt is not re-serialised.
    A nested field inside an object the client sent (its own ``stream_options``), or a new value
    for a field it sent (a Responses ``include`` list extended), forces a full re-dump; the record
    then stores the whole upstream body.
    """
    new: dict[str, Any] = {}
    for dotted, value in added.items():
        parent, _, leaf = dotted.rpartition(".")
        if not parent and dotted not in body:
            new[dotted] = value
        elif parent and parent not in body:
            new.setdefault(parent, {})[leaf] = value
        else:
            return json.dumps(merge_fields(body, added), ensure_ascii=False).encode("utf-8"), False
    if not new:
        return raw, True
    head = json.dumps(new).encode("ascii")[1:-1]
    start = raw.index(b"{") + 1
    rest = memoryview(raw)[start:]  # a view: the body is copied once, into the result
    empty = _EMPTY_REST.match(raw, start) is not None  # the client sent {}: no comma after our fields
    return b"".join((b"{", head, b"" if empty else b",", rest)), True


def error_body(status: int, message: str, kind: str = "upstream_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
