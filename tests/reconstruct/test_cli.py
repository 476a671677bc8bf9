"""reconstruct/__main__.py: the three commands, in process (main(argv)) and once as ``python -m reconstruct``."""

import json
import random
import shutil
import subprocess
import sys

import pytest

from addon.writer import CaptureWriter
from eval.sessions.procs import ROOT
from reconstruct import reconstruct, schema
from reconstruct.__main__ import _generic_tokenizer, main
from tests.addon.test_record_v2 import decode, session
from tests.reconstruct.test_v2_streams import calls, read


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


def write_capture(folder, exchanges, version):
    writer = CaptureWriter(folder, rotate_bytes=1 << 30, fsync=False, decode_content=decode, format_version=version)
    for ex in exchanges:
        writer.submit(ex)
    assert writer.close() == []
    (path,) = folder.glob("*.jsonl")
    return path


def test_issue27_expand_writes_the_v1_capture_of_the_same_calls_byte_for_byte(tmp_path, capsys):
    rng = random.Random(0)
    exchanges = [ex for pair in zip(session(rng, 20), session(rng, 20, sid="s2"), strict=True) for ex in pair]
    v1 = write_capture(tmp_path / "v1", exchanges, 1).read_bytes()
    v2 = write_capture(tmp_path / "v2", exchanges, 2)
    assert len(v2.read_bytes()) < len(v1) / 4
    assert main(["expand", str(tmp_path / "v2"), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / v2.name).read_bytes() == v1
    assert "40 v2 records expanded" in capsys.readouterr().err

    lines = v2.read_bytes().split(b"\n")[:-1]  # s1 record 3 torn (a kill, then appending went on)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / v2.name).write_bytes(b"\n".join([*lines[:6], lines[6][:100], *lines[7:]]) + b"\n")
    assert main(["expand", str(tmp_path / "torn"), "-o", str(tmp_path / "out2")]) == 0
    err = capsys.readouterr().err
    assert "left out: 1 corrupt, 12 whose base record was lost" in err  # s1 records 4 to 15; its 16th is full
    kept = v1.split(b"\n")[:-1]
    lost = {6, *range(8, 32, 2)}
    assert (tmp_path / "out2" / v2.name).read_bytes() == b"".join(
        line + b"\n" for i, line in enumerate(kept) if i not in lost
    )
    _, stats = reconstruct([tmp_path / "torn"])  # the reader counts the same, as a cause of lost calls
    assert (stats.corrupt_lines, stats.unresolved_records) == (1, 12)
    # s1's 16th record, full, is read from its own copy of what it keeps (zf), its base being lost: the reader
    # gets the same calls as from the v1 lines of the records that are left.
    assert "zf" in json.loads(lines[32]) and json.loads(lines[32])["session_id"] == "s1"
    read_back = calls(read(tmp_path / "torn" / v2.name))
    assert len(read_back) == 40 - 13 and read_back == calls(read(tmp_path / "out2" / v2.name))
    assert main(["expand", str(tmp_path / "v2"), "-o", str(tmp_path / "v2")]) == 2  # never over the captures


def test_issue27_a_spliced_v2_line_fails_its_checksum(tmp_path):
    rng = random.Random(1)
    exchanges = [ex for pair in zip(session(rng, 2), session(rng, 2, sid="s2"), strict=True) for ex in pair]
    lines = write_capture(tmp_path / "v2", exchanges, 2).read_bytes().split(b"\n")[:-1]
    key = b', "z": '
    spliced = lines[0][: lines[0].index(key)] + lines[1][lines[1].index(key) :]  # s1's head, s2's bodies
    assert json.loads(spliced)["session_id"] == "s1"  # valid JSON: only the checksum tells
    (tmp_path / "spliced").mkdir()
    (tmp_path / "spliced" / "capture.jsonl").write_bytes(b"\n".join([spliced, *lines[2:]]) + b"\n")
    _, stats = reconstruct([tmp_path / "spliced"])
    # Both sessions' next records refer to a record that is gone (the splice took the place of both).
    assert (stats.corrupt_lines, stats.unresolved_records) == (1, 2)


def test_a_model_folders_generic_tokenizer_is_autotokenizers_without_torch(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from reconstruct.__main__ import _tokenizer

    auto, direct = AutoTokenizer.from_pretrained(tiny_model_dir), _tokenizer(str(tiny_model_dir))
    assert type(direct) is type(auto)
    messages = [{"role": "user", "content": "List files."}, {"role": "assistant", "content": "ls <|im_end|>"}]
    rendered = auto.apply_chat_template(messages, tokenize=False)
    assert direct.apply_chat_template(messages, tokenize=False) == rendered
    assert direct.encode(rendered, add_special_tokens=False) == auto.encode(rendered, add_special_tokens=False)
    assert (direct.all_special_ids, direct.eos_token_id) == (auto.all_special_ids, auto.eos_token_id)
    # A model type not known to load as the generic class goes through AutoTokenizer.
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert not _generic_tokenizer(other) and _generic_tokenizer(tiny_model_dir)
    # What the shortcut is for: python -m reconstruct --tokenizer <tiny> never imports torch.
    script = "import sys; from reconstruct.__main__ import _tokenizer; _tokenizer(sys.argv[1]); print(*sys.modules)"
    run = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "torch" not in run.stdout.split(), run.stderr[-2000:]


def test_default_jobs_start_workers_for_less_v2_than_v1(tmp_path, monkeypatch):
    """--jobs' default weighs a v2 byte at V2_WEIGHT v1 bytes: 40 MB of v2 is worth workers, 40 MB of v1 is not
    (sparse files: only the first record's format and the size are read)."""
    from addon.record_v2 import V2_START
    from reconstruct.__main__ import PARALLEL_BYTES, V2_WEIGHT, _auto_jobs

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    size = PARALLEL_BYTES // V2_WEIGHT + (8 << 20)
    for name, first in (("v1", b'{"v": 1, "id": "a"}\n'), ("v2", V2_START + b'"id": "a"}\n')):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "capture.jsonl", "wb") as f:
            f.write(first)
            f.truncate(size)
    assert _auto_jobs((tmp_path / "v1",)) == 1
    assert _auto_jobs((tmp_path / "v2",)) == 4
    assert _auto_jobs((tmp_path / "v1", tmp_path / "v2")) == 4


def test_issue37_expand_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    rng = random.Random(1)
    node_a = write_capture(tmp_path / "nodeA", session(rng, 10), 2)
    node_b = write_capture(tmp_path / "nodeB", session(rng, 3, sid="s2"), 2)
    name = "capture-20261203T120000Z-7.jsonl"  # two proxies, both pid 7, started in the same second
    node_a, node_b = node_a.rename(node_a.with_name(name)), node_b.rename(node_b.with_name(name))
    out = tmp_path / "out"
    assert main(["expand", str(tmp_path / "nodeA"), str(tmp_path / "nodeB"), "-o", str(out)]) == 2
    assert "expand each of their folders into its own -o folder" in capsys.readouterr().err
    assert not out.exists()
    assert main(["expand", str(tmp_path / "nodeA"), "-o", str(out)]) == 0
    expanded = (out / name).read_bytes()
    assert expanded.count(b"\n") == 10
    assert main(["expand", str(tmp_path / "nodeB"), "-o", str(out)]) == 2  # was 0, leaving nodeB's 3 records
    assert f"{out / name} exists, not written by this run" in capsys.readouterr().err
    assert (out / name).read_bytes() == expanded
    assert main(["expand", str(tmp_path / "nodeB"), "-o", str(tmp_path / "out-b")]) == 0
    assert (tmp_path / "out-b" / name).read_bytes().count(b"\n") == 3  # 13 records, none lost


def test_issue37_expand_leaves_a_file_that_appears_while_it_runs(tmp_path, capsys, monkeypatch):
    from reconstruct import _expand

    capture = write_capture(tmp_path / "node", session(random.Random(3), 2), 2)
    out = tmp_path / "out"
    real = _expand._expanded

    def meanwhile(path, counts):  # another expand into the same folder, between the check and the write
        (out / path.name).parent.mkdir(parents=True, exist_ok=True)
        (out / path.name).write_bytes(b"theirs\n")
        return real(path, counts)

    monkeypatch.setattr(_expand, "_expanded", meanwhile)
    assert main(["expand", str(capture), "-o", str(out)]) == 2
    assert f"{out / capture.name} appeared while expanding; it was left as it is" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [capture.name]  # no temporary file left either
    assert (out / capture.name).read_bytes() == b"theirs\n"
