"""The harness CLIs pinned in eval/harness/package.json, installed on first use (eval.harness.install): the
harness tests and the demo through Pi share them."""

from pathlib import Path

import pytest

from eval.harness.install import NpmMissing, install


@pytest.fixture(scope="session")
def harness_bin() -> Path:
    """The installed CLIs' bin folder; the first run installs them (about a minute, ~1 GB under tests/.cache)."""
    try:
        return install()
    except NpmMissing as e:
        pytest.skip(f"harness CLIs need npm: {e}")
