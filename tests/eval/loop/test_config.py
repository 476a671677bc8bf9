"""The loop's config (eval/loop/config.py) and its presets refuse what cannot run, naming the key, before any model
is built; the run folder, resuming, and where sessions run."""

import datetime
import json
import subprocess
import sys

import pytest

from eval.errors import EvalError
from eval.loop import run as loop
from eval.loop.config import PRESET_DIR, Config, load, preset, reference
from eval.tasks import family as taskgen
from eval.tasks.load import load_tasks, save_tasks


def test_a_script_replays_through_the_reference_server_only(tmp_path):
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(ValueError, match="script replays through the reference server"):
        Config(upstream="vllm", vllm_python=python, script=tmp_path / "script.json")


def test_vllm_needs_its_venv(tmp_path):
    with pytest.raises(ValueError, match="make demo UPSTREAM=vllm builds it"):
        Config(upstream="vllm", vllm_python=tmp_path / "missing" / "python")
    assert Config(upstream="reference", vllm_python=tmp_path / "missing" / "python").upstream == "reference"


def test_by_default_it_teaches_and_trains_on_the_training_split_and_measures_the_held_out_one():
    args = Config()
    teach, tasks, heldout = set(args.teach), set(args.tasks), set(args.heldout)
    assert (len(teach), len(tasks), len(heldout)) == (64, 16, 64) and not teach & tasks
    assert {taskgen.instance_split(i) for i in teach | tasks} == {"train"}
    assert {taskgen.instance_split(i) for i in heldout} == {"heldout"}
    assert len(Config(heldout_sessions=64, heldout_samples=2).heldout) == 32
    # Power where the gain is compared: 64 tasks x 5 at SFT and the last round, one sample a task elsewhere.
    assert [(s, args.heldout_samples_at(s)) for s in ("base", "sft", "grpo1", "grpo2")] == [
        ("base", 1),
        ("sft", 5),
        ("grpo1", 1),
        ("grpo2", 5),
    ]
    assert Config(rounds=0).heldout_samples_at("sft") == 5 and Config(rounds=3).heldout_samples_at("grpo2") == 1
    unseen = Config(rounds=2, heldout_every=0)  # GRPO's settings chosen without a look at the held-out split
    assert [unseen.heldout_samples_at(s) for s in ("base", "sft", "grpo1", "grpo2")] == [1, 5, 0, 0]


def test_a_generated_training_task_cannot_be_held_out():
    unused = taskgen.generate(0)["train"][100]["instance_id"]  # neither taught nor trained on by default
    with pytest.raises(ValueError, match=r"heldout polar-gen__.*: a generated task of the other split"):
        Config(heldout=(unused,), groups=None)  # with a pool (--groups), the overlap is refused first


def test_max_len_follows_the_harness_unless_given():
    assert Config(harness="mini").trace_tokens == 1024
    assert Config(harness="pi").trace_tokens == 3072
    assert Config(harness="pi", max_len=2048).trace_tokens == 2048


# ---- --runtime: where the sessions run (eval/sessions/runtime.py), chosen like python -m eval rollout's


def test_runtime_is_auto_by_default_and_a_bad_one_is_refused():
    assert Config().runtime == "auto"
    assert {Config(runtime=name).runtime for name in ("local", "docker")} == {"local", "docker"}
    with pytest.raises(ValueError, match=r"runtime 'podman': not one of auto, local, docker"):
        Config(runtime="podman")
    with pytest.raises(EvalError, match=r"--set runtime: 'podman' is not one of auto, local, docker"):
        load(preset("cpu"), ["runtime=podman"])  # the file's reader refuses it before Config is made
    assert load(preset("cpu"), ["sessions.runtime=docker"]).runtime == "docker"


def stages(tmp_path, runtime):
    return loop.Stages(loop.Loop(tmp_path, total=1), Config(), tmp_path / "model", runtime)


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
    from eval.loop import report

    numbers = {"run": "r", "stages": {}, "order": [], "tests": [], "train": {}}
    sandboxed = {"name": "docker", "asked": "auto", "sandboxed": True, "why": "a daemon answers"}
    assert report.note(numbers | {"runtime": sandboxed}).startswith("Sessions ran sandboxed (--runtime docker")
    local = {"name": "local", "asked": "auto", "sandboxed": False, "why": "no daemon (--runtime auto)"}
    assert report.note(numbers | {"runtime": local}).startswith("Sessions ran UNSANDBOXED on this machine")
    assert "Sessions ran" not in report.note(numbers)  # a run from before --runtime


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 4, 2, 47, 39, tzinfo=tz)

    monkeypatch.setattr(loop.datetime, "datetime", Frozen)
    config = Config(out=tmp_path / "runs" / "{time}")
    runs = [loop.run_folder(config, None) for _ in range(3)]
    assert [r.name for r in runs] == ["20261204T024739Z", "20261204T024739Z-2", "20261204T024739Z-3"]
    assert all((r / "logs").is_dir() for r in runs) and sorted(runs)[-1] == runs[-1]  # the newest sorts last


def test_a_fixed_out_is_made_once_and_then_resumed_but_never_a_folder_of_something_else(tmp_path):
    config = Config(out=tmp_path / "r1")
    run = loop.run_folder(config, None)
    assert run == tmp_path / "r1" and not loop.resumed(run, config)  # new: no config.json yet
    (run / loop.CONFIG).write_text(json.dumps({"config": loop._plain(config)}))
    assert loop.run_folder(config, None) == run and loop.resumed(run, config)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(EvalError, match=r"not a run of the loop \(no config\.json\)"):
        loop.run_folder(Config(out=tmp_path / "mine"), None)
    with pytest.raises(EvalError, match=r"--resume .*: no config\.json there"):
        loop.run_folder(config, tmp_path / "mine")


def test_resume_needs_the_same_config_and_stops_only_its_processes(tmp_path):
    run, other = tmp_path / "20261207T000000Z", tmp_path / "20261207T000000Z-2"
    run.mkdir()
    other.mkdir()
    (run / loop.CONFIG).write_text(json.dumps({"config": loop._plain(Config(samples=4))}))
    with pytest.raises(EvalError, match=r"resume it with the config it ran with \(samples 4 there, 3 here\)"):
        loop.resumed(run, Config(samples=3))
    left = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--out={folder}/sft"])
        for folder in (run, other)
    ]
    try:
        assert loop.resumed(run, Config(samples=4, out=tmp_path / "elsewhere"))  # out may differ: --resume names it
        assert left[0].poll() is not None  # an earlier attempt's, stopped (and reaped by resumed)
        assert left[1].poll() is None  # RUN-2's is another run's
    finally:
        for proc in left:
            proc.kill()
            proc.wait()


# ---- the config file: sections, types, --set, presets


def write(tmp_path, text: str):
    path = tmp_path / "loop.toml"
    path.write_text(text)
    return path


def test_the_cpu_preset_is_the_demo_and_every_key_is_typed():
    config = load(preset("cpu"))
    assert preset("cpu") == PRESET_DIR / "cpu.toml"
    assert (config.harness, config.sft, config.rounds, config.groups, config.samples) == ("pi", "teacher", 2, 8, 4)
    assert config.train_args == ("--no-gradient-checkpointing",) and str(config.out) == "runs/demo/{time}"
    assert config == Config(train_args=("--no-gradient-checkpointing",), out=config.out)  # the defaults, but those


def test_overrides_are_typed_like_the_file_and_none_clears_an_optional_key():
    config = load(preset("cpu"), ["rounds=5", "grpo.lr=2e-4", "groups=none", "tasks=a,b", 'teach=["c"]', "samples=8"])
    assert (config.rounds, config.lr, config.groups, config.tasks, config.teach) == (5, 2e-4, None, ("a", "b"), ("c",))
    assert load(preset("cpu"), ["max_tokens=none"]).max_tokens is None
    assert load(preset("cpu"), ["share_prefix=false"]).share_prefix is False


@pytest.mark.parametrize(
    ("text", "sets", "error"),
    [
        ("[grpo]\nrounds = 'two'\n", [], r"loop\.toml: \[grpo\] rounds: expected an integer, got 'two'"),
        ("[grpo]\nsamples = 4\n", [], r"\[grpo\] samples: not a key of \[grpo\] .*; it belongs in \[sessions\]"),
        ("[rollout]\nsamples = 4\n", [], r"\[rollout\] is not a section \(sections: model, server"),
        ("rounds = 2\n", [], r"rounds: a key outside any section; put it under \[grpo\]"),
        ("[sessions]\nharness = 'vim'\n", [], r"\[sessions\] harness: 'vim' is not one of codex, claude-code, pi"),
        ("[grpo]\nrounds = [1]\n", [], r"rounds: expected an integer"),
        ("[sessions]\nsamples = 1\n", [], r"loop\.toml: samples must be >= 2"),
        ("[server]\nupstream = 'url'\n", [], r"upstream url needs server_url"),
        ("", ["sampels=8"], r"--set sampels=8: expected KEY=VALUE or SECTION\.KEY=VALUE"),
        ("", ["grpo.samples=8"], r"--set grpo\.samples=8: expected"),
        ("", ["lr=fast"], r"--set lr: expected a number, got 'fast'"),
        ("", ["limits={gpus = 1}"], r"limits: \['gpus'\] not among"),
        ("[sft]\nsft = 'file'\n", [], r"sft file needs sft_trajectories"),
        ("[run\n", [], r"loop\.toml: not TOML"),
    ],
)
def test_every_error_names_the_key_and_what_it_expects(tmp_path, text, sets, error):
    with pytest.raises(EvalError, match=error):
        load(write(tmp_path, text), sets)


def test_the_gpu_preset_loads_with_its_tasks_from_files(tmp_path):
    family = taskgen.generate(0)
    train = save_tasks(load_tasks("family:train"), tmp_path / "train.jsonl")
    heldout = save_tasks(load_tasks("family:heldout"), tmp_path / "heldout.jsonl")
    config = load(preset("gpu"), [f"train_source={train}", f"heldout_source={heldout}", "heldout_sessions=20"])
    assert (config.upstream, config.harness, config.runtime, config.sft, config.max_tokens) == (
        "url", "codex", "docker", "none", None
    )  # fmt: skip
    assert config.server_command[config.server_command.index("serve") + 1] == config.model
    assert config.stages[:2] == ["base", "grpo1"] and config.compared() == ("base", "grpo10")
    assert config.tasks == tuple(t["instance_id"] for t in family["train"][:64]) and len(config.heldout) == 20
    assert set(config.pool) >= set(config.tasks) and not set(config.pool) & set(config.heldout)
    # the held-out set every second round, and at the two stages GRPO's own gain compares
    assert [config.heldout_samples_at(s) for s in ("base", "grpo1", "grpo2", "grpo9", "grpo10")] == [1, 0, 1, 0, 1]
    cmd = [str(w) for w in loop.accelerate("grpo.py", config, "--x")]
    launch = ["env", "CUDA_VISIBLE_DEVICES=1", "accelerate", "launch", "--config_file", "train/configs/gpu.yaml"]
    assert cmd[:7] == [*launch, str(loop.ROOT / "train" / "grpo.py")] and cmd[-3:] == ["--x", "--dtype", "bfloat16"]
    with pytest.raises(EvalError, match=r"a held-out task cannot be trained on"):
        load(preset("gpu"), [f"train_source={train}", f"heldout_source={train}"])


def test_help_lists_every_key_with_its_default_and_how_to_resume():
    done = subprocess.run([sys.executable, "-m", "eval", "loop", "--help"], capture_output=True, text=True, check=True)
    for section in ("[model]", "[server]", "[tasks]", "[sessions]", "[sft]", "[grpo]", "[train]", "[run]"):
        assert section in done.stdout
    assert "  rounds = 2: GRPO rounds:" in reference() and "Resuming:" in done.stdout and "--resume" in done.stdout
    assert all(f"  {f} = " in done.stdout for f in Config.__dataclass_fields__)
