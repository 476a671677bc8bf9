"""Polar rollouts for NeMo Gym: submit a dataset row to the rollout service, turn its result into Gym's /run answer.

    from polar_gym import ServiceClient, submission, verify_response
    client = ServiceClient("http://127.0.0.1:8090", token=None)
    results = client.run(submission(row, harness="mini", model="tiny", timeout=1800.0, runtime="docker"),
                         deadline_s=3600.0)
    answer = verify_response(row, results, model="tiny")      # Gym's BaseVerifyResponse, as a dict

Standard library only: it runs in the virtualenv Gym makes for this agent (app.py) and in polar-rl's tests. The
service (``python -m eval serve-rollouts``) runs the harness through the capture proxy, grades the patch with
swebench and rebuilds token traces; this module only reshapes what it returns:

- the main chain (the trace with the most calls) becomes Responses-API output items, call by call: reasoning,
  message and function_call items, the call's ``prompt_token_ids`` / ``generation_token_ids`` /
  ``generation_log_probs`` on its last item only, then a ``function_call_output`` per tool result;
- a call's generation is one maximal run of loss-mask 1s of the trace, and its prompt the trace's prompt plus
  every response token before that run (reconstruct/_merge.py: ``response_ids`` is a1 ‖ u1 ‖ a2 ‖ …);
- ``reward`` is the swebench reward; ``mask_sample`` (Gym 0.7's BaseVerifyResponse field, and
  ``instance_config.mask_sample`` for readers older than 0.7) is true, with the reasons in ``polar.mask_reasons``,
  whenever NeMo RL should not train on the sample (MASK_REASONS); ``failure_kind`` then names the first reason in
  Gym's vocabulary (FAILURE_KINDS: Gym's own name where one fits, else ``polar:<reason>``) and ``failure_reason``
  says all of them.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = [
    "FAILURE_KINDS",
    "MASK_REASONS",
    "RUNTIMES",
    "ServiceClient",
    "ServiceError",
    "calls_of",
    "check_runtime",
    "contiguity_errors",
    "submission",
    "verify_response",
]

MASK_REASONS = {
    "job_failed": "the rollout phase failed: no session to train on",
    "no_trace": "nothing of the session was captured with token ids",
    "several_chains": "several chains (sub-agent, compaction, re-rendered turn): only the main one is sent",
    "incomplete_capture": "a model call is missing from the traces, broke off, or failed upstream",
    "timeout": "the harness was killed at its timeout",
    "grade_failed": "grading did not give a verdict (eval_error)",
    "no_logprobs": "the main chain has no sampling log-probs (retokenized calls)",
    "call_split": "the main chain's loss mask or messages do not split into its calls",
    "non_contiguous": "a call's prompt does not start with everything before it",
}
# Each mask reason as Gym 0.7's failure_kind (nemo_gym/failure_kinds.py): its shared name where one means the same,
# else an environment's own "<server>:<kind>", which Gym accepts without a warning.
FAILURE_KINDS = {
    "job_failed": "agent_run_error",
    "timeout": "agent_timeout",
    "grade_failed": "verifier_error",
} | {reason: f"polar:{reason}" for reason in MASK_REASONS if reason not in ("job_failed", "timeout", "grade_failed")}
FINISHED = ("done", "failed", "cancelled")
# Where the service runs a session (polar-rl's eval/sessions/runtime.py RUNTIMES; a test keeps the two the same): local
# on the service's machine, unsandboxed; docker in the task's own container, no network but its proxy.
RUNTIMES = ("local", "docker")
TRIPLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class ServiceError(RuntimeError):
    """The rollout service refused a request or did not finish in time; the message says which and why."""


class ServiceClient:
    """The rollout service's HTTP API (eval/service/app.py), blocking, over urllib."""

    def __init__(self, url: str, *, token: str | None = None, poll_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.poll_s = poll_s

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as e:
            raise ServiceError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e

    def run(self, body: dict[str, Any], *, deadline_s: float) -> dict[str, Any]:
        """Submit one job, wait until it finishes, return its results with traces; cancel it past ``deadline_s``."""
        job_id = self.request("POST", "/v1/jobs", body)["job_id"]
        deadline = time.monotonic() + deadline_s
        while self.request("GET", f"/v1/jobs/{job_id}")["status"] not in FINISHED:
            if time.monotonic() > deadline:
                self.request("POST", f"/v1/jobs/{job_id}/cancel")
                raise ServiceError(f"job {job_id} did not finish in {deadline_s:g} s: cancelled")
            time.sleep(self.poll_s)
        return self.request("GET", f"/v1/jobs/{job_id}/results?traces=1")


def check_runtime(runtime: str | None) -> str | None:
    """``runtime`` if the service knows it (None: the service's own --runtime); ValueError naming the choices."""
    if runtime is not None and runtime not in RUNTIMES:
        raise ValueError(f"runtime: {runtime!r} is not one of {list(RUNTIMES)} (or null: the service's --runtime)")
    return runtime


def submission(
    row: dict[str, Any], *, harness: str, model: str, timeout: float, runtime: str | None = None
) -> dict[str, Any]:
    """The service's job body for one Gym dataset row: its ``instance`` (or ``instance_id`` and ``tasks``), one
    sample; ``responses_create_params.metadata.harness`` and ``.model`` override the agent's config. ``runtime``
    is where the service runs the session (RUNTIMES); None leaves it to the service's --runtime."""
    params = row.get("responses_create_params") or {}
    metadata = params.get("metadata") or {}
    body: dict[str, Any] = {
        "harness": metadata.get("harness", harness),
        "model": params.get("model") or model,
        "samples": 1,
        "timeout": timeout,
        "metadata": {k: row[k] for k in ("_ng_task_index", "_ng_rollout_index") if k in row},
    }
    if check_runtime(runtime) is not None:
        body["runtime"] = runtime
    if "instance" in row:
        body["instance"] = row["instance"]
    elif "instance_id" in row:
        body |= {"instance_id": row["instance_id"], "tasks": row.get("tasks", "toy")}
    else:
        raise ValueError('a Polar dataset row needs "instance" (a SWE-bench instance) or "instance_id"')
    return body


def calls_of(trace: dict[str, Any]) -> list[tuple[list[int], list[int], list[float] | None]]:
    """(prompt ids, generation ids, their log-probs) per model call of a trace, from its loss-mask runs."""
    prompt, response, mask, logprobs = trace["prompt_ids"], trace["response_ids"], trace["loss_mask"], trace["logprobs"]
    calls, start = [], None
    for i, m in enumerate([*mask, 0]):  # the sentinel 0 closes a run that reaches the end
        if m == 1 and start is None:
            start = i
        elif m != 1 and start is not None:
            calls.append((prompt + response[:start], response[start:i], logprobs[start:i] if logprobs else None))
            start = None
    return calls


def _text(content: Any) -> str:
    if isinstance(content, list):  # Chat Completions content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _items_of_call(n: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        summary = [{"type": "summary_text", "text": message["reasoning"]}]
        items.append({"type": "reasoning", "id": f"rs_{n}", "summary": summary})
    calls = message.get("tool_calls") or []
    if _text(message.get("content")) or not calls:  # a call that said nothing still needs an item for its tokens
        content = [{"type": "output_text", "text": _text(message.get("content")), "annotations": []}]
        items.append(
            {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed", "content": content}
        )
    for k, call in enumerate(calls):
        arguments = call["function"]["arguments"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{n}_{k}",
                "call_id": call.get("id") or f"call_{n}_{k}",
                "name": call["function"]["name"],
                "status": "completed",
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            }
        )
    return items


def output_items(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The trace as Responses output items, and whether its calls lined up with its messages and mask runs."""
    calls = calls_of(trace)
    conversation = trace["messages"]["messages"]
    assistant_at = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
    assistant_at = assistant_at[-len(calls) :] if calls else []  # a chain may start after earlier assistant turns
    if len(calls) != trace["n_calls"] or len(assistant_at) != len(calls):
        return [], False
    items: list[dict[str, Any]] = []
    for n, ((prompt, generation, logprobs), at) in enumerate(zip(calls, assistant_at, strict=True)):
        call_items = _items_of_call(n, conversation[at])
        call_items[-1] |= dict(zip(TRIPLE, (prompt, generation, logprobs), strict=True))
        items += call_items
        for message in conversation[at + 1 : assistant_at[n + 1] if n + 1 < len(calls) else None]:
            if message.get("role") == "tool":  # other messages between calls are in the next prompt's ids only
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": message.get("tool_call_id") or "",
                        "output": _text(message.get("content")),
                    }
                )
    return items, True


def contiguity_errors(output: list[dict[str, Any]]) -> list[str]:
    """Why NeMo RL would reject these items: a partial token triple, a log-prob count that is not the id count,
    NaN log-probs, a prompt that does not start with every earlier prompt and generation, no trainable item."""
    errors: list[str] = []
    seen: list[int] = []
    trainable = 0
    for i, item in enumerate(output):
        present = [item.get(k) is not None for k in TRIPLE]
        if any(present) and not all(present):
            errors.append(f"output[{i}]: {', '.join(TRIPLE)} must come together")
            continue
        if not item.get("generation_token_ids"):
            continue
        trainable += 1
        prompt, generation, logprobs = (item[k] for k in TRIPLE)
        if len(logprobs) != len(generation):
            errors.append(f"output[{i}]: {len(logprobs)} generation_log_probs for {len(generation)} generation ids")
        if any(lp != lp for lp in logprobs):
            errors.append(f"output[{i}]: NaN in generation_log_probs")
        if prompt[: len(seen)] != seen:
            errors.append(f"output[{i}]: prompt_token_ids do not start with the {len(seen)} tokens seen before")
        seen = prompt + generation
    if not trainable:
        errors.append("no output item carries generation_token_ids")
    return errors


def verify_response(row: dict[str, Any], results: dict[str, Any], *, model: str) -> dict[str, Any]:
    """Gym's verify response for a one-sample job's results (``GET /v1/jobs/<id>/results?traces=1``)."""
    sessions = results.get("sessions") or []
    session = sessions[0] if sessions else {}
    reasons: list[str] = [] if results["status"] == "done" and session else ["job_failed"]
    traces = session.get("traces") or []
    main = max(traces, key=lambda t: (t["n_calls"], -t["chain_index"])) if traces else None
    output: list[dict[str, Any]] = []
    if main is None:
        reasons.append("no_trace")
    else:
        output, lined_up = output_items(main)
        reasons += ["several_chains"] if len(traces) > 1 else []
        in_traces = sum(t["n_calls"] for t in traces)
        missing = session.get("incomplete_calls") or session.get("calls") != in_traces
        reasons += ["incomplete_capture"] if missing else []
        reasons += ["no_logprobs"] if main["logprobs"] is None else []
        reasons += [] if lined_up else ["call_split"]
        reasons += ["non_contiguous"] if lined_up and main["logprobs"] is not None and contiguity_errors(output) else []
    reasons += ["timeout"] if session.get("status") == "timeout" else []
    reasons += ["grade_failed"] if session.get("reason") == "eval_error" or session.get("grade_error") else []
    params = row.get("responses_create_params") or {}
    error = results.get("error") or session.get("error")
    failure = "; ".join(f"{r}: {MASK_REASONS[r]}" for r in reasons) + (f" ({error})" if reasons and error else "")
    response = {
        "id": f"resp_{session.get('session_id') or results['job_id']}",
        "created_at": int(time.time()),
        "model": params.get("model") or model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    return {
        "responses_create_params": params,
        "response": response,
        "reward": float(session.get("reward") or 0.0),
        "resolved": bool(session.get("resolved")),
        "model_patch": session.get("patch") or "",
        "mask_sample": bool(reasons),  # Gym >= 0.7 reads this one
        "failure_kind": FAILURE_KINDS[reasons[0]] if reasons else None,
        "failure_reason": failure or None,
        "instance_config": {"mask_sample": bool(reasons)},  # and readers before 0.7 this one
        "polar": {
            "job_id": results["job_id"],
            "session_id": session.get("session_id"),
            "status": session.get("status"),
            "reason": session.get("reason"),
            "mask_reasons": reasons,
            "n_traces": len(traces),
            "main_trace": main["trace_id"] if main else None,
            "trajectories": results.get("trajectories"),
            "error": error,
        },
    }
