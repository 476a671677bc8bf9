"""eval.harness.presets.run_harness with stand-in CLIs: what each preset hands its harness, isolation, and the
timeout."""

import json
import os
import time
from pathlib import Path

import pytest

from eval.harness.presets import run_harness

URL = "http://127.0.0.1:9"  # nothing listens: the stand-ins never call it
BINARIES = {"codex": "codex", "claude-code": "claude", "pi": "pi", "qwen-code": "qwen", "gemini": "gemini"}
# Records what it was given: arguments, environment, stdin; the workspace is its working directory.
RECORDER = """#!/bin/sh
printf '%s\\n' "$@" > args.txt
env > env.txt
cat > stdin.txt
echo done
"""


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in BINARIES.values():
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def harness_sees(home: Path, workspace: Path) -> str:
    """Everything the harness could read of our wiring: its environment and the config files written for it."""
    configs = [p.read_text() for p in home.rglob("*") if p.is_file()]
    return "\n".join([(workspace / "env.txt").read_text(), *configs])


@pytest.mark.parametrize("harness", list(BINARIES))  # the npm CLIs; mini and shell: tests/eval
def test_preset_wires_proxy_and_session_and_nothing_of_ours(harness, tmp_path, fake_bin, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-caller-secret")  # the caller's own key must not reach the harness
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    run = run_harness(
        harness,
        "Fix the bug.",
        workspace=workspace,
        base_url=URL + "/",
        session_id="sess-42",
        home=home,
        bin_dir=fake_bin,
    )
    assert run.exit_code == 0 and not run.timed_out and run.stdout == "done\n", run.stderr
    assert Path(run.command[0]) == fake_bin / BINARIES[harness]
    assert "Fix the bug." in (workspace / "args.txt").read_text().splitlines()
    assert (workspace / "stdin.txt").read_text() == ""
    seen = harness_sees(home, workspace)
    assert "sess-42" in seen and "http://127.0.0.1:9" in seen and "127.0.0.1:9//" not in seen
    assert "sk-caller-secret" not in seen and "proxy.invalid" not in seen
    env = dict(line.split("=", 1) for line in (workspace / "env.txt").read_text().splitlines() if "=" in line)
    assert env["HOME"] == str(home.resolve())
    assert env["PATH"].split(os.pathsep)[0] == str(fake_bin)


def test_json_configs_parse(tmp_path, fake_bin):
    """The settings files the presets write are valid JSON (a harness would ignore a broken one silently)."""
    for harness in BINARIES:
        home = tmp_path / harness
        workspace = tmp_path / f"{harness}-ws"
        workspace.mkdir()
        run_harness(harness, "x", workspace=workspace, base_url=URL, session_id="s", home=home, bin_dir=fake_bin)
        for path in home.rglob("*.json"):
            json.loads(path.read_text())


@pytest.mark.parametrize(
    ("harness", "option"), [("codex", {"tools": ["exec_command"]}), ("gemini", {"max_tokens": 64})]
)
def test_unsupported_option_is_refused(harness, option, tmp_path, fake_bin):
    with pytest.raises(ValueError, match=f"{harness} has no setting"):
        run_harness(harness, "x", workspace=tmp_path, base_url=URL, session_id="s", bin_dir=fake_bin, **option)


def test_timeout_kills_the_harness_and_its_children(tmp_path, fake_bin):
    # A harness that leaves a background child holding its output open, then hangs.
    (fake_bin / "pi").write_text("#!/bin/sh\nsleep 60 &\necho $! > child.pid\nsleep 60\n")
    start = time.monotonic()
    run = run_harness("pi", "x", workspace=tmp_path, base_url=URL, session_id="s", timeout=1, bin_dir=fake_bin)
    assert run.timed_out and run.exit_code is None
    assert time.monotonic() - start < 10
    child = Path(f"/proc/{int((tmp_path / 'child.pid').read_text())}/stat")
    time.sleep(0.2)
    # Gone, or a zombie waiting for init to reap it: either way no longer running.
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z"
