"""train/sft.py on the tiny model: the NLL of taught tokens only (against a hand-written reference), learning,
--min-reward, the adapter through PEFT, the reference server and grpo.py --adapter, accelerate launch,
configuration and bad input."""

import dataclasses
import itertools
import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from accelerate import Accelerator

from tests import http
from tests.train.helpers import groups, trace, write
from train import data, grpo, runtime, sft
from train.policy import load_policy

PEFT_WARNING = "ignore:.*is_gradient_checkpointing:FutureWarning"  # peft reads a property transformers 5 deprecates
ROOT = Path(__file__).resolve().parents[2]


def make_config(tmp_path, model_dir, rows, **overrides) -> sft.Config:
    path = write(tmp_path / "trajectories.parquet", rows) if rows is not None else tmp_path / "trajectories.parquet"
    values = {
        "trajectories": (path,),
        "model": str(model_dir),
        "output": tmp_path / "out",
        "max_len": 48,
        "micro_batch_tokens": 48,
        "sessions_per_step": 4,
        "lr": 1e-2,
        "lora_r": 4,
        "lora_alpha": 8,
    }
    return sft.Config(**{**values, **overrides})


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def adapter_weights(directory) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(directory / "adapter_model.safetensors")


def taught_logprobs(model, rows) -> torch.Tensor:
    """Log-probs of every mask-1 response token of ``rows`` under ``model`` (a full forward per trace); (N,)."""
    out = []
    with torch.no_grad():
        for row in rows:
            tokens = row["prompt_ids"] + row["response_ids"]
            logp = model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)  # (L, V)
            for j, m in enumerate(row["loss_mask"]):
                p = len(row["prompt_ids"]) + j - 1  # predicts tokens[p + 1]
                if m:
                    out.append(logp[p, tokens[p + 1]])
    return torch.stack(out)


# ---- the loss: taught tokens only, each aggregation against a hand-written reference


ROWS = [  # s0 is cut into two traces; s1 loses its last token to max_len 10; s2's tail is a tool result
    trace(session="s0", task=None, prompt=[11, 12, 13], response=[14, 15, 16, 17], mask=[1, 0, 1, 1], reward=None),
    trace(session="s0", task=None, prompt=[11, 12, 13, 14, 15, 16, 17, 18], response=[19, 20], reward=None, chain=1),
    trace(session="s1", task=None, prompt=[30, 31], response=[32, 33, 34, 35, 36, 37, 38, 39, 40],
          mask=[1, 1, 0, 0, 1, 1, 0, 1, 1], reward=None),
    trace(session="s2", task=None, prompt=[40], response=[41, 42, 43, 44], mask=[0, 1, 0, 0], reward=None),
]  # fmt: skip


@pytest.mark.parametrize(("loss_agg", "share_prefix"),
                         [("token_mean", False), ("session_mean", False), ("token_mean", True)])  # fmt: skip
def test_step_loss_is_the_nll_of_taught_tokens_by_hand(tmp_path, tiny_model_dir, loss_agg, share_prefix):
    """Masks in the middle and at the end, truncation, a session in two traces, several micro-batches, and the
    traces of s0 packed with their shared 7 tokens once."""
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        ROWS,
        max_len=10,
        micro_batch_tokens=12,
        logprob_chunk=3,
        loss_agg=loss_agg,
        share_prefix=share_prefix,
    )
    policy = load_policy(cfg, "no")
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    traces, cut = data.make_traces(
        data.load(cfg.trajectories, require_reward=False, require_task=False),
        np.zeros(3),
        np.ones(3, bool),
        cfg.max_len,
    )
    assert cut["truncated"] == 1
    mbs = sft.rank_micro_batches(traces, sft.AGGREGATIONS[loss_agg], cfg, rank=0, world=1, batching="packed")
    assert len(mbs) > 1
    # the shared family's 6 prefix tokens run once, in the first of its two chunks
    assert sum(mb.computed_tokens() for mb in mbs) == sum(len(t.tokens) for t in traces) - 6 * share_prefix
    assert sum(mb.prefix is not None for mb in mbs) == 2 * share_prefix
    total = sum(sft.accumulate(Accelerator(), policy, mb, runtime.StepStats()) for mb in mbs)

    by_session: dict[str, list[float]] = {}
    for row in ROWS:
        keep = min(len(row["response_ids"]), 10 - len(row["prompt_ids"]))
        row = {**row, "response_ids": row["response_ids"][:keep], "loss_mask": row["loss_mask"][:keep]}
        by_session.setdefault(row["session_id"], []).extend((-taught_logprobs(policy.peft, [row])).tolist())
    nll = [x for s in by_session.values() for x in s]
    assert len(nll) == 3 + 2 + 5 + 1
    expected = np.mean(nll) if loss_agg == "token_mean" else np.mean([np.mean(s) for s in by_session.values()])
    assert total == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_tokens_after_the_last_taught_one_change_neither_loss_nor_gradient(tmp_path, tiny_model_dir):
    cfg = make_config(tmp_path, tiny_model_dir, None)
    policy = load_policy(cfg, "no")

    def loss_and_grads(response: list[int]) -> tuple[float, list[torch.Tensor]]:
        t = data.Trace(
            session=0,
            tokens=np.array([5, 9, 300, *response]),
            n_prompt=3,
            trained=np.array([2, 3]),
            behav_logp=np.full(2, np.nan, dtype=np.float32),
            adv=0.0,
        )  # response[:2] taught (mask 1)
        (mb,) = sft.rank_micro_batches([t], sft.token_mean_weights, cfg, rank=0, world=1, batching="packed")
        policy.zero_grad(set_to_none=True)
        loss = sft.accumulate(Accelerator(), policy, mb, runtime.StepStats())
        return loss, [p.grad.clone() for p in policy.parameters() if p.requires_grad]

    loss, grads = loss_and_grads([41, 7, 12, 12, 99])  # mask [1, 1, 0, 0, 0]: a tool result at the end
    other_loss, other_grads = loss_and_grads([41, 7, 1000, 3, 2])
    assert loss == other_loss and any(g.abs().sum() > 0 for g in grads)
    for g, h in zip(grads, other_grads, strict=True):
        torch.testing.assert_close(g, h)
    taught_loss, _ = loss_and_grads([41, 8, 12, 12, 99])  # the control: a taught token changes it
    assert taught_loss != loss


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_sft_raises_the_log_prob_of_taught_tokens_and_only_touches_the_adapter(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0, 0]})  # mask 1, 1, 0, 1, 1 per response; rewards unused
    cfg = make_config(tmp_path, tiny_model_dir, rows, epochs=3, warmup_steps=1)
    sft.main(cfg)
    assert {"adapter_config.json", "adapter_model.safetensors", "config.yaml", "metrics.jsonl"} <= {
        p.name for p in cfg.output.iterdir()
    }
    metrics = rows_of(cfg.output / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(7)) and [r["epoch"] for r in metrics[1:]] == [0, 0, 1, 1, 2, 2]
    assert metrics[0]["data/kept_sessions"] == 8 and metrics[0]["data/taught_tokens"] == 8 * 4
    assert sum(r["perf/trained_tokens"] for r in metrics[1:3]) == 8 * 4  # one epoch: every taught token once
    for key in ("loss/nll", "loss/token_nll", "policy/entropy", "optim/grad_norm", "optim/lr", "perf/tokens_per_s"):
        assert all(math.isfinite(r[key]) for r in metrics[1:]), key
    assert metrics[1]["optim/lr"] == pytest.approx(0.5e-2) and metrics[-1]["optim/lr"] == pytest.approx(1e-3)
    assert metrics[-1]["loss/nll"] < metrics[1]["loss/nll"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = taught_logprobs(base, rows)
    tuned = PeftModel.from_pretrained(base, cfg.output)
    after = taught_logprobs(tuned, rows)
    assert (after > before).all() and after.mean() > before.mean() + 0.3  # nats per taught token
    with tuned.disable_adapter():  # the base weights are untouched
        torch.testing.assert_close(taught_logprobs(tuned, rows), before)


# ---- --min-reward and rewards that may be null


def test_min_reward_keeps_sessions_at_or_above_it(tmp_path, tiny_model_dir):
    rows = [
        trace(session="good", reward=1.0),
        trace(session="good", reward=1.0, chain=1),
        trace(session="half", reward=0.5, response=[7, 8]),
        trace(session="bad", reward=0.0),
        trace(session="unknown", reward=None),
        trace(session="no-task", task=None, reward=1.0),
    ]
    cfg = make_config(tmp_path / "a", tiny_model_dir, rows, min_reward=0.5)
    sft.main(cfg)
    first, step = rows_of(cfg.output / "metrics.jsonl")[:2]
    assert first["data/sessions"] == 4  # "unknown" has no reward: dropped and counted; no task is fine
    assert first["data/dropped_sessions_no_reward"] == 1
    assert first["data/kept_sessions"] == 3 and first["data/skipped_traces_below_min_reward"] == 1
    assert first["data/taught_tokens"] == step["perf/trained_tokens"] == 3 + 3 + 2 + 3

    everything = make_config(tmp_path / "b", tiny_model_dir, rows)  # no --min-reward: every session, null or not
    sft.main(everything)
    assert rows_of(everything.output / "metrics.jsonl")[0]["data/kept_sessions"] == 5

    with pytest.raises(data.DataError, match=r"no session has reward >= 2.0 \(4 sessions, rewards 0 to 1\)"):
        sft.main(make_config(tmp_path / "c", tiny_model_dir, rows, min_reward=2.0))
    unrewarded = [trace(session="x", reward=None, task=None), trace(session="y", reward=None, task=None)]
    with pytest.raises(data.DataError, match="no rewards joined"):
        sft.main(make_config(tmp_path / "d", tiny_model_dir, unrewarded, min_reward=0.0))
    bare = make_config(tmp_path / "e", tiny_model_dir, unrewarded)  # captured sessions, nothing joined: fine
    sft.main(bare)
    assert rows_of(bare.output / "metrics.jsonl")[0]["data/kept_sessions"] == 2


# ---- the adapter: PEFT, the reference server, grpo.py --adapter


@pytest.mark.slow
@pytest.mark.filterwarnings(PEFT_WARNING)
def test_the_adapter_serves_and_raises_the_served_log_probs_of_the_taught_answer(
    tmp_path, tiny_model_dir, reference_server
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    url = reference_server(
        tiny_model_dir, script=[{"content": "The answer is 42.", "reasoning": None, "tool_calls": []}]
    )
    messages = [{"role": "user", "content": "What is the answer?"}]

    def served(model: str, session: str) -> tuple[list[int], list[int], list[float]]:
        answer = http.post(
            url + "/v1/chat/completions",
            headers={"x-polar-session": session},
            json={"messages": messages, "model": model, "logprobs": True, "return_token_ids": True},
        )
        answer.raise_for_status()
        choice = answer.json()["choices"][0]
        logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        return answer.json()["prompt_token_ids"], choice["token_ids"], logprobs

    prompt, ids, base = served("tiny", "base")  # the script replays the same answer to every session
    rows = [trace(session=f"s{i}", task=None, prompt=prompt, response=ids, reward=None) for i in range(4)]
    cfg = make_config(
        tmp_path, tiny_model_dir, rows, max_len=256, micro_batch_tokens=256, sessions_per_step=2, epochs=2
    )
    sft.main(cfg)

    loaded = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "sft", "lora_path": str(cfg.output)})
    assert loaded.status_code == 200, loaded.text
    _, same_ids, tuned = served("sft", "tuned")
    assert same_ids == ids
    assert all(t > b for t, b in zip(tuned, base, strict=True)) and np.mean(tuned) > np.mean(base) + 0.3  # nats
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg.output).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]  # (T, V)
    expected = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]  # (T,)
    torch.testing.assert_close(torch.tensor(tuned), expected, atol=1e-4, rtol=0)


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_grpo_starts_from_the_sft_adapter(tmp_path, tiny_model_dir):
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0, 0]})
    first = make_config(tmp_path / "sft", tiny_model_dir, rows)
    sft.main(first)
    rl = grpo.Config(
        trajectories=first.trajectories,
        model=str(tiny_model_dir),
        output=tmp_path / "rl",
        adapter=first.output,
        groups_per_step=2,
        max_steps=1,
        kl_coef=0.1,
        max_len=48,
        micro_batch_tokens=48,
        lr=1e-2,
        save_every=0,
    )
    grpo.main(rl)
    metrics = rows_of(rl.output / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1] and math.isfinite(metrics[1]["loss/total"])
    assert metrics[1]["policy/kl_ref"] > 0  # a fresh LoRA would be the base model: KL 0 at the first step
    w0, w1 = adapter_weights(first.output), adapter_weights(rl.output)
    assert w0.keys() == w1.keys() and any(not torch.equal(w0[k], w1[k]) for k in w0)
    assert json.loads((rl.output / "adapter_config.json").read_text())["r"] == 4  # the SFT adapter's rank


# ---- the entrypoint as users run it


@pytest.mark.slow
def test_accelerate_launch(tmp_path, tiny_model_dir):
    trajectories = write(tmp_path / "t.parquet", groups({"a": [1, 0, 0, 1], "b": [0, 1, 0.5]}, traces=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "accelerate"),
            "launch",
            "--config_file",
            "train/configs/cpu.yaml",
            "--num_cpu_threads_per_process",
            "1",
            "train/sft.py",
            "--trajectories",
            str(trajectories),
            "--model",
            str(tiny_model_dir),
            "--min-reward",
            "0.5",
            "--sessions-per-step",
            "2",
            "--max-len",
            "32",
            "--micro-batch-tokens",
            "32",
            "--lora-r",
            "4",
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "7 sessions, 4 kept (reward >= 0.5)" in run.stdout and "step 2/2  loss" in run.stdout
    assert [r["step"] for r in rows_of(tmp_path / "out" / "metrics.jsonl")] == [0, 1, 2]
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert runtime.parse_config(sft.Config, ["--config", str(tmp_path / "out" / "config.yaml")]).min_reward == 0.5


# ---- configuration and bad input


@pytest.mark.parametrize(
    ("override", "message"),
    [({"max_len": 100, "micro_batch_tokens": 50}, "must fit"), ({"sessions_per_step": 0}, "sessions-per-step"),
     ({"max_steps": 0}, "max-steps"), ({"min_reward": math.nan}, "min-reward"), ({"lr": 0.0}, "--lr"),
     ({"min_lr_frac": 2.0}, "min-lr-frac"), ({"lora_dropout": 1.0}, "lora-dropout"), ({"grad_clip": 0.0}, "grad-clip"),
     ({"trajectories": ()}, "--trajectories")],
)  # fmt: skip
def test_config_refuses_settings_that_cannot_work(tmp_path, override, message):
    with pytest.raises(runtime.TrainConfigError, match=message):
        make_config(tmp_path, "m", None, **override)


def test_yaml_config_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.5\nmin_reward: 1\nloss_agg: session_mean\nlora_targets: [q_proj, v_proj]\n")
    cfg = runtime.parse_config(
        sft.Config,
        ["--config", str(path), "--trajectories", "a.parquet", "--model", "m", "--output", "o", "--lr", "0.25"],
    )
    assert (cfg.lr, cfg.min_reward, cfg.loss_agg, cfg.lora_targets) == (0.25, 1.0, "session_mean", ("q_proj", "v_proj"))
    saved = tmp_path / "config.yaml"  # a written config.yaml reproduces the run
    saved.write_text(runtime.config_yaml(cfg))
    assert runtime.parse_config(sft.Config, ["--config", str(saved)]) == dataclasses.replace(cfg, config=saved)
    path.write_text("sessions_per_stp: 4\n")
    with pytest.raises(runtime.TrainConfigError, match="sessions_per_stp"):
        runtime.parse_config(sft.Config, ["--config", str(path)])
    with pytest.raises(runtime.TrainConfigError, match=r"missing\.yaml"):
        runtime.parse_config(sft.Config, ["--config", str(tmp_path / "missing.yaml")])


def test_lr_warms_up_then_decays_to_its_floor():
    factors = [sft.lr_factor(s, 10, warmup_steps=2, min_lr_frac=0.1) for s in range(10)]
    assert factors[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))  # from the peak on
    assert sft.lr_factor(0, 1, warmup_steps=0, min_lr_frac=0.1) == 1.0  # one step: the peak


def test_bad_input_and_outputs_are_refused(tmp_path, tiny_model_dir):
    cfg = make_config(tmp_path, tiny_model_dir, [trace(session="x", response=[4, 99999])])
    with pytest.raises(data.DataError, match="token id 99999 is outside the model's vocabulary"):
        sft.main(cfg)
    cfg.output.mkdir()
    (cfg.output / "adapter_model.safetensors").write_text("x")
    with pytest.raises(runtime.TrainConfigError, match="not empty"):
        sft.main(cfg)
    only_context = make_config(tmp_path / "b", tiny_model_dir, [trace(mask=[0, 0, 0])])
    with pytest.raises(data.DataError, match=r"no trace with a taught token.*'nothing_trained': 1"):
        sft.main(only_context)


def test_the_script_exits_2_with_a_message_on_bad_input(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope.parquet"
    monkeypatch.setattr(
        sys, "argv", ["sft.py", "--trajectories", str(missing), "--model", "m", "--output", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(Path(sft.__file__)), run_name="__main__")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {missing}: no such trajectory file")
