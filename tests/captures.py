"""Capture helpers for tests: a scripted proxy, the records the addon wrote, the token ids the upstream sent."""

import contextlib
import json
import time

from addon import record_v2
from eval.sessions.procs import Mitmdump, ReferenceServer


@contextlib.contextmanager
def scripted_proxy(model_dir, script, tmp, **addon_options):
    """The reference server replaying ``script`` (per session) behind a real mitmdump + addon.

    Yields the proxy; its ``captures`` attribute is the folder the records go to.
    """
    (tmp / "script.json").write_text(json.dumps(script))
    with (
        ReferenceServer(model_dir, script=tmp / "script.json", log=tmp / "server.log") as server,
        Mitmdump(server.url, tmp / "captures", log=tmp / "mitmdump.log", **addon_options) as mitm,
    ):
        mitm.captures = tmp / "captures"
        yield mitm


def v1_lines(directory):
    """Every whole record line under ``directory`` as the v1 line it stands for (a v2 record expanded, see
    addon/record_v2.py), file by file: what a test reads fields or searches bytes in."""
    return [
        line
        for path in sorted(directory.glob("*.jsonl"))
        for line in record_v2.expand_lines(line for line in path.read_bytes().split(b"\n")[:-1] if line)
    ]


def session_lines(directory, session):
    """A session's record lines as they are (v1; a v2 record expanded), in file order: what a test copies into a
    capture of its own (re-serialised records would fail their checksum)."""
    return [line for line in v1_lines(directory) if json.loads(line)["session_id"] == session]


def v1_bytes(directory):
    """All of ``directory``'s records as v1 lines, joined: a secret searched here is searched in every body."""
    return b"\n".join(v1_lines(directory))


def read_records(directory, *, session=None, expect=None, timeout=10.0):
    """The records under ``directory`` (of one session), oldest first; with ``expect``, wait for that many.

    A record lands just after the client has its answer: the addon writes once an exchange ends.
    """
    deadline = time.time() + timeout
    while True:
        # After the last newline: a record still being written.
        records = [
            record for line in v1_lines(directory) if session in (None, (record := json.loads(line))["session_id"])
        ]
        if expect is None or len(records) >= expect or time.time() > deadline:
            return sorted(records, key=lambda r: r["t_start"])


def sse_events(text):
    return [json.loads(block[6:]) for block in text.split("\n\n") if block.startswith("data: {")]


def tokens_of(record):
    """(prompt ids, sampled ids, their log-probs) from the upstream's vLLM-shaped Chat Completions answer."""
    if not record["streamed"]:
        response = json.loads(record["response_body"])
        choice = response["choices"][0]
        return response["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
    events = sse_events(record["response_body"])
    prompt = events[0]["prompt_token_ids"]
    ids = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
    logprobs = [
        t["logprob"] for e in events for c in e["choices"] for t in (c.get("logprobs") or {}).get("content") or []
    ]
    return prompt, ids, logprobs
