"""Where the proxy's CPU per call goes: bare mitmdump and mitmdump + the addon under cProfile, every thread.

Run:  .venv/bin/python -m tests.bench.proxy_profile [--calls 300] [--streams 30]

Starts the fake vLLM upstream and two reverse-proxy mitmdumps, each inside a small wrapper that runs mitmdump under
``cProfile`` with a profile per thread (the event loop and the addon's writer thread), timed by each thread's CPU
clock, sends each the same calls
of one agent session (``--calls`` non-streamed ~100 KB requests, then ``--streams`` streams of 200 chunks), stops
them (SIGTERM: the profile is written as mitmdump exits) and prints the self time per call by where the code
lives: mitmproxy, the addon, the standard library (asyncio, ssl, json, ...), other packages; then the addon's
functions and mitmproxy's, heaviest first. The profiler adds its own cost to every Python call, alike on both
sides: compare the two columns, not their sum with the proxy bench's CPU per request.
"""

from __future__ import annotations

import dataclasses
import itertools
import pstats
import sys
import tempfile
import time
from pathlib import Path

import httpx
import tyro

from tests.bench.payload import session_bodies
from tests.bench.procs import ROOT, start_mitmdump, start_upstream, stop

# Runs mitmdump with every thread profiled; the merged stats go to argv[1] when it exits.
WRAPPER = """\
import cProfile, pstats, sys, threading, time
out = sys.argv.pop(1)
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile(time.thread_time)  # CPU time: a thread waiting counts nothing
    profiles.append(p)
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile(time.thread_time)
profiles.append(main)
from mitmproxy.tools.main import mitmdump
main.enable()
try:
    mitmdump(sys.argv[1:])
except SystemExit:
    pass
finally:
    main.disable()
    stats = pstats.Stats(main)
    for p in profiles[:-1] if profiles[-1] is main else profiles:
        if p is not main:
            p.create_stats()
            stats.add(p)
    stats.dump_stats(out)
"""


@dataclasses.dataclass
class Config:
    """Profile bare mitmdump and mitmdump + addon per call."""

    calls: int = 300
    """Non-streamed ~100 KB calls per proxy."""
    streams: int = 30
    """Streamed calls (200 chunks) per proxy."""
    top: int = 12
    """Functions listed per group."""


def where(filename: str) -> str:
    if "/addon/" in filename:
        return "addon"
    if "/mitmproxy/" in filename:
        return "mitmproxy"
    if "site-packages" in filename:
        return "other packages"
    return "stdlib and builtins"


def profile(cfg: Config) -> dict[str, pstats.Stats]:
    tmp = Path(tempfile.mkdtemp(prefix="polar-profile-"))
    wrapper = tmp / "profiled_mitmdump.py"
    wrapper.write_text(WRAPPER)
    up_proc, up_port = start_upstream(600)
    plain = itertools.cycle(session_bodies(64, target_bytes=100_000)).__next__
    streamed = itertools.cycle(session_bodies(16, target_bytes=100_000, stream=True, extra={"bench_chunks": 200}))
    headers = {"content-type": "application/json", "authorization": "Bearer bench-session"}
    out: dict[str, pstats.Stats] = {}
    try:
        for name, extra in (
            ("bare", []),
            ("addon", ["-s", str(ROOT / "addon/polar.py"), "--set", f"polar_dir={tmp / 'captures'}",
                       "--set", "polar_upstream=vllm"]),
        ):  # fmt: skip
            prof = tmp / f"{name}.prof"
            # start_mitmdump runs the venv's mitmdump; the wrapper is run by this Python with the same arguments.
            proc, port, _ = start_mitmdump(
                up_port, tmp / f"{name}.log", tmp / f"conf-{name}", 600, extra, python_wrapper=[wrapper, prof]
            )
            try:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as c:
                    for _ in range(cfg.calls):
                        c.post("/v1/chat/completions", content=plain(), headers=headers).raise_for_status()
                    for _ in range(cfg.streams):
                        with c.stream("POST", "/v1/chat/completions", content=next(streamed), headers=headers) as r:
                            for _ in r.iter_raw():
                                pass
                time.sleep(1.0)  # the writer thread's last records
            finally:
                stop(proc)
            out[name] = pstats.Stats(str(prof))
    finally:
        stop(up_proc)
    return out


def report(cfg: Config, stats: dict[str, pstats.Stats]) -> None:
    n = cfg.calls + cfg.streams
    groups: dict[str, dict[str, float]] = {}
    funcs: dict[str, list[tuple[float, str]]] = {}
    for name, st in stats.items():
        raw = st.stats  # type: ignore[attr-defined]  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
        for (filename, line, func), (_, _, tottime, _, _) in raw.items():
            group = where(filename)
            groups.setdefault(group, {})[name] = groups.get(group, {}).get(name, 0.0) + tottime
            if name == "addon":
                short = filename.split(f"/{group}/")[-1] if group in ("addon", "mitmproxy") else filename
                funcs.setdefault(group, []).append((tottime, f"{short}:{line}({func})"))
    print(f"self time per call (ms), {cfg.calls} non-streamed ~100 KB calls + {cfg.streams} streams of 200 chunks, "
          "under cProfile, CPU time of every thread")  # fmt: skip
    print("| where | bare mitmdump | mitmdump + addon | addon - bare |\n| --- | ---: | ---: | ---: |")
    total = {"bare": 0.0, "addon": 0.0}
    for group in ("mitmproxy", "stdlib and builtins", "other packages", "addon"):
        b, a = groups.get(group, {}).get("bare", 0.0), groups.get(group, {}).get("addon", 0.0)
        total["bare"] += b
        total["addon"] += a
        print(f"| {group} | {1e3 * b / n:.2f} | {1e3 * a / n:.2f} | {1e3 * (a - b) / n:+.2f} |")
    print(f"| all | {1e3 * total['bare'] / n:.2f} | {1e3 * total['addon'] / n:.2f} | "
          f"{1e3 * (total['addon'] - total['bare']) / n:+.2f} |")  # fmt: skip
    per_func = {name: {k: v[2] for k, v in st.stats.items()} for name, st in stats.items()}  # type: ignore[attr-defined]
    grown = sorted(
        ((t - per_func["bare"].get(k, 0.0), k) for k, t in per_func["addon"].items() if where(k[0]) != "addon"),
        reverse=True,
    )
    print("\noutside the addon, what grows most with it loaded (self ms per call, addon - bare):")
    for delta, (filename, line, func) in grown[: cfg.top]:
        group = where(filename)
        short = filename.split(f"/{group}/")[-1] if group == "mitmproxy" else filename.rsplit("/", 1)[-1]
        print(f"  {1e3 * delta / n:+6.3f}  {group}: {short}:{line}({func})")
    for group in ("addon", "mitmproxy", "stdlib and builtins"):
        print(f"\nheaviest {group} functions in mitmdump + addon (self ms per call):")
        for tottime, what in sorted(funcs.get(group, []), reverse=True)[: cfg.top]:
            print(f"  {1e3 * tottime / n:6.3f}  {what}")


def main(cfg: Config) -> int:
    report(cfg, profile(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
