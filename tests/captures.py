"""Reading capture records in tests: what the addon wrote, and the token ids the upstream sent."""

import json
import time


def read_records(directory, *, session=None, expect=None, timeout=10.0):
    """The records under ``directory`` (of one session), oldest first; with ``expect``, wait for that many.

    A record lands just after the client has its answer: the addon writes once an exchange ends.
    """
    deadline = time.time() + timeout
    while True:
        records = [
            record
            for path in sorted(directory.glob("*.jsonl"))
            for line in path.read_bytes().split(b"\n")
            if line and (record := json.loads(line)) and session in (None, record["session_id"])
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
    logprobs = [t["logprob"] for e in events for c in e["choices"] for t in (c.get("logprobs") or {}).get("content") or []]
    return prompt, ids, logprobs
