"""Capture demo: a streamed, multi-turn, tool-calling chat through the proxy, what it recorded, and its trajectory.

    python -m eval.demo [--model DIR] [--out runs/demo]      (what `make demo` runs)

Starts the reference server (the tiny offline model, answering from a script so the chat calls
real tools) and `mitmdump` with the capture addon, both on loopback. The official `openai` SDK
then plays a harness: it streams each turn, runs the tool calls in a scratch folder and sends
the results back. At the end the demo reads the capture files and shows, per model call, the
token ids and log-probs the upstream sampled, decoded back to text; then `python -m reconstruct`
merges the calls into a training trajectory and the demo shows its loss mask.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import tyro
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from transformers import AutoTokenizer

from eval.models import build_tiny
from eval.services import Mitmdump, ReferenceServer
from reconstruct import schema

console = Console()

SESSION = "demo-session-1"
TASK = "What does notes.txt in this folder say? Count its lines too."
SCRIPT = [
    {
        "reasoning": "I should look at the folder first.",
        "content": None,
        "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
    },
    {
        "reasoning": "notes.txt is there; read it and count its lines.",
        "content": "Reading the file.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "cat notes.txt && wc -l < notes.txt"}}],
    },
    {"content": "notes.txt says the build is green and the release is on Friday; it has 2 lines.", "tool_calls": []},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the workspace and return its output.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


@dataclasses.dataclass
class Config:
    model: Path | None = None
    """A local HF model dir with a tool-aware chat template; default: build the tiny offline model."""
    out: Path = Path("runs/demo")
    """Run folder: captures/, logs."""


def run_chat(base_url: str, workspace: Path) -> int:
    """Play the harness: stream each turn, run its tool calls, send the results back. Returns turns."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=SESSION, max_retries=0, timeout=120)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use the bash tool."},
        {"role": "user", "content": TASK},
    ]
    for turn in range(1, 10):
        console.print(f"[bold]turn {turn}[/] ", end="")
        content, reasoning, calls = "", "", {}
        stream = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, stream=True, temperature=0)
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                reasoning += (delta.model_extra or {}).get("reasoning") or ""
                if delta.content:
                    content += delta.content
                    console.print(delta.content, end="", highlight=False)
                for call in delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += call.id or ""
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
        console.print()
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]
        messages.append({"role": "assistant", "content": content or None, "reasoning": reasoning or None, "tool_calls": tool_calls})
        if not tool_calls:
            return turn
        for call in tool_calls:
            command = json.loads(call["function"]["arguments"])["command"]
            done = subprocess.run(command, shell=True, cwd=workspace, capture_output=True, text=True, timeout=10)
            console.print(f"  [dim]$ {command}[/]\n  [dim]{(done.stdout + done.stderr).strip()}[/]")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout + done.stderr})
    return turn


def sampled_tokens(record: dict) -> tuple[list[int], list[int], list[float]]:
    """Prompt ids, sampled ids and their log-probs from a vLLM-shaped Chat Completions record."""
    if not record["streamed"]:
        response = json.loads(record["response_body"])
        choice = response["choices"][0]
        return response["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
    prompt, ids, logprobs = [], [], []
    for block in record["response_body"].split("\n\n"):
        if not block.startswith("data: {"):
            continue
        event = json.loads(block[6:])
        prompt = event.get("prompt_token_ids") or prompt
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            logprobs += [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
    return prompt, ids, logprobs


def show_captures(captures: Path, model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    files = sorted(captures.glob("*.jsonl"))
    records = [json.loads(line) for f in files for line in f.read_bytes().split(b"\n") if line]
    sessions = sorted({r["session_id"] for r in records})
    table = Table(title=f"{len(records)} model calls captured (sessions: {', '.join(sessions)})")
    for column in ("call", "api", "stream", "chunks", "prompt tok", "sampled tok", "logprob/tok", "1st byte", "total"):
        table.add_column(column, justify="right")
    decoded = []
    for i, r in enumerate(records, 1):
        prompt, ids, logprobs = sampled_tokens(r)
        decoded.append(tokenizer.decode(ids))
        table.add_row(
            str(i),
            r["api"],
            "yes" if r["streamed"] else "no",
            str(len(r["chunks"])),
            str(len(prompt)),
            str(len(ids)),
            f"{sum(logprobs) / max(len(logprobs), 1):.2f}",
            f"{(r['t_first_byte'] - r['t_start']) * 1000:.0f} ms",
            f"{(r['t_end'] - r['t_start']) * 1000:.0f} ms",
        )
    console.print(table)
    for i, text in enumerate(decoded, 1):
        console.print(f"[bold]call {i}[/], the sampled token ids decoded:")
        console.print(text, highlight=False, markup=False)
    first = records[0]
    console.print(f"record fields: {', '.join(first)}")
    console.print(f"injected upstream: {json.dumps(first['injected'])}")
    console.print(f"files: {', '.join(str(f) for f in files)} (format: addon/record.py)")


def show_trajectories(captures: Path, model: Path, out: Path) -> None:
    """Run the next phase as its own process, as the loop does, and show what training would see."""
    cmd = [sys.executable, "-m", "reconstruct", str(captures), "-o", str(out), "--tokenizer", str(model), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for row in schema.read(out).iter_rows(named=True):
        mask = row["loss_mask"]
        console.print(
            f"[bold]trace {row['trace_id']}[/]: {row['n_calls']} calls merged, {len(row['prompt_ids'])} prompt tokens, "
            f"{sum(mask)} trainable (sampled) + {len(mask) - sum(mask)} masked (tool results, template) response tokens"
        )
        # Trainable spans in green, masked ones dim: exactly what GRPO will and will not train on.
        spans, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                text = tokenizer.decode(row["response_ids"][start:i])
                spans.append(f"[green]{escape(text)}[/]" if mask[start] else f"[dim]{escape(text)}[/]")
                start = i
        console.print("".join(spans))
    console.print(f"trajectories: {out} (format: reconstruct/schema.py)")


def main(config: Config) -> None:
    run = config.out / time.strftime("%Y%m%d-%H%M%S")
    run.mkdir(parents=True, exist_ok=True)
    model = config.model or build_tiny(Path("models/tiny"))
    script = run / "script.json"
    script.write_text(json.dumps(SCRIPT, indent=1))
    with tempfile.TemporaryDirectory() as workspace:
        Path(workspace, "notes.txt").write_text("build: green\nrelease: Friday\n")
        with console.status("starting the reference server and mitmdump"):
            server = ReferenceServer(model, script=script, log=run / "server.log")
        with server, Mitmdump(server.url, run / "captures", log=run / "mitmdump.log") as proxy:
            console.print(f"reference server {server.url}, proxy {proxy.url} (captures: {run / 'captures'})")
            run_chat(proxy.url, Path(workspace))
    # Leaving the `with` stopped mitmdump cleanly: its writer has flushed every record.
    show_captures(run / "captures", model)
    show_trajectories(run / "captures", model, run / "trajectories.parquet")


if __name__ == "__main__":
    main(tyro.cli(Config))
