"""Which requests the upstream decodes under a constraint, so that their sampled tokens are not the policy's own.

vLLM enforces ``tool_choice: "required"`` or a named tool, a ``response_format`` with a JSON schema (or
``json_object``), and its own structured-output fields by masking the logits before sampling: a forced token then
comes back with log-prob 0.0 where the model gives it -5.4 (issue 15), and importance weights built on those
numbers would be wrong. The addon lists the constraints of the body it sent upstream in each record
(``constrained``, addon/record.py); reconstruction drops such calls' log-probs so the trainer recomputes them
(docs/reconstruction.md). Standard library only.
"""

from __future__ import annotations

from typing import Any

# vLLM's structured-output request fields: the current one, and the guided_* ones of earlier releases.
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_FREE_TOOL_CHOICES = (None, "auto", "none")
_SCHEMA_FORMATS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")


def constraints(body: Any) -> list[str]:
    """The fields of a Chat Completions (or vLLM Responses) request body that constrain decoding; [] when none."""
    if not isinstance(body, dict):
        return []
    found = []
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # a named tool; Responses' allowed_tools forces only in mode "required"
        kind = choice.get("type")
        forced = choice.get("mode") == "required" if kind == "allowed_tools" else kind not in ("auto", "none")
        if forced:
            found.append("tool_choice")
    elif choice not in _FREE_TOOL_CHOICES and body.get("tools"):  # "required" (vLLM ignores it without tools)
        found.append("tool_choice")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in _SCHEMA_FORMATS:
        found.append("response_format")
    text = body.get("text")  # the Responses API's response_format
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") in _SCHEMA_FORMATS:
        found.append("text.format")
    found += [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    return found
