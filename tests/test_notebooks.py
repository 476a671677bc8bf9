"""Every notebook in notebooks/ runs top to bottom on a demo run folder (the fast scripted demo of
tests/eval/loop/test_demo.py), and is committed with its outputs cleared."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.eval.loop.test_demo import DEMO_TIMEOUT, fast_demo_run

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="session")
def demo_run(run_once, tiny_model_dir) -> Path:
    return fast_demo_run(run_once, tiny_model_dir)


def test_notebooks_are_committed_without_outputs():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert {"run.ipynb", "training.ipynb"} <= set(names)
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.cells[0].cell_type == "markdown" and "**Inputs**" in nb.cells[0].source, name
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name}: clear its outputs"


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
@pytest.mark.parametrize("name", ["run.ipynb", "training.ipynb"])
def test_notebook_runs_on_a_demo_run(name, demo_run, monkeypatch):
    monkeypatch.setenv("POLAR_RUN", str(demo_run))  # the kernel inherits it; the notebooks read it
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and the traceback, on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no chart was drawn"
    if name == "run.ipynb":  # the trace view: trained tokens in spans of class m1
        html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
        assert 'class="m1"' in html and 'class="m0"' in html
