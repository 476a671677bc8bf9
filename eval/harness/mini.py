"""The ``mini`` harness: a small bash-tool agent over the official ``openai`` SDK, for CPU demos and tests.

    python -m eval mini --base-url http://127.0.0.1:8080/v1 --api-key SESSION --model tiny \\
        --workspace /tmp/ws --prompt-file issue.txt [--max-steps 30] [--command-timeout 60]

It streams Chat Completions with one function tool, ``bash``, runs each call's command in the workspace
(``bash -c``, its own process group, killed at the timeout) and sends back the exit code and the output
(head and tail kept when long). It stops when the model answers without a tool call, or after ``--max-steps``
model calls. ``python -m eval rollout --harness mini`` starts it as a subprocess like any other harness, so a
crash or a hang costs one session only. Exit status: 0 when it stopped (answered or ran out of steps), 1 when
a model call failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import openai
import tyro
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

__all__ = ["TOOLS", "Args", "main", "run_command"]

# The same text for every session (the workspace is the commands' working directory, not named here), so a
# server with prefix caching computes it once for all of them.
SYSTEM_PROMPT = """You are an autonomous software engineer working in a git repository, the current directory.
Fix the issue the user describes by editing the repository's source files. Use the bash tool to explore the
code, make edits (for example with sed, a heredoc, or `git apply`) and run commands. Do not edit the tests.
When the fix is done, reply with a short summary and no tool call: that ends the session."""

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the repository; returns its exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "The command line to run."}},
                "required": ["command"],
            },
        },
    }
]


@dataclasses.dataclass
class Args:
    """One agent run on one prompt."""

    # ---- where the model is
    base_url: str
    """OpenAI-compatible base URL, with /v1 (the proxy)."""
    api_key: str
    """API key: the session id under the proxy."""
    model: str
    """Model name sent with every call."""
    # ---- the task
    workspace: Path
    """Folder the commands run in (the task's git checkout)."""
    prompt_file: Path
    """The task, as the user message."""
    # ---- limits
    max_steps: int = 30
    """Model calls at most; the agent stops after the last one whatever it answered."""
    command_timeout: float = 60.0
    """Seconds before a bash command and its children are killed."""
    max_output: int = 10_000
    """Characters of command output sent back to the model; the middle of longer output is cut."""
    max_tokens: int | None = None
    """Output tokens per model call; default: the server's."""
    request_timeout: float = 600.0
    """Seconds to wait for one model call."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        if not self.workspace.is_dir():
            raise ValueError(f"--workspace {self.workspace} is not a folder")


def run_command(command: str, cwd: Path, timeout: float, max_output: int) -> str:
    """Run ``command`` with bash in ``cwd``; the tool result the model sees: exit code, then output."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = f"exit code: {proc.returncode}"
    except subprocess.TimeoutExpired:
        # The whole group: a command's background children would otherwise keep the pipe open forever. (Not
        # eval.sessions.procs.stop_tree: this file runs as a script, `python -P mini.py`, with only the stdlib and
        # openai.)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = f"killed after {timeout:g} s (timeout)"
    text = out.decode(errors="replace")
    if len(text) > max_output:
        half = max_output // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return f"{status}\n{text}"


def stream_turn(client: openai.OpenAI, args: Args, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed model call; returns the assistant message, reasoning kept so the next prompt re-renders it."""
    content, reasoning = "", ""
    calls: dict[int, dict[str, str]] = {}  # tool call index -> its id, name and arguments, joined from the deltas
    stream = client.chat.completions.create(
        model=args.model,
        # The SDK's message types, plus the "reasoning" field vLLM-style servers read back on assistant turns.
        messages=cast("list[ChatCompletionMessageParam]", messages),
        tools=TOOLS,
        stream=True,
        max_tokens=openai.omit if args.max_tokens is None else args.max_tokens,
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            # vLLM-style servers send reasoning as an extra delta field the SDK does not model.
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.id or ""
                slot["name"] += (call.function and call.function.name) or ""
                slot["arguments"] += (call.function and call.function.arguments) or ""
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def tool_result(call: dict[str, Any], args: Args) -> str:
    """What the model gets back for one tool call; a malformed call gets an error it can correct."""
    name, raw = call["function"]["name"], call["function"]["arguments"]
    if name != "bash":
        return f"error: unknown tool {name!r}; the only tool is bash"
    try:
        command = json.loads(raw or "{}").get("command")
    except (json.JSONDecodeError, AttributeError):
        return f"error: the arguments are not a JSON object: {raw!r}"
    if not isinstance(command, str):
        return 'error: bash needs {"command": "..."}'
    print(f"$ {command}", flush=True)
    result = run_command(command, args.workspace, args.command_timeout, args.max_output)
    print(result.split("\n", 1)[0], flush=True)
    return result


def main(args: Args) -> int:
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2, timeout=args.request_timeout)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": args.prompt_file.read_text()},
    ]
    for step in range(1, args.max_steps + 1):
        try:
            message = stream_turn(client, args, messages)
        except openai.OpenAIError as e:
            print(f"mini: model call {step} failed: {e}", file=sys.stderr)
            return 1
        messages.append(message)
        if not message.get("tool_calls"):
            print(message["content"] or "", flush=True)
            return 0
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(call, args)})
    print(f"mini: stopped after {args.max_steps} model calls without a final answer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
