"""The demo's settings refuse what cannot run, before any model is built."""

import datetime
import json
import subprocess
import sys

import pytest
import tyro

from eval.demo import loop
from eval.demo.loop import Args
from eval.errors import EvalError
from eval.tasks import family as taskgen


def test_a_script_replays_through_the_reference_server_only(tmp_path):
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(ValueError, match="--script replays through the reference server"):
        Args(upstream="vllm", vllm_python=python, script=tmp_path / "script.json")


def test_vllm_needs_its_venv(tmp_path):
    with pytest.raises(ValueError, match="make demo UPSTREAM=vllm builds it"):
        Args(upstream="vllm", vllm_python=tmp_path / "missing" / "python")
    assert Args(upstream="reference", vllm_python=tmp_path / "missing" / "python").upstream == "reference"


def test_by_default_it_teaches_and_trains_on_the_training_split_and_measures_the_held_out_one():
    args = Args()
    teach, tasks, heldout = set(args.teach), set(args.tasks), set(args.heldout)
    assert (len(teach), len(tasks), len(heldout)) == (64, 16, 64) and not teach & tasks
    assert {taskgen.instance_split(i) for i in teach | tasks} == {"train"}
    assert {taskgen.instance_split(i) for i in heldout} == {"heldout"}
    assert len(Args(heldout_sessions=64, heldout_samples=2).heldout) == 32
    # Power where the gain is compared: 64 tasks x 5 at SFT and the last round, one sample a task elsewhere.
    assert [(s, args.heldout_samples_at(s)) for s in ("base", "sft", "grpo1", "grpo2")] == [
        ("base", 1),
        ("sft", 5),
        ("grpo1", 1),
        ("grpo2", 5),
    ]
    assert Args(rounds=0).heldout_samples_at("sft") == 5 and Args(rounds=3).heldout_samples_at("grpo2") == 1


def test_a_generated_training_task_cannot_be_held_out():
    unused = taskgen.generate(0)["train"][100]["instance_id"]  # neither taught nor trained on by default
    with pytest.raises(ValueError, match=r"--heldout polar-gen__.*: a generated task of the other split"):
        Args(heldout=(unused,), groups=None)  # with a pool (--groups), the overlap is refused first


def test_max_len_follows_the_harness_unless_given():
    assert Args(harness="mini").trace_tokens == 1024
    assert Args(harness="pi").trace_tokens == 3072
    assert Args(harness="pi", max_len=2048).trace_tokens == 2048


# ---- --runtime: where the sessions run (eval/sessions/runtime.py), chosen like python -m eval rollout's


def test_runtime_is_auto_by_default_and_a_bad_one_is_refused():
    assert Args().runtime == "auto"
    assert {Args(runtime=name).runtime for name in ("local", "docker")} == {"local", "docker"}
    with pytest.raises(ValueError, match=r"--runtime 'podman': not one of auto, local, docker"):
        Args(runtime="podman")
    with pytest.raises(SystemExit):  # the command line refuses it before Args is made
        tyro.cli(Args, args=["--runtime", "podman"])
    assert tyro.cli(Args, args=["--runtime", "docker"]).runtime == "docker"


def stages(tmp_path, runtime):
    return loop.Stages(loop.Loop(tmp_path, total=1), Args(), tmp_path / "model", runtime)


@pytest.mark.parametrize(("runtime", "runner"), [("docker", "docker"), ("local", "local")])
def test_every_rollout_gets_the_runtime_and_every_grade_its_runner(tmp_path, runtime, runner):
    s = stages(tmp_path, runtime)
    cmd = [str(w) for w in s.rollout_cmd(("t",), 2, tmp_path / "base", "m", "http://127.0.0.1:1", capped=True)]
    assert cmd[cmd.index("--runtime") + 1] == runtime
    assert cmd[cmd.index("--session-secret") + 1] == str(tmp_path / loop.SECRET)  # each harness gets a signed key
    score = [str(w) for w in s.score_cmd(tmp_path / "base")]
    assert score[2:5] == ["eval", "score", str(tmp_path / "base")] and score[-2:] == ["--runner", runner]


def run_loop(tmp_path):
    (tmp_path / "logs").mkdir(exist_ok=True)
    return loop.Loop(tmp_path, total=1)


def test_auto_runs_unsandboxed_where_no_daemon_answers_and_says_why(tmp_path, capsys):
    chosen = loop.choose_runtime(run_loop(tmp_path), "auto", "no Docker daemon answered at unix:///x.sock")
    assert (chosen.name, chosen.sandboxed) == ("local", False)
    assert "UNSANDBOXED" in chosen.line() and "no Docker daemon answered at unix:///x.sock" in chosen.line()
    assert "UNSANDBOXED on this machine" in capsys.readouterr().out
    assert chosen.record("auto") == {"name": "local", "asked": "auto", "sandboxed": False, "why": chosen.why}
    with pytest.raises(EvalError, match=r"--runtime docker: no Docker daemon answered"):  # asked: never a fallback
        loop.choose_runtime(run_loop(tmp_path), "docker", "no Docker daemon answered at unix:///x.sock")
    assert loop.choose_runtime(run_loop(tmp_path), "local", None).why == "--runtime local was asked for"


def test_docker_unavailable_names_the_daemon_it_asked(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/polar-test.sock")
    loop.require_daemon.cache_clear()
    try:
        reason = loop.docker_unavailable()
    finally:
        loop.require_daemon.cache_clear()
    assert reason is not None and ("/nonexistent/polar-test.sock" in reason or "docker CLI is not on PATH" in reason)


def test_with_a_daemon_the_images_build_once_before_the_first_stage_or_auto_falls_back(tmp_path, monkeypatch):
    built = tmp_path / "built"
    monkeypatch.setattr(loop, "images_cmd", lambda run: [sys.executable, "-c", f"open({str(built)!r}, 'a').write('x')"])
    chosen = loop.choose_runtime(run_loop(tmp_path), "auto", None)
    assert (chosen.name, chosen.sandboxed, built.read_text()) == ("docker", True, "x")
    assert "sessions run sandboxed: --runtime docker" in chosen.line()

    fail = [sys.executable, "-c", "import sys; print('no base image: debootstrap failed'); sys.exit(3)"]
    monkeypatch.setattr(loop, "images_cmd", lambda run: fail)
    chosen = loop.choose_runtime(run_loop(tmp_path), "auto", None)
    assert chosen.name == "local" and "the task images did not build (no base image: debootstrap failed" in chosen.why
    with pytest.raises(loop.PhaseFailed, match=r"--runtime docker: the task images did not build \(no base image"):
        loop.choose_runtime(run_loop(tmp_path), "docker", None)


def test_the_note_and_the_table_say_which_runtime_ran():
    from eval.demo import report

    numbers = {"run": "r", "stages": {}, "order": [], "tests": [], "train": {}}
    sandboxed = {"name": "docker", "asked": "auto", "sandboxed": True, "why": "a daemon answers"}
    assert report.note(numbers | {"runtime": sandboxed}).startswith("Sessions ran sandboxed (--runtime docker")
    local = {"name": "local", "asked": "auto", "sandboxed": False, "why": "no daemon (--runtime auto)"}
    assert report.note(numbers | {"runtime": local}).startswith("Sessions ran UNSANDBOXED on this machine")
    assert "Sessions ran" not in report.note(numbers)  # a run from before --runtime


def test_demos_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 4, 2, 47, 39, tzinfo=tz)

    monkeypatch.setattr(loop.datetime, "datetime", Frozen)
    runs = [loop.new_run_folder(tmp_path / "runs") for _ in range(3)]
    assert [r.name for r in runs] == ["20261204T024739Z", "20261204T024739Z-2", "20261204T024739Z-3"]
    assert all((r / "logs").is_dir() for r in runs) and sorted(runs)[-1] == runs[-1]  # the newest sorts last


def test_resume_needs_a_started_run_with_the_same_flags_and_stops_only_its_processes(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        Args(resume=tmp_path)
    run, other = tmp_path / "20261207T000000Z", tmp_path / "20261207T000000Z-2"
    run.mkdir()
    other.mkdir()
    (run / loop.CONFIG).write_text(json.dumps({"config": loop._plain(Args(samples=4))}))
    with pytest.raises(EvalError, match=r"resume with the flags it ran with \(--samples 4 there, 3 here\)"):
        loop.resumed_folder(Args(samples=3, resume=run))
    left = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--out={folder}/sft"])
        for folder in (run, other)
    ]
    try:
        assert loop.resumed_folder(Args(samples=4, resume=run, out=tmp_path / "elsewhere")) == run
        assert left[0].poll() is not None  # an earlier attempt's, stopped (and reaped by resumed_folder)
        assert left[1].poll() is None  # RUN-2's is another run's
    finally:
        for proc in left:
            proc.kill()
            proc.wait()
