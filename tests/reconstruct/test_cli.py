"""reconstruct/__main__.py: the three commands, in process (main(argv)) and once as ``python -m reconstruct``."""

import subprocess
import sys

import pytest

from eval.procs import ROOT
from reconstruct import schema
from reconstruct.__main__ import main


@pytest.mark.slow
def test_build_stats_audit(captures, tmp_path, capsys):
    out = tmp_path / "t.parquet"
    argv = [str(captures.vllm_dir), str(captures.plain_dir), "-o", str(out), "--tokenizer", str(captures.model_dir)]
    assert main([*argv, "--eot-token", "<|im_end|>", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "traces" in err and "14 (prefix, drift: split)" in err and f"wrote {out}" in err
    assert schema.read(out).height == 14
    assert main(["stats", str(out)]) == 0
    err = capsys.readouterr().err
    assert "14 (prefix, drift: split)" in err and "break: drift" in err and "is missing" not in err
    (tmp_path / "t.stats.json").unlink()
    assert main(["stats", str(out)]) == 0
    assert "chain breaks and dropped calls are unknown" in capsys.readouterr().err
    assert main(["audit", str(out), "--model", str(captures.model_dir), "--threshold", "1e-3", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "traces audited / skipped (no log-probs)" in err and "12 / 2" in err and "0.00% (0)" in err


def test_errors_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "-o", str(tmp_path / "t.parquet")]) == 2
    assert "no such capture file" in capsys.readouterr().err
    (tmp_path / "x.jsonl").write_text("")
    assert main([str(tmp_path), "--shard", "5/2"]) == 2
    assert "--shard" in capsys.readouterr().err
    (tmp_path / "t.parquet").write_text("not parquet")
    assert main(["stats", str(tmp_path / "t.parquet")]) == 2
    assert "not a readable Parquet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # tyro: the captures are required


@pytest.mark.slow
def test_python_m_reconstruct(captures, tmp_path):
    out = tmp_path / "t.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "reconstruct", str(captures.vllm_dir), "-o", str(out), "--mode", "per-request"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert schema.read(out).height == 25 and "25 (per-request" in done.stderr


@pytest.mark.slow
def test_no_usable_record_exits_non_zero_and_writes_nothing(captures, tmp_path, capsys):
    """Issue 16: a folder of garbage is an error, not an empty table; so are calls that all lack token ids."""
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "x.jsonl").write_bytes(b'hello\n{"v": 1}\n\x00\xff\n')
    out = tmp_path / "t.parquet"
    assert main([str(tmp_path / "garbage"), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no usable model call" in err and "3 lines: 2 corrupt" in err and "nothing written" in err
    assert main([str(captures.plain_dir), "-o", str(out), "--no-progress"]) == 2
    assert "6 missing ids (calls recorded without token ids need --tokenizer)" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "t.stats.json").exists()
    # --allow-empty is for runs that made no call at all, never for lines that hold nothing usable
    assert main([str(tmp_path / "garbage"), "-o", str(out), "--no-progress", "--allow-empty"]) == 2
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "captures.jsonl").write_bytes(b"")
    assert main([str(tmp_path / "empty"), "-o", str(out), "--no-progress"]) == 2
    assert main([str(tmp_path / "empty"), "-o", str(out), "--no-progress", "--allow-empty"]) == 0
    assert schema.read(out).height == 0
