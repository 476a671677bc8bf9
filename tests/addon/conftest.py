"""The addon under test and mitmproxy's test context around it, for the hook-level tests of this folder."""

import asyncio

import pytest
from mitmproxy.test import taddons

from addon import polar


@pytest.fixture
def addon():
    return polar.Polar()


@pytest.fixture
def tctx(addon, tmp_path):
    loop = asyncio.new_event_loop()  # owned here so it is closed: taddons would leak its own

    async def enter():
        return taddons.context(addon)

    try:
        with loop.run_until_complete(enter()) as tctx:
            tctx.configure(addon, polar_dir=str(tmp_path / "captures"))
            yield tctx
            addon.done()
    finally:
        loop.close()
