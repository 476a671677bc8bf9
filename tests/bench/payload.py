"""Realistic ~100 KB coding-agent Chat Completions request bodies for the proxy benchmark.

Used by ``python -m tests.bench.proxy``; deterministic, so every run sends the same bytes.
The shape follows what Pi and Qwen Code send (stack.md section 3): a long system prompt, function
tools, user context, assistant tool calls and tool results full of source code.
"""

from __future__ import annotations

import json

__all__ = ["chat_body", "session_bodies"]

_RULES = [
    "Read the relevant files before you edit them, and keep every change minimal and focused.",
    "Never invent APIs; when unsure, search the repository with grep_search or read_file first.",
    "Run the test suite after each change and report failures verbatim, including the traceback.",
    "Prefer small pure functions with type hints; keep I/O at the edges of the program.",
    "Do not reformat code you did not change, and do not touch generated files or lock files.",
    "When a command fails, read its output carefully and fix the cause instead of retrying blindly.",
    "Explain what you changed and why in two or three sentences once the task is complete.",
    "Quote paths relative to the repository root and use forward slashes on every platform.",
]

_NAMES = ["session", "request", "record", "chunk", "flow", "buffer", "token", "message", "batch", "adapter"]


def _system_prompt(n_bytes: int) -> str:
    lines = ["You are an autonomous coding agent working in a git repository. Follow these rules:"]
    i = 0
    while sum(len(s) + 1 for s in lines) < n_bytes:
        lines.append(f"{i + 1}. {_RULES[i % len(_RULES)]} (section {i // len(_RULES) + 1})")
        i += 1
    return "\n".join(lines)


def _code(n_bytes: int, seed: int) -> str:
    """Python-looking source text: functions with docstrings, quotes, braces and indentation."""
    out: list[str] = [
        f'"""Module {seed}: helpers for the capture pipeline."""\n',
        "from __future__ import annotations\n",
    ]
    i, size = 0, 0
    while size < n_bytes:
        a, b = _NAMES[(i + seed) % len(_NAMES)], _NAMES[(3 * i + seed + 1) % len(_NAMES)]
        fn = (
            f"\n\ndef parse_{a}_{b}_{i}({a}: dict[str, object], *, limit: int = {64 + i}) -> list[str]:\n"
            f'    """Return the {b} keys of one {a}, at most ``limit`` of them."""\n'
            f"    out: list[str] = []\n"
            f"    for key, value in {a}.items():\n"
            f'        if key.startswith("{b}_") and value is not None:\n'
            f'            out.append(f"{{key}}={{value!r}}")  # "quoted" \\t tab\n'
            f"        if len(out) >= limit:\n"
            f"            break\n"
            f"    return out\n"
        )
        out.append(fn)
        size += len(fn)
        i += 1
    return "".join(out)


def _tool_call(call_id: str, name: str, args: dict[str, object]) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _tool(name: str, description: str, params: dict[str, str]) -> dict[str, object]:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


def chat_body(*, target_bytes: int = 100_000, stream: bool = False, model: str = "bench-model") -> dict[str, object]:
    """One agent turn of about ``target_bytes`` once JSON-encoded (within a few percent)."""
    unit = max(target_bytes // 20, 200)  # the budget, split across the messages below
    messages: list[dict[str, object]] = [
        {"role": "system", "content": _system_prompt(4 * unit)},
        {"role": "user", "content": "<environment>\ncwd: /repo\nos: linux\n</environment>\n" + _code(2 * unit, 1)},
        {"role": "user", "content": "Fix the bug in reconstruct/_sse.py: events split across chunks are lost."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_tool_call("call_1", "read_file", {"path": "reconstruct/_sse.py"})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": _code(5 * unit, 2)},
        {
            "role": "assistant",
            "content": "The decoder drops the tail of a chunk that ends mid-event. I will keep it buffered.",
            "tool_calls": [_tool_call("call_2", "edit", {"path": "reconstruct/_sse.py", "new": _code(2 * unit, 3)})],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "Edited reconstruct/_sse.py\n" + _code(2 * unit, 4)},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_tool_call("call_3", "run_shell_command", {"cmd": "pytest -x"})],
        },
        {
            "role": "tool",
            "tool_call_id": "call_3",
            "content": "FAILED tests/test_sse.py::test_split\n" + _code(unit, 5),
        },
    ]
    tools = [
        _tool("read_file", "Read a file from the repository.", {"path": "Path relative to the repository root."}),
        _tool("edit", "Replace a file's content.", {"path": "Path to edit.", "new": "The new content."}),
        _tool("run_shell_command", "Run a shell command in the repository.", {"cmd": "The command line."}),
    ]
    body: dict[str, object] = {"model": model, "messages": messages, "tools": tools, "max_tokens": 4096}
    # Top up the last tool result until the encoded body reaches the target.
    missing = target_bytes - len(json.dumps(body))
    if missing > 0:
        last = messages[-1]
        last["content"] = str(last["content"]) + _code(int(missing * 0.9), 6)[: int(missing * 0.9)]
    if stream:
        body["stream"] = True
    return body


def session_bodies(
    count: int, *, target_bytes: int = 100_000, stream: bool = False, extra: dict[str, object] | None = None
) -> list[bytes]:
    """``count`` encoded calls of one agent session: the same history of about ``target_bytes``, each call with its
    own last turn (a ~2 KB tool result), as an agent resends its history with every call; ``extra`` fields are
    added to each. Same sizes within a few percent."""
    base = chat_body(target_bytes=target_bytes - 2_300, stream=stream)
    history = list(base["messages"])  # type: ignore[call-overload]
    bodies = []
    for i in range(count):
        turn = [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_tool_call(f"call_{i}", "read_file", {"path": f"m{i}.py"})],
            },
            {"role": "tool", "tool_call_id": f"call_{i}", "content": _code(2_000, 100 + i)[:2_000]},
        ]
        bodies.append(json.dumps({**base, "messages": [*history, *turn], **(extra or {})}).encode())
    return bodies
