"""An output cap beyond the upstream model's context, cut to that context before the call goes upstream.

Harnesses ask for the output cap they were built for, whatever model serves them: Qwen Code sends ``max_tokens``
32000 on every call. vLLM (0.32, measured in issue 15) refuses a cap larger than the model's whole context with a
400, whatever the prompt (``max_tokens=32000 cannot be greater than max_model_len=2048``), and the rollout dies;
a cap within the context it cuts itself to the room the prompt leaves. So the addon cuts ``max_tokens`` /
``max_completion_tokens`` of a Chat Completions body bound upstream (the client's own, or one translated from a
native API) to the model's ``max_model_len`` before sending it, and vLLM does the rest: no refusal, no second
call, the stream untouched. The record keeps both: ``request`` what the harness asked, ``upstream_request`` what
was sent, ``clamped`` the field and both values (addon/record.py).

The context length comes from the upstream's ``GET <base>/models`` (vLLM and SGLang list ``max_model_len`` per
model), asked once per upstream base the first time a capped call goes there (a blocking GET of at most
``TIMEOUT`` seconds; loopback answers in milliseconds), again after ``RETRY_AFTER`` seconds when it did not
answer. A refusal that names the length (vLLM's message above) teaches it too, for the calls after it.
Option ``polar_clamp_max_tokens`` (on by default) turns this off. Standard library only.
"""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.request
from typing import Any

CAP_FIELDS = ("max_completion_tokens", "max_tokens")  # OpenAI's newer name first: vLLM reads it first
TIMEOUT = 3.0
RETRY_AFTER = 30.0
REFUSAL = re.compile(r"cannot be greater than max_model_len=(\d+)")  # vLLM 0.32's wording for a cap too large


def cap_field(body: Any) -> str | None:
    """The output-cap field a Chat Completions body sets (as an integer), or None."""
    if not isinstance(body, dict):
        return None
    for name in CAP_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name
    return None


def models_url(url: str) -> str:
    """``…/v1/chat/completions`` → ``…/v1/models``: the list beside the chat endpoint, whatever the prefix."""
    return url.partition("?")[0].rstrip("/").removesuffix("/chat/completions") + "/models"


class ContextLengths:
    """``max_model_len`` per upstream models URL and model id, asked of the upstream once and remembered."""

    def __init__(self) -> None:
        self._lengths: dict[str, dict[str, int]] = {}
        self._asked: dict[str, float] = {}  # models URL -> when it last failed to answer

    def length(self, url: str, model: str, headers: dict[str, str], *, verify: bool) -> int | None:
        """The context length of ``model`` behind ``url`` (a models URL), or None when the upstream does not say."""
        if url not in self._lengths and time.monotonic() - self._asked.get(url, -RETRY_AFTER) >= RETRY_AFTER:
            try:
                self._lengths[url] = _ask(url, headers, verify=verify)
            except (OSError, ValueError):  # no /models, not JSON, refused: the calls go as they came
                self._asked[url] = time.monotonic()
        lengths = self._lengths.get(url, {})
        if model in lengths:
            return lengths[model]
        if len(set(lengths.values())) == 1:  # a name the list does not show (e.g. an alias): one length for all
            return next(iter(lengths.values()))
        return None

    def learn(self, url: str, model: str, refusal: str) -> None:
        """Remember the length a refusal names (vLLM's ``… cannot be greater than max_model_len=N``)."""
        if found := REFUSAL.search(refusal):
            self._lengths.setdefault(url, {})[model] = int(found.group(1))


def _ask(url: str, headers: dict[str, str], *, verify: bool) -> dict[str, int]:
    context = ssl.create_default_context()
    if not verify:  # mitmproxy's ssl_insecure: the upstream's certificate is not checked for model calls either
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),  # the upstream directly, never through an environment proxy
        urllib.request.HTTPSHandler(context=context),
    )
    with opener.open(urllib.request.Request(url, headers=headers), timeout=TIMEOUT) as response:
        listing = json.loads(response.read())
    models = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(models, list):
        raise ValueError(f"{url}: expected {{'data': [...]}}")
    return {
        m["id"]: m["max_model_len"]
        for m in models
        if isinstance(m, dict)
        and isinstance(m.get("id"), str)
        and isinstance(m.get("max_model_len"), int)
        and m["max_model_len"] > 0
    }
