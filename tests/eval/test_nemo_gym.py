"""The NeMo Gym agent folder (eval/nemo_gym): its files follow Gym's conventions, every committed example rollout
survives a token round trip, NeMo RL's contiguity rule and the documented /run shapes, Gym's own models accept it
where nemo-gym installs, and the masking rules flag what NeMo RL must not train on.

Gym's models run in nemo-gym 0.7.0 on Python 3.13, in the root filesystem ``python -m eval.nemo_gym.gym_root``
builds (tests/.cache/gymvenv/bin/python runs it; tests/gym/helpers.py). Without it the Gym-model test is skipped,
saying how to make it, except in make test-gym, where that is a failure; the documented-shape test always runs.
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest
import yaml
from transformers import AutoTokenizer

from tests.gym.helpers import require_gym_python

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "eval" / "nemo_gym" / "responses_api_agents" / "polar_swe_agent"
DATA = AGENT / "data"
TRIPLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")

sys.path.insert(0, str(AGENT))
from polar_gym import (  # noqa: E402
    FAILURE_KINDS,
    MASK_REASONS,
    RUNTIMES,
    calls_of,
    check_runtime,
    contiguity_errors,
    submission,
    verify_response,
)

sys.path.remove(str(AGENT))


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


ROWS, ROLLOUTS = jsonl(DATA / "example.jsonl"), jsonl(DATA / "example_rollouts.jsonl")


# ---- Gym's documented shapes (reference nemo-gym.md §1): the fields /run must return, mirrored, extra keys allowed.
class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    type: Literal["message", "function_call", "function_call_output", "reasoning"]
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class Response(pydantic.BaseModel):
    id: str
    created_at: float
    model: str
    object: Literal["response"]
    output: list[Item]
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[dict[str, Any]]


class CreateParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # Gym validates these strictly
    input: str | list[dict[str, Any]]
    metadata: dict[str, str] | None = None
    model: str | None = None


class InstanceConfig(pydantic.BaseModel):
    mask_sample: bool


class VerifyResponse(pydantic.BaseModel):
    responses_create_params: CreateParams
    response: Response
    reward: float
    mask_sample: bool  # Gym 0.7's BaseVerifyResponse field (default False: a sample Gym trains on)
    failure_kind: str | None
    failure_reason: str | None
    instance_config: InstanceConfig  # for Gym before 0.7


def test_folder_follows_gym_conventions():
    config = yaml.safe_load((AGENT / "configs" / "polar_swe_agent.yaml").read_text())
    agent = config["polar_swe_agent"]["responses_api_agents"]["polar_swe_agent"]  # instance → type → implementation
    assert (AGENT / agent["entrypoint"]).is_file() and agent["domain"] == "coding"
    assert agent["service_url"] == "???"  # required: Gym refuses to start without it
    assert [d["type"] for d in agent["datasets"]] == ["example"]
    assert (ROOT / "eval" / "nemo_gym" / agent["datasets"][0]["jsonl_fpath"]).is_file()
    assert (AGENT / "requirements.txt").is_file() and not (AGENT / "pyproject.toml").exists()
    # Gym 0.7 reaches an agent only through an environment server; one names this agent (strict mode accepts it).
    relays = [v["environment_servers"]["legacy_agent"] for v in config.values() if "environment_servers" in v]
    assert [(r["entrypoint"], r["agent_server"]) for r in relays] == [
        ("app.py", {"type": "responses_api_agents", "name": "polar_swe_agent"})
    ]
    assert len(ROWS) >= 5 and len(ROLLOUTS) == len(ROWS)
    for row, rollout in zip(ROWS, ROLLOUTS, strict=True):
        CreateParams.model_validate(row["responses_create_params"])
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "polar_swe_agent"}
        assert rollout["responses_create_params"]["metadata"]["instance_id"] == row["instance"]["instance_id"]


def test_example_rollouts_have_the_documented_shape_and_real_rewards():
    for rollout in ROLLOUTS:
        VerifyResponse.model_validate(rollout)
        for item in rollout["response"]["output"]:
            present = [item.get(k) is not None for k in TRIPLE]
            assert all(present) or not any(present), item  # atomic triple
        assert rollout["mask_sample"] is False, rollout["polar"]["mask_reasons"]
        assert rollout["instance_config"]["mask_sample"] is False and rollout["failure_kind"] is None
    assert [r["reward"] for r in ROLLOUTS] == [1.0, 1.0, 1.0, 0.0, 0.0]  # the swebench verdicts, not a constant
    assert [r["resolved"] for r in ROLLOUTS] == [True, True, True, False, False]


def test_example_rollouts_round_trip_their_tokens(tiny_model_dir):
    meta = json.loads((DATA / "example_rollouts.meta.json").read_text())
    # The tokenizer decodes the ids; the chat template rendered the prompts (a file tokenizer.json does not cover).
    # A change to either means the examples are stale: make them again (python -m eval.nemo_gym.make_examples).
    assert hashlib.sha256((tiny_model_dir / "tokenizer.json").read_bytes()).hexdigest() == meta["tokenizer_sha256"]
    template = (tiny_model_dir / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(template).hexdigest() == meta["chat_template_sha256"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for rollout in ROLLOUTS:
        output = rollout["response"]["output"]
        assert contiguity_errors(output) == []
        seen: list[int] = []
        call_items: list[dict[str, Any]] = []  # the items of the current model call
        for item in output:
            if item["type"] == "function_call_output":
                continue
            call_items.append(item)
            if "generation_token_ids" not in item:
                continue
            prompt, generation, logprobs = (item[k] for k in TRIPLE)
            assert prompt[: len(seen)] == seen  # each call's prompt starts with everything before it
            assert len(logprobs) == len(generation) and all(lp <= 0 for lp in logprobs)
            text = tokenizer.decode(generation, skip_special_tokens=False)
            for part in call_items:  # the generation decodes to what the call emitted, item by item
                if part["type"] == "reasoning":
                    assert part["summary"][0]["text"] in text
                elif part["type"] == "message":
                    assert part["content"][0]["text"] in text
                else:
                    blocks = [json.loads(b) for b in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)]
                    assert {"name": part["name"], "arguments": json.loads(part["arguments"])} in blocks
            seen, call_items = prompt + generation, []
        assert not call_items  # every call's items ended with the one carrying its tokens


def trace(prompt, pieces, *, n_calls=None, chain_index=0):
    """A trace from (ids, sampled?) pieces, with one assistant message per sampled piece."""
    response = [i for ids, _ in pieces for i in ids]
    mask = [int(sampled) for ids, sampled in pieces for _ in ids]
    n = sum(sampled for _, sampled in pieces)
    messages = [{"role": "user", "content": "fix"}]
    for k in range(n):
        messages.append({"role": "assistant", "content": f"turn {k}"})
        if k < n - 1:
            messages.append({"role": "tool", "tool_call_id": "c", "content": "ok"})
    return {
        "trace_id": f"s/{chain_index}",
        "chain_index": chain_index,
        "n_calls": n_calls or n,
        "token_source": "captured",
        "prompt_ids": prompt,
        "response_ids": response,
        "loss_mask": mask,
        "logprobs": [-0.5 * m for m in mask],
        "messages": {"messages": messages, "tools": None},
    }


def results(traces, **session):
    base = {
        "session_id": "s",
        "status": "ok",
        "reward": 1.0,
        "resolved": True,
        "reason": "graded",
        "patch": "diff",
        "calls": sum(t["n_calls"] for t in traces),
        "incomplete_calls": 0,
        "traces": traces,
    }
    return {"job_id": "j", "status": "done", "sessions": [base | session]}


def test_calls_split_on_loss_mask_runs():
    t = trace([1, 2], [([3, 4], True), ([5], False), ([6], True)])
    assert calls_of(t) == [([1, 2], [3, 4], [-0.5, -0.5]), ([1, 2, 3, 4, 5], [6], [-0.5])]


@pytest.mark.parametrize(
    ("traces", "session", "reasons"),
    [
        ([trace([1], [([2], True), ([3], False), ([4], True)])], {}, []),
        (
            [trace([1], [([2], True), ([3], False), ([4], True)]), trace([9], [([8], True)], chain_index=1)],
            {},
            ["several_chains"],
        ),
        ([trace([1], [([2], True)])], {"incomplete_calls": 1}, ["incomplete_capture"]),
        ([trace([1], [([2], True)])], {"calls": 2}, ["incomplete_capture"]),
        ([trace([1], [([2], True)])], {"status": "timeout"}, ["timeout"]),
        ([trace([1], [([2], True)])], {"reason": "eval_error", "reward": 0.0}, ["grade_failed"]),
        ([trace([1], [([2, 3], True)], n_calls=2)], {"calls": 2}, ["call_split"]),  # two calls with no tokens between
        ([trace([1], [([2], True)]) | {"logprobs": None}], {}, ["no_logprobs"]),
        ([], {"calls": 0}, ["no_trace"]),
    ],
)
def test_mask_sample_flags_what_nemo_rl_must_not_train_on(traces, session, reasons):
    answer = verify_response({"responses_create_params": {"input": []}}, results(traces, **session), model="m")
    assert answer["polar"]["mask_reasons"] == reasons and set(reasons) <= set(MASK_REASONS)
    assert answer["mask_sample"] is answer["instance_config"]["mask_sample"] is bool(reasons)
    assert answer["failure_kind"] == (FAILURE_KINDS[reasons[0]] if reasons else None)
    assert answer["failure_reason"] == ("; ".join(f"{r}: {MASK_REASONS[r]}" for r in reasons) or None)
    assert answer["reward"] == session.get("reward", 1.0)


def test_failure_kinds_are_in_gyms_vocabulary():
    """Gym 0.7 warns about a failure_kind outside nemo_gym/failure_kinds.py unless it is "<server>:<kind>"."""
    assert set(FAILURE_KINDS) == set(MASK_REASONS)
    gym_names = {"agent_run_error", "agent_timeout", "verifier_error"}  # FAILURE_KINDS there
    for kind in FAILURE_KINDS.values():
        assert kind in gym_names or re.fullmatch(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*", kind), kind


def test_contiguity_errors_name_the_broken_item():
    good = {"type": "message", "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-1.0]}
    rerendered = good | {"prompt_token_ids": [1, 7, 3]}  # does not start with 1, 2
    assert contiguity_errors([good, rerendered]) == [
        "output[1]: prompt_token_ids do not start with the 2 tokens seen before"
    ]
    assert contiguity_errors([good | {"generation_log_probs": None}])[0].startswith(
        "output[0]: prompt_token_ids, generation"
    )
    assert contiguity_errors([good | {"generation_log_probs": [-1.0, -2.0]}]) == [
        "output[0]: 2 generation_log_probs for 1 generation ids"
    ]


@pytest.mark.slow
def test_gym_models_accept_the_rows_and_rollouts():
    python = require_gym_python()  # not made here: make test-gym builds it (about 2 minutes, as root)
    done = subprocess.run([python, "check_gym.py"], cwd=AGENT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"rows": len(ROWS), "rollouts": len(ROLLOUTS)}


@pytest.mark.slow
def test_make_examples_refuses_a_folder_that_holds_examples_before_making_any(tmp_path):
    """Issue 37: regenerating onto examples already there is refused (exit 2, naming the file), not a silent
    replacement; the refusal comes before the minute of work, and the folder is left as it was."""
    (tmp_path / "example_rollouts.jsonl").write_text("an earlier rollout\n")
    cli = [sys.executable, "-m", "eval.nemo_gym.make_examples", "--out", str(tmp_path)]
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{tmp_path / 'example_rollouts.jsonl'} exists" in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["example_rollouts.jsonl"]
    assert (tmp_path / "example_rollouts.jsonl").read_text() == "an earlier rollout\n"


# ---- runtime: where the service runs the agent's sessions (eval/sessions/runtime.py), set in the agent's config


def test_the_agent_forwards_its_runtime_to_the_service_and_on_to_the_rollout(tmp_path):
    """The config's ``runtime`` goes into the job body; the service passes it to ``eval rollout --runtime`` (and a
    docker job's grade to ``--runner docker``); null leaves it to the service's own --runtime."""
    from eval.service.app import Args, parse_submission, rollout_command, score_command
    from eval.sessions.runtime import RUNTIMES as POLAR_RUNTIMES

    assert tuple(POLAR_RUNTIMES) == RUNTIMES  # the agent's copy of the names (it runs in Gym's venv, not ours)
    config = yaml.safe_load((AGENT / "configs" / "polar_swe_agent.yaml").read_text())
    assert config["polar_swe_agent"]["responses_api_agents"]["polar_swe_agent"]["runtime"] is None
    row = ROWS[0]
    service = Args(proxy="http://127.0.0.1:8080", captures=tmp_path, runtime="local")
    for runtime, ran, runner in (("docker", "docker", "docker"), ("local", "local", "local"), (None, "local", "local")):
        body = submission(row, harness="mini", model="tiny", timeout=60.0, runtime=runtime)
        assert body.get("runtime") == runtime and ("runtime" in body) == (runtime is not None)
        _, params = parse_submission(body, service.runtime)
        rollout, score = rollout_command(service, tmp_path, params), score_command(service, tmp_path, params)
        assert rollout[rollout.index("--runtime") + 1] == ran and score[score.index("--runner") + 1] == runner
    assert parse_submission(submission(row, harness="mini", model="tiny", timeout=60.0), "docker")[1]["runtime"] == (
        "docker"
    )  # null: the service's --runtime


def test_the_agent_refuses_an_unknown_runtime():
    for bad in ("podman", "Docker", ""):
        with pytest.raises(ValueError, match=re.escape(f"runtime: {bad!r} is not one of ['local', 'docker']")):
            check_runtime(bad)
        with pytest.raises(ValueError, match="is not one of"):
            submission(ROWS[0], harness="mini", model="tiny", timeout=60.0, runtime=bad)
    assert [check_runtime(r) for r in (None, "local", "docker")] == [None, "local", "docker"]
    # app.py's config checks the field with the same function, so Gym stops at start on a bad one.
    app = (AGENT / "app.py").read_text()
    assert '@field_validator("runtime")' in app and "return check_runtime(runtime)" in app
    assert "runtime=config.runtime" in app
