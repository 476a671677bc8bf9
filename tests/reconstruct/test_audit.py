"""reconstruct/_audit.py: re-scoring captured traces with the model that served them."""

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from reconstruct import audit, reconstruct, score_trace

pytestmark = pytest.mark.slow  # the captures fixture: a reference server and two mitmdumps


@pytest.fixture(scope="module")
def model(captures):
    return AutoModelForCausalLM.from_pretrained(captures.model_dir, dtype=torch.float32).eval()


def test_reference_server_traces_agree_to_1e_3(captures, model):
    df, _ = reconstruct([captures.vllm_dir, captures.plain_dir])  # plain calls: no tokenizer, dropped
    report = audit(df, model, threshold=1e-3, chunk=7)  # a small chunk: the chunked head must not change results
    assert report.traces == df.height and report.skipped == 0
    assert report.tokens == df["loss_mask"].list.sum().sum() > 500
    assert report.max < 1e-3 and report.above == 0 and report.share_above == 0.0
    assert set(report.quantiles) == {"p50", "p90", "p99"} and report.table().row_count == 8


def test_chunking_does_not_change_scores_and_wrong_logprobs_show(captures, model):
    df, _ = reconstruct([captures.vllm_dir])
    row = df.row(0, named=True)
    whole = score_trace(model, row["prompt_ids"], row["response_ids"], chunk=100_000)
    chunked = score_trace(model, row["prompt_ids"], row["response_ids"], chunk=3)
    assert chunked.shape == whole.shape and torch.allclose(chunked, whole, rtol=0, atol=1e-5)  # BLAS blocking only
    shifted = df.head(1).with_columns(df.head(1)["logprobs"].list.eval(pl.element() - 0.5))
    report = audit(shifted, model, threshold=0.1)
    assert report.tokens and report.above == report.tokens and abs(report.mean - 0.5) < 1e-3
