"""Token ids for calls recorded without them, rebuilt with the model's tokenizer and chat template.

A ``plain`` upstream, ``polar_translate=never`` or a closed API in front of which traffic was captured leaves
only messages. The prompt is the request's messages and tools rendered with ``add_generation_prompt=True``
(plus the request's ``chat_template_kwargs``) and encoded without added special tokens, as vLLM does; the
completion is what the template adds when the answer is appended, up to and including the end-of-turn token
(excluded when the answer was cut by ``max_tokens``: the model never sampled it). These ids are what the
server most likely saw and sampled, not what it did: they are marked ``retokenized`` and carry no log-probs.
"""

from __future__ import annotations

import json
from typing import Any

from reconstruct._errors import RetokenizeError

__all__ = ["Retokenizer", "detect_eot", "parse_eot"]

_SENTINEL = "POLARSENTINEL"


class Retokenizer:
    def __init__(self, tokenizer: Any, eot_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eot_id = eot_id if eot_id is not None else detect_eot(tokenizer)
        self.eot_text = tokenizer.decode([self.eot_id], skip_special_tokens=False) if self.eot_id is not None else None

    def render(
        self, messages: list[Any], tools: list[Any] | None, kwargs: dict[str, Any] | None, *, generation_prompt: bool
    ) -> str:
        try:
            text: str = self.tokenizer.apply_chat_template(  # tokenize=False: the rendered string
                template_messages(messages),
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **(kwargs or {}),
            )
        except Exception as e:  # jinja2 errors, template-raised exceptions, bad message shapes
            raise RetokenizeError(f"the chat template cannot render this call: {type(e).__name__}: {e}") from e
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[Any], tools: list[Any] | None, kwargs: dict[str, Any] | None) -> list[int]:
        return self.encode(self.render(messages, tools, kwargs, generation_prompt=True))

    def output_ids(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        kwargs: dict[str, Any] | None,
        answer: dict[str, Any],
        finish_reason: str | None,
    ) -> list[int]:
        prompt = self.render(messages, tools, kwargs, generation_prompt=True)
        full = self.render([*messages, answer], tools, kwargs, generation_prompt=False)
        if not full.startswith(prompt):
            raise RetokenizeError("the chat template does not render prompt + answer as an extension of the prompt")
        text = full[len(prompt) :]
        if self.eot_text and self.eot_text in text:
            end = text.index(self.eot_text)
            # A natural stop sampled the end-of-turn token; an answer cut short (or torn) did not.
            text = text[: end + len(self.eot_text)] if finish_reason not in (None, "length") else text[:end]
        return self.encode(text)


def template_messages(messages: list[Any]) -> list[Any]:
    """Messages as an inference server hands them to the template: tool-call arguments parsed from JSON text
    into objects (vLLM does this), and the reasoning under both names templates read."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            m = dict(m)
            if isinstance(m.get("tool_calls"), list):
                m["tool_calls"] = [_object_arguments(c) for c in m["tool_calls"]]
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning:
                m["reasoning"] = m["reasoning_content"] = reasoning
        out.append(m)
    return out


def _object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except json.JSONDecodeError:
            pass  # rendered verbatim, as the client sent it
    return call


def detect_eot(tokenizer: Any) -> int | None:
    """The end-of-turn token: the first special token the chat template puts after an assistant message's
    text (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma); else EOS.

    Read from the template rather than from sampled ids (Polar's caveat 4: an engine that leaves the stop token
    out of ``token_ids`` made it pick a content token)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - no template, or one that wants other roles: fall back to EOS
        text = ""
    if _SENTINEL in text:
        special = set(tokenizer.all_special_ids)
        special |= {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        tail = text[text.index(_SENTINEL) + len(_SENTINEL) :]
        for token in tokenizer.encode(tail, add_special_tokens=False):
            if token in special:
                return int(token)
    eos = tokenizer.eos_token_id
    return int(eos) if isinstance(eos, int) else None


def parse_eot(spec: str, tokenizer: Any | None) -> int:
    """``--eot-token``: a token id, or a token's text looked up in the tokenizer."""
    if spec.isdigit():
        return int(spec)
    if tokenizer is None:
        raise RetokenizeError(f"--eot-token {spec!r} is a token's text: give its id, or --tokenizer to look it up")
    token = tokenizer.convert_tokens_to_ids(spec)
    if not isinstance(token, int) or token == tokenizer.unk_token_id:
        raise RetokenizeError(f"--eot-token {spec!r} is not a token of this tokenizer")
    return token
