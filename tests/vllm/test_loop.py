"""The loop's other phases on real vLLM's captures: a harness rolled out through the proxy, ``python -m reconstruct``
and its audit, and an adapter from train/grpo.py hot-loaded into vLLM and served through the proxy."""

import json
import subprocess
import sys

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from eval.runs import read_sessions
from eval.sessions import rollout
from eval.sessions.procs import ROOT
from eval.tasks.load import load_tasks
from reconstruct import audit, schema, score_trace
from tests.captures import session_lines
from tests.train.helpers import groups, write
from tests.vllm.conftest import MODEL_DIR
from tests.vllm.helpers import SERVED_NAME, openai_client, read_records, tokens_of
from train import grpo

# PEFT's and transformers' advice on loading and deprecations: not this tier's concern.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mini_run(proxy, tmp_path_factory):
    """The mini harness on the toy task with the shortest patch, SmolLM2 on vLLM as its model."""
    task = min(load_tasks("toy"), key=lambda t: len(t["patch"]))
    run = tmp_path_factory.mktemp("mini") / "run"
    args = rollout.Args(
        tasks="toy",
        instance_ids=(task["instance_id"],),
        harness="mini",
        proxy=proxy.url,
        out=run,
        model=SERVED_NAME,
        max_tokens=64,
        max_turns=3,
        timeout=600,
    )
    assert rollout.main(args) == 0
    return run


def test_a_harness_rollout_is_recorded_and_rebuilt_with_the_captured_ids(mini_run, proxy, model, tmp_path):
    session = read_sessions(mini_run).row(0, named=True)
    # SmolLM2 rarely fixes the task: finishing its turns (with or without an edit) is what this test needs.
    assert session["harness"] == "mini" and session["status"] in ("ok", "no_edit"), session
    records = read_records(proxy.captures, session=session["session_id"], expect=1)
    assert records and all(r["api"] == "chat" and r["status"] == 200 and r["streamed"] for r in records)
    out = tmp_path / "trajectories.parquet"
    lines = session_lines(proxy.captures, session["session_id"])  # as written: a record carries its checksum
    (tmp_path / "captures").mkdir()
    (tmp_path / "captures" / "mini.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    built = subprocess.run(
        [sys.executable, "-m", "reconstruct", str(tmp_path / "captures"), "-o", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    df = schema.read(out)
    # Trainable tokens are exactly the ids vLLM sampled, call by call in each trace, and every call is in one trace.
    by_id = {r["id"]: r for r in records}
    trained = 0
    for row in df.iter_rows(named=True):
        sampled = [i for m, i in zip(row["loss_mask"], row["response_ids"], strict=True) if m]
        assert sampled == [i for x in row["exchange_ids"] for i in tokens_of(by_id[x])[1]]
        trained += len(sampled)
    assert sorted(x for ids in df["exchange_ids"] for x in ids) == sorted(by_id)
    assert set(df["token_source"]) == {"captured"}
    audited = subprocess.run(
        [sys.executable, "-m", "reconstruct", "audit", str(out), "--model", str(MODEL_DIR), "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert audited.returncode == 0 and "trainable tokens" in audited.stderr, audited.stderr
    report = audit(df, model)  # the same numbers, read: vLLM's float32 log-probs against transformers'
    assert report.traces == df.height and report.tokens == trained and report.max < 1e-2, report


def test_a_grpo_adapter_hot_loaded_into_vllm_serves_peft_s_log_probs(vllm, proxy, tmp_path):
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 1, 0]}, prompt_len=8, response_len=6)
    config = grpo.Config(
        trajectories=(write(tmp_path / "trajectories.parquet", rows),),
        model=str(MODEL_DIR),
        output=tmp_path / "adapter",
        max_len=32,
        micro_batch_tokens=64,
        groups_per_step=2,
        lr=5e-2,
        lora_r=8,
        lora_alpha=16,
        save_every=0,
    )
    grpo.main(config)
    loaded = httpx.post(
        f"{vllm.url}/v1/load_lora_adapter",
        json={"lora_name": "round-1", "lora_path": str(config.output.resolve()), "load_inplace": True},
        timeout=600,
    )
    assert loaded.status_code == 200, loaded.text
    client = openai_client(proxy, "lora")
    question = [{"role": "user", "content": "Name a primary colour."}]
    for name in (SERVED_NAME, "round-1"):
        client.chat.completions.create(model=name, messages=question, max_tokens=12, temperature=0)
    base_record, lora_record = read_records(proxy.captures, session="lora", expect=2)
    assert json.loads(lora_record["response_body"])["model"] == "round-1"
    prompt, ids, logprobs = tokens_of(lora_record)
    assert tokens_of(base_record)[2] != pytest.approx(logprobs, abs=1e-3) or tokens_of(base_record)[1] != ids
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)  # PEFT wraps it in place
    tuned = PeftModel.from_pretrained(base, config.output).merge_and_unload().eval()  # a plain causal LM again
    scored = score_trace(tuned, prompt, ids)  # (R,)
    assert torch.allclose(scored, torch.tensor(logprobs), atol=1e-3), (scored, logprobs)
