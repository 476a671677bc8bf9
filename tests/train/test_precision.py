"""--dtype: an explicit dtype is taken as given; auto takes bf16 on a CPU only where a measured bf16 matmul is at
least 1.5x faster than fp32, and the trainer says which it took and why."""

import pytest
import torch

from train import precision

MEASURED_SPEEDUP = precision.bf16_matmul_speedup  # conftest.py's float32_weights replaces it in each test


def test_an_explicit_dtype_is_taken_without_measuring(monkeypatch):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda: pytest.fail("measured"))
    assert precision.choose_dtype("float32") == (torch.float32, "--dtype float32")
    assert precision.choose_dtype("bfloat16") == (torch.bfloat16, "--dtype bfloat16")
    assert precision.choose_dtype("auto", "bf16")[0] is torch.bfloat16  # accelerate's mixed precision decides
    assert precision.choose_dtype("auto", cuda=True)[0] is torch.float32
    with pytest.raises(ValueError, match="--dtype must be auto, float32 or bfloat16, not 'half'"):
        precision.choose_dtype("half")


@pytest.mark.parametrize(("speedup", "expected"), [(1.49, torch.float32), (1.5, torch.bfloat16), (4.0, torch.bfloat16)])
def test_auto_on_the_cpu_follows_the_measured_speedup(monkeypatch, speedup, expected):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda: speedup)
    dtype, reason = precision.choose_dtype("auto", cuda=False)
    assert dtype is expected
    assert f"bf16 matmul {speedup:.2f}x fp32 on this CPU ({precision.cpu_name()}), threshold 1.5x" in reason


def test_the_measurement_is_of_this_machine():
    # Not a speed assertion: the ratio is real (both dtypes ran) and the CPU is named, whatever the machine.
    assert MEASURED_SPEEDUP(size=256, repeats=1) > 0
    assert precision.cpu_name()


def test_sft_logs_the_dtype_it_took(tmp_path, tiny_model_dir, capsys):
    from tests.train.helpers import groups, write
    from train import sft

    path = write(tmp_path / "t.parquet", groups({"a": [1, 1]}))
    out = tmp_path / "out"
    sft.main(sft.Config(trajectories=(path,), model=str(tiny_model_dir), output=out, max_len=32,
                        micro_batch_tokens=32, lora_r=4, max_steps=1, dtype="bfloat16"))  # fmt: skip
    assert "dtype: bfloat16 (--dtype bfloat16)" in capsys.readouterr().out
    assert (out / "adapter_model.safetensors").is_file()
