"""Proof that it learns: on-policy rounds of sample -> reward -> grpo.main on the tiny model.

Each prompt offers four answer tokens; the policy samples one (its own probabilities, renormalised over the four,
as constrained decoding does) and the captured log-prob is that of the full distribution. Rewards: A 1, B 0, C and
D 0.5. After three rounds, A is more likely and B less likely under the full softmax. With equal rewards there is
nothing to learn, and the trainer says so instead of touching the adapter.
"""

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.helpers import trace, write
from train import data, grpo

PROMPTS = [[1, 100 + i, 200 + i, 300 + i] for i in range(4)]
A, B, C, D = 1000, 2000, 3000, 3500


def answer_logprobs(model_dir: Path, adapter: Path | None) -> torch.Tensor:
    """(prompts, V) log-probs of the first answer token under the base model plus ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in PROMPTS])


def sample_rows(logp: torch.Tensor, rewards: dict[int, float], rng: np.random.Generator, per_task: int) -> list[dict]:
    choices = list(rewards)
    rows = []
    for t, prompt in enumerate(PROMPTS):
        q = logp[t, choices].exp().numpy()
        for i in range(per_task):
            c = choices[rng.choice(len(choices), p=q / q.sum())]
            rows.append(
                trace(
                    session=f"t{t}-{i}",
                    task=f"t{t}",
                    prompt=prompt,
                    response=[c],
                    logprobs=[float(logp[t, c])],
                    reward=rewards[c],
                )
            )
    return rows


def train_rounds(tmp_path: Path, model_dir: Path, rewards: dict[int, float], rounds: int) -> Path | None:
    rng, adapter = np.random.default_rng(0), None
    for r in range(rounds):
        rows = sample_rows(answer_logprobs(model_dir, adapter), rewards, rng, per_task=12)
        cfg = grpo.Config(
            trajectories=(write(tmp_path / f"round{r}.parquet", rows),),
            model=str(model_dir),
            output=tmp_path / f"adapter{r}",
            adapter=adapter,
            groups_per_step=len(rows),
            lr=0.1,
            lora_r=8,
            lora_alpha=16,
            max_len=16,
            micro_batch_tokens=256,
            save_every=0,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            grpo.main(cfg)
        adapter = cfg.output
    return adapter


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_the_rewarded_answer_becomes_more_likely_and_the_penalised_one_less(tmp_path, tiny_model_dir):
    before = answer_logprobs(tiny_model_dir, None).exp().mean(0)  # (V,) mean over prompts
    adapter = train_rounds(tmp_path, tiny_model_dir, {A: 1.0, B: 0.0, C: 0.5, D: 0.5}, rounds=3)
    after = answer_logprobs(tiny_model_dir, adapter).exp().mean(0)
    assert after[A] > 1.5 * before[A]
    assert after[B] < 0.8 * before[B]


def test_equal_rewards_leave_the_model_alone(tmp_path, tiny_model_dir):
    with pytest.raises(data.DataError, match="no usable group"):
        train_rounds(tmp_path, tiny_model_dir, {A: 0.5, B: 0.5, C: 0.5, D: 0.5}, rounds=1)
    assert not (tmp_path / "adapter0").exists()
