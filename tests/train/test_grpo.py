"""train/grpo.py in-process on the tiny model: configuration, the loss against a hand-written reference, outputs,
skipped groups, resume, non-finite steps and bad input."""

import dataclasses
import json
import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from accelerate import Accelerator

from tests.train.helpers import groups, trace, write
from train import data, grpo, losses, runtime
from train.policy import load_policy

PEFT_WARNING = "ignore:.*is_gradient_checkpointing:FutureWarning"  # peft reads a property transformers 5 deprecates


def make_config(tmp_path, model_dir, rows, **overrides) -> grpo.Config:
    path = write(tmp_path / "trajectories.parquet", rows) if rows is not None else tmp_path / "trajectories.parquet"
    values = {
        "trajectories": (path,),
        "model": str(model_dir),
        "output": tmp_path / "out",
        "max_len": 48,
        "micro_batch_tokens": 48,
        "groups_per_step": 2,
        "lr": 1e-2,
        "lora_r": 4,
        "lora_alpha": 8,
        "save_every": 0,
    }
    return grpo.Config(**{**values, **overrides})


def adapter_weights(directory) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(directory / "adapter_model.safetensors")


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- configuration


@pytest.mark.parametrize(
    ("override", "message"),
    [({"max_len": 100, "micro_batch_tokens": 50}, "must fit"), ({"eps_low": 1.0}, "eps-low"),
     ({"tis_cap": 0.0}, "tis-cap"), ({"groups_per_step": 0}, "groups-per-step"), ({"max_steps": 0}, "max-steps"),
     ({"lora_dropout": 1.0}, "lora-dropout"), ({"grad_clip": 0.0}, "grad-clip")],
)  # fmt: skip
def test_config_refuses_settings_that_cannot_work(tmp_path, override, message):
    with pytest.raises(runtime.TrainConfigError, match=message):
        make_config(tmp_path, "m", None, **override)


def test_yaml_config_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.5\nlora_targets: [q_proj, v_proj]\ngradient_checkpointing: false\ntis_cap: null\n")
    cfg = runtime.parse_config(
        grpo.Config,
        [
            "--config",
            str(path),
            "--trajectories",
            "a.parquet",
            "b.parquet",
            "--model",
            "m",
            "--output",
            "o",
            "--lr",
            "0.25",
        ],
    )
    assert (cfg.lr, cfg.lora_targets, cfg.gradient_checkpointing) == (0.25, ("q_proj", "v_proj"), False)
    assert cfg.tis_cap is None
    assert [p.name for p in cfg.trajectories] == ["a.parquet", "b.parquet"]
    # a written config.yaml reproduces the run
    saved = tmp_path / "config.yaml"
    saved.write_text(runtime.config_yaml(cfg))
    assert runtime.parse_config(grpo.Config, ["--config", str(saved)]) == dataclasses.replace(cfg, config=saved)
    path.write_text("learning_rate: 1\n")
    with pytest.raises(runtime.TrainConfigError, match="learning_rate"):
        runtime.parse_config(grpo.Config, ["--config", str(path)])


# ---- the model path: packing, chunking, the disabled adapter as reference


@pytest.mark.parametrize("share_prefix", [False, True])
def test_packed_micro_batch_log_probs_equal_each_trace_on_its_own(tmp_path, tiny_model_dir, share_prefix):
    cfg = make_config(tmp_path, tiny_model_dir, None, logprob_chunk=5, share_prefix=share_prefix)
    policy = load_policy(cfg, "no")
    for name, p in policy.named_parameters():  # a non-zero adapter, so that disabling it matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    tokens = [
        np.array([5, 9, 300, 41, 7, 7, 12]),
        np.array([8, 1000, 2]),
        np.array([3, 4, 5, 6, 7, 8, 9, 10, 11]),
        np.array([5, 9, 300, 41, 8, 20]),
        np.array([5, 9, 300, 2, 2, 2, 2]),
    ]  # 3 and 4 share 0's start
    traces = [
        data.Trace(
            session=i,
            tokens=t,
            n_prompt=2,
            trained=np.arange(1, len(t) - 1),
            behav_logp=np.full(len(t) - 2, np.nan, dtype=np.float32),
            adv=1.0,
        )
        for i, t in enumerate(tokens)
    ]
    mbs = grpo.rank_micro_batches(traces, cfg, losses.AGGREGATIONS[cfg.loss_agg], rank=0, world=1, batching="packed")
    # unshared: one row, no padding; shared: [5, 9, 300] once for 0, 3 and 4 (then [5, 9, 300, 41] would save less),
    # their tails in rows of 4 (3's padded by one), the others in one packed row
    assert [mb.computed_tokens() for mb in mbs] == ([15, 12] if share_prefix else [32])
    policy.eval()
    with torch.no_grad():
        logp = torch.cat([policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets, mb.prefix)[0] for mb in mbs])
        ref_logp = torch.cat(
            [policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets, mb.prefix, reference=True)[0] for mb in mbs]
        )
        session = torch.cat([mb.session for mb in mbs])
        expected, expected_ref = [], []
        base = policy.peft.get_base_model()
        for t in traces:
            for out, use_adapter in ((expected, True), (expected_ref, False)):
                if use_adapter:
                    logits = policy.peft(input_ids=torch.from_numpy(t.tokens)[None]).logits[0]
                else:
                    with policy.peft.disable_adapter():
                        logits = base(input_ids=torch.from_numpy(t.tokens)[None]).logits[0]
                out.append(logits.log_softmax(-1)[t.trained, t.tokens[t.trained + 1]])
    # packing order is by length; compare per session
    for s in range(len(tokens)):
        torch.testing.assert_close(logp[session == s], expected[s], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref_logp[session == s], expected_ref[s], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logp, ref_logp, atol=1e-3)


@pytest.mark.parametrize(("loss_agg", "sample_std", "share_prefix"),
                         [("session_mean", True, False), ("token_mean", False, False), ("dr_grpo", True, False),
                          ("session_mean", True, True), ("dr_grpo", False, True)])  # fmt: skip
def test_step_loss_equals_a_hand_written_reference(tmp_path, tiny_model_dir, loss_agg, sample_std, share_prefix):
    """Clip (both sides), IS cap, a missing capture, masks, truncation, session weighting, LOO advantages with
    either std and a skipped group, through the real path (load, plan, pack into several micro-batches, forward,
    loss), for each averaging, and with shared prefixes packed once (a-0's traces, c-0 and c-1)."""
    rows = [
        # task a: a-0 is split into two traces; rewards 1, 0, 0
        trace(session="a-0", task="a", prompt=[11, 12, 13], response=[14, 15, 16, 17], mask=[1, 0, 1, 1],
              logprobs=[-9.0, 0.0, -0.5, -3.0], reward=1.0),
        trace(session="a-0", task="a", prompt=[11, 12, 13, 14, 15, 16, 17, 18], response=[19, 20, 21],
              mask=[1, 1, 1], logprobs=None, reward=1.0, chain=1),
        trace(session="a-1", task="a", prompt=[30, 31], response=[32, 33, 34, 35, 36, 37], mask=[1, 1, 0, 0, 1, 1],
              logprobs=[-8.0, -8.5, 0.0, 0.0, -1.0, -7.0], reward=0.0),  # cut to 10 tokens: loses 37
        trace(session="a-2", task="a", prompt=[40], response=[41, 42], logprobs=[-2.0, -20.0], reward=0.0),
        # task b: equal rewards, skipped
        trace(session="b-0", task="b", prompt=[50, 51], response=[52], reward=0.5),
        trace(session="b-1", task="b", prompt=[53, 54], response=[55], reward=0.5),
        # task c: rewards 1 and 0
        trace(session="c-0", task="c", prompt=[60, 61, 62], response=[63, 64, 65], logprobs=[-1.0, -9.0, -9.0]),
        trace(session="c-1", task="c", prompt=[60, 61], response=[72, 73], mask=[0, 1], logprobs=[0.0, -8.0],
              reward=0.0),
    ]  # fmt: skip
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        rows,
        max_len=10,
        micro_batch_tokens=12,
        groups_per_step=99,
        logprob_chunk=3,
        loss_agg=loss_agg,
        sample_std=sample_std,
        dr_grpo_tokens=7,
        share_prefix=share_prefix,
    )
    policy = load_policy(cfg, "no")
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)

    def delta(target: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # old = logp + delta: ratios e^-+0.4
        return torch.where((target + pos) % 2 == 1, 0.4, -0.4)

    # -- the trainer's path
    rollout = data.load(cfg.trajectories)
    group = np.unique(np.array(rollout.task_ids), return_inverse=True)[1]
    adv, usable = losses.group_advantages(rollout.reward, group, scale_by_std=True, sample_std=sample_std)
    traces, cut = data.make_traces(rollout, adv, usable, cfg.max_len)
    assert cut == {"truncated": 1, "prompt_too_long": 0, "nothing_trained": 0, "zero_std": 2}
    mbs = grpo.rank_micro_batches(traces, cfg, losses.AGGREGATIONS[cfg.loss_agg], rank=0, world=1, batching="packed")
    assert len(mbs) > 1
    packed = sum(mb.computed_tokens() for mb in mbs)
    # a-0's two traces share their first 6 tokens, in two chunks: the prefix runs once, in the first, so 6 tokens
    # fewer go through the model than unshared (c-0 and c-1 would save none, padding counted)
    assert packed == sum(len(t.tokens) for t in traces) - (6 if share_prefix else 0)
    assert sum(mb.prefix is not None for mb in mbs) == (2 if share_prefix else 0)
    accelerator = Accelerator()
    importance = lambda o, b: losses.truncated_importance(o, b, 2.0)  # noqa: E731
    total = 0.0
    for mb in mbs:
        with torch.no_grad():
            logp = policy(mb.input_ids, mb.position_ids, mb.sel, mb.targets, mb.prefix)[0]
        positions = mb.position_ids.flatten()  # what sel addresses: the rows, after a prefix the pass computes
        if mb.prefix is not None and mb.prefix.first:
            positions = torch.cat([torch.arange(mb.prefix.input_ids.shape[1]), positions])
        old = logp + delta(mb.targets, positions[mb.sel])
        total += grpo.accumulate(accelerator, policy, mb, old, cfg, importance, runtime.StepStats())

    # -- by hand: every trace on its own through the plain model, every token in a Python loop
    # rewards a: 1, 0, 0 (squared deviations 6/9), c: 1, 0 (1/2); sample std divides by n - 1, population by n
    std_a, std_c = (math.sqrt(6 / 9 / 2), math.sqrt(1 / 2)) if sample_std else (math.sqrt(6 / 9 / 3), 0.5)
    advantage = {"a-0": 1 / std_a, "a-1": -0.5 / std_a, "a-2": -0.5 / std_a, "c-0": 1 / std_c, "c-1": -1 / std_c}
    traces_of = {"a-0": 2, "a-1": 1, "a-2": 1, "c-0": 1, "c-1": 1}
    num = den = 0.0
    session_sum, session_tokens = dict.fromkeys(advantage, 0.0), dict.fromkeys(advantage, 0)
    for row in rows:
        s = row["session_id"]
        if s not in advantage:
            continue
        keep = min(len(row["response_ids"]), 10 - len(row["prompt_ids"]))
        tokens = row["prompt_ids"] + row["response_ids"][:keep]
        with torch.no_grad():
            lp = policy.peft(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)
        w, n = 1 / traces_of[s], 0
        for j in range(keep):
            if not row["loss_mask"][j]:
                continue
            p = len(row["prompt_ids"]) + j - 1
            logp = lp[p, tokens[p + 1]].item()
            old = logp + (0.4 if (tokens[p + 1] + p) % 2 == 1 else -0.4)
            ratio, a = math.exp(logp - old), advantage[s]
            pg = -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
            is_w = 1.0 if row["logprobs"] is None else min(math.exp(old - row["logprobs"][j]), 2.0)
            num += w * is_w * pg
            session_sum[s] += is_w * pg
            n += 1
        den += w * n
        session_tokens[s] += n
    expected = {
        "token_mean": num / den,  # every trained token alike, a split session's traces sharing one weight
        "session_mean": sum(session_sum[s] / session_tokens[s] for s in advantage) / len(advantage),
        "dr_grpo": num / (len(advantage) * 7),
    }[loss_agg]
    assert total == pytest.approx(expected, rel=1e-5, abs=1e-6)  # terms of about 1 summed in float32


# ---- whole runs


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_a_run_writes_a_peft_adapter_that_changes_the_model(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = make_config(tmp_path, tiny_model_dir, groups({"a": [1, 0, 0, 1], "b": [0, 1, 0, 0]}), groups_per_step=1)
    grpo.main(cfg)
    out = cfg.output
    assert {"adapter_config.json", "adapter_model.safetensors", "config.yaml", "metrics.jsonl"} <= {
        p.name for p in out.iterdir()
    }
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4
    assert set(adapter_config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    weights = adapter_weights(out)
    assert weights and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in weights)  # what vLLM reads
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k)  # B starts at zero: it trained

    metrics = rows_of(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert metrics[0]["data/groups"] == 2 and metrics[0]["reward/zero_std_frac"] == 0
    for key in (
        "loss/total",
        "policy/clip_frac_low",
        "policy/approx_kl",
        "policy/entropy",
        "sampling/is_weight_mean",
        "optim/grad_norm",
        "perf/tokens_per_s",
        "reward/mean",
    ):
        assert math.isfinite(metrics[1][key]), key
    # one whole group per step: each step's advantages sum to 0, and the reward mean is that group's own
    assert [abs(r["reward/adv_mean"]) < 1e-9 for r in metrics[1:]] == [True, True]
    assert sorted(r["reward/mean"] for r in metrics[1:]) == [0.25, 0.5]

    ids = torch.tensor([[5, 9, 300, 41, 7, 7, 12]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = base(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(base, out)
    after = tuned(input_ids=ids).logits
    assert not torch.allclose(before, after, atol=1e-4)
    with tuned.disable_adapter():  # the base weights are untouched
        torch.testing.assert_close(tuned(input_ids=ids).logits, before)


def test_groups_with_equal_rewards_change_nothing(tmp_path, tiny_model_dir):
    learn = groups({"a": [1, 0, 0, 1]})
    with_flat = learn + groups({"a": [1, 0, 0, 1], "flat": [1, 1, 1]})[4:]
    a = make_config(tmp_path / "a", tiny_model_dir, learn)
    b = make_config(tmp_path / "b", tiny_model_dir, with_flat)
    grpo.main(a)
    grpo.main(b)
    wa, wb = adapter_weights(a.output), adapter_weights(b.output)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert rows_of(b.output / "metrics.jsonl")[0]["reward/zero_std_frac"] == 0.5

    flat = make_config(tmp_path / "c", tiny_model_dir, groups({"x": [1, 1], "y": [0, 0, 0]}))
    with pytest.raises(data.DataError, match="no usable group: all 2 groups have equal rewards"):
        grpo.main(flat)
    assert not flat.output.exists()


def test_allow_no_signal_writes_the_starting_adapter(tmp_path, tiny_model_dir):
    cfg = make_config(tmp_path, tiny_model_dir, groups({"x": [1, 1], "y": [0, 0, 0]}), allow_no_signal=True)
    grpo.main(cfg)
    assert rows_of(cfg.output / "metrics.jsonl") == [
        {"step": 0, "data/sessions": 5, "data/traces": 5, "data/groups": 2, "reward/zero_std_frac": 1.0}
    ]
    weights = adapter_weights(cfg.output)
    assert weights and all(w.abs().sum() == 0 for k, w in weights.items() if "lora_B" in k)  # B = 0: the base model
    assert (cfg.output / "adapter_config.json").is_file() and (cfg.output / "config.yaml").is_file()


def test_resume_gives_the_same_adapter_as_an_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    rows = groups({"a": [1, 0, 0, 1, 0], "b": [0, 1, 0.5, 0, 0], "c": [1, 1, 0, 0]}, traces=2)
    whole = make_config(
        tmp_path / "whole",
        tiny_model_dir,
        rows,
        groups_per_step=2,
        epochs=3,
        max_steps=5,
        save_every=2,
        warmup_steps=3,
        lora_dropout=0.1,
    )
    grpo.main(whole)
    assert len(rows_of(whole.output / "metrics.jsonl")) == 6  # step 0 + 5 steps (2 per epoch)

    broken = dataclasses.replace(whole, output=tmp_path / "broken" / "out")
    real, calls = grpo.accumulate, []

    def interrupt_in_step_four(*args, **kwargs):
        calls.append(1)
        if len(rows_of(broken.output / "metrics.jsonl")) == 4:  # steps 0-3 logged: die inside step 4
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "accumulate", interrupt_in_step_four)
    with pytest.raises(KeyboardInterrupt):
        grpo.main(broken)
    monkeypatch.setattr(grpo, "accumulate", real)
    checkpoint = broken.output / "checkpoint"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2
    assert all("lora_" in k for k in safetensors.torch.load_file(checkpoint / "model.safetensors"))  # no base copy
    grpo.main(dataclasses.replace(broken, resume=checkpoint))

    wa, wb = adapter_weights(whole.output), adapter_weights(broken.output)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    assert [r["step"] for r in rows_of(broken.output / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(runtime.TrainConfigError, match="same settings"):
        grpo.main(dataclasses.replace(broken, resume=checkpoint, seed=1, output=tmp_path / "other"))


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, tiny_model_dir, monkeypatch):
    cfg = make_config(
        tmp_path,
        tiny_model_dir,
        groups({"a": [1, 0, 0, 1], "b": [0, 1, 0, 0], "c": [1, 0, 0, 0]}),
        groups_per_step=1,
        max_bad_steps=2,
    )
    real = losses.grpo_token_loss

    def nan_after_step_one(*args, **kwargs):
        per_token, parts = real(*args, **kwargs)
        done = len(rows_of(cfg.output / "metrics.jsonl")) - 1
        return (per_token * math.nan if done >= 1 else per_token), parts

    monkeypatch.setattr(losses, "grpo_token_loss", nan_after_step_one)
    with pytest.raises(FloatingPointError, match="2 consecutive steps"):
        grpo.main(cfg)
    metrics = rows_of(cfg.output / "metrics.jsonl")
    assert [r["optim/skipped"] for r in metrics[1:]] == [0, 1, 1]


def test_bad_input_and_outputs_are_refused(tmp_path, tiny_model_dir):
    cfg = make_config(
        tmp_path, tiny_model_dir, [trace(session="x", response=[4, 99999], reward=1.0), trace(session="y", reward=0.0)]
    )
    with pytest.raises(data.DataError, match="token id 99999 is outside the model's vocabulary"):
        grpo.main(cfg)
    cfg.output.mkdir()
    (cfg.output / "adapter_model.safetensors").write_text("x")
    with pytest.raises(runtime.TrainConfigError, match="not empty"):
        grpo.main(cfg)
    with pytest.raises(runtime.TrainConfigError, match="not a checkpoint"):
        grpo.main(dataclasses.replace(cfg, resume=tmp_path))


def test_the_script_exits_2_with_a_message_on_bad_input(tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "t.parquet", [trace(reward=None)])
    monkeypatch.setattr(
        sys, "argv", ["grpo.py", "--trajectories", str(path), "--model", "m", "--output", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(Path(grpo.__file__)), run_name="__main__")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: no rewards joined")


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_options_kl_dr_grpo_epochs_and_a_starting_adapter(tmp_path, tiny_model_dir):
    rows = groups({"a": [1, 0, 0, 1], "b": [0, 1, 0, 0]}, traces=2)
    first = make_config(tmp_path / "first", tiny_model_dir, rows)
    grpo.main(first)
    cfg = make_config(
        tmp_path / "second",
        tiny_model_dir,
        rows,
        adapter=first.output,
        kl_coef=0.5,
        loss_agg="dr_grpo",
        groups_per_step=1,
        epochs=2,
        tis_cap=None,
        scale_by_std=False,
        gradient_checkpointing=False,
        grad_clip=None,
        temperature=0.8,
    )
    grpo.main(cfg)
    metrics = rows_of(cfg.output / "metrics.jsonl")
    assert [r["epoch"] for r in metrics[1:]] == [0, 0, 1, 1]
    assert all(r["policy/kl_ref"] > 0 for r in metrics[1:])  # starts from a trained adapter: away from the base
    assert all(math.isfinite(r["loss/total"]) for r in metrics[1:])
    assert metrics[3]["policy/approx_kl"] > 0  # a second epoch: ratios against the start of the run
    w0, w1 = adapter_weights(first.output), adapter_weights(cfg.output)
    assert w0.keys() == w1.keys() and any(not torch.equal(w0[k], w1[k]) for k in w0)
