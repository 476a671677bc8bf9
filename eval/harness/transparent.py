"""Transparent mode for harness runs: the proxy and CA environment, a regular-mode mitmdump, and unpointed presets.

    python -m eval transparent env claude-code --proxy-url http://127.0.0.1:8080 --confdir /tmp/polar-ca
    python -m eval transparent run codex "Fix the bug." --upstream http://127.0.0.1:8000 --session s1 \\
        --workspace /tmp/ws

``env`` prints the one line to export so a harness, left exactly as shipped, sends its provider calls through
the proxy and trusts its CA; ``run`` starts ``mitmdump --mode regular`` with ``polar_reroute`` (addon/reroute.py)
and runs a preset that way. The harness keeps its provider's own URL: presets that need a config file anyway
(Codex's model name, Pi's and Qwen Code's model entries) name the provider's real host in it, never the proxy.
Each preset's provider URL and trust variables are in its record (eval/harness/presets.py).
The session id is the API key, as in reverse mode; ``proxy_env`` can also put it in the proxy URL's user name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import certifi
import tyro

from eval.errors import EvalError
from eval.harness import presets
from eval.harness.install import install
from eval.sessions.procs import ADDON, Service, free_port
from reconstruct.files import write_atomic

__all__ = ["CA_FILE", "TransparentMitmdump", "harness_env", "proxy_env", "run_transparent"]

CA_FILE = "mitmproxy-ca-cert.pem"  # what mitmproxy writes into its confdir on first start
BUNDLE_FILE = "polar-ca-bundle.pem"
# Variables a preset sets only to change the base URL; unset, the harness uses its built-in default.
BASE_URL_VARS = ("ANTHROPIC_BASE_URL", "GOOGLE_GEMINI_BASE_URL", "OPENAI_BASE_URL")
# The harnesses with a transparent mode, as a type for the CLI's choices.
if TYPE_CHECKING:
    Transparent = str  # a Literal built at run time is tyro's to read, not mypy's
else:
    Transparent = Literal[tuple(name for name, preset in presets.PRESETS.items() if preset.provider_url)]


def ca_bundle(ca_cert: Path) -> Path:
    """The system roots (certifi) plus the proxy's CA, beside it: clients whose trust variable replaces their
    roots still reach the hosts the proxy passes through untouched."""
    bundle = ca_cert.with_name(BUNDLE_FILE)
    if not bundle.exists() or bundle.stat().st_mtime < ca_cert.stat().st_mtime:
        write_atomic(bundle, Path(certifi.where()).read_bytes() + b"\n" + ca_cert.read_bytes())
    return bundle


def proxy_env(proxy_url: str, ca_cert: Path, session_id: str | None = None) -> dict[str, str]:
    """``HTTPS_PROXY`` and every CA variable. With ``session_id``, the proxy URL carries it as its user name, so
    every call of the process is filed under it whatever key it sends (the way for capture-only runs)."""
    if session_id is not None:
        scheme, sep, rest = proxy_url.partition("://")
        proxy_url = f"{scheme}{sep}{session_id}@{rest}"
    bundle = str(ca_bundle(ca_cert))
    return {
        "HTTPS_PROXY": proxy_url,
        "https_proxy": proxy_url,  # some stacks read only the lower-case name
        "NODE_EXTRA_CA_CERTS": str(ca_cert),
        "NODE_USE_ENV_PROXY": "1",  # Node 22's own fetch ignores HTTPS_PROXY without it
        "SSL_CERT_FILE": bundle,
        "REQUESTS_CA_BUNDLE": bundle,
    }


def harness_env(harness: str, proxy_url: str, ca_cert: Path, session_id: str | None = None) -> dict[str, str]:
    """The variables one harness needs to go through the proxy with no base-URL change: the proxy, and the
    trust variable its HTTP stack reads (``sdk``: the Python SDKs)."""
    env = proxy_env(proxy_url, ca_cert, session_id)
    trust = presets.PRESETS[harness].trust_vars if harness != "sdk" else ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
    wanted = ("HTTPS_PROXY", *trust)
    return {name: env[name] for name in wanted}


class TransparentMitmdump(Service):
    """``mitmdump --mode regular`` on loopback with the addon rerouting ``reroute`` (``polar_reroute``), its CA
    generated into ``confdir`` (never the user's ~/.mitmproxy). ``self.ca_cert`` is the CA to trust."""

    def __init__(self, reroute: str, polar_dir: Path, confdir: Path, *, log: Path, **options: str) -> None:
        port = free_port()
        mitmdump = Path(sys.executable).parent / "mitmdump"
        cmd = [str(mitmdump), "--mode", f"regular@127.0.0.1:{port}", "--set", f"confdir={confdir}"]
        cmd += ["--set", "flow_detail=0", "--set", "termlog_verbosity=warn", "-s", str(ADDON)]
        cmd += ["--set", f"polar_dir={polar_dir}", "--set", f"polar_reroute={reroute}"]
        cmd += [arg for name, value in options.items() for arg in ("--set", f"{name}={value}")]
        super().__init__(cmd, port=port, log=log)
        self.ca_cert = confdir / CA_FILE  # written before mitmdump listens


def run_transparent(
    harness: str,
    prompt: str,
    *,
    workspace: Path,
    proxy_url: str,
    ca_cert: Path,
    session_id: str,
    model: str = "tiny",
    timeout: float = 300.0,
    tools: Sequence[str] | None = None,
    max_tokens: int | None = None,
    home: Path | None = None,
    bin_dir: Path | None = None,
) -> presets.HarnessRun:
    """:func:`eval.harness.presets.run_harness` with the harness on its provider's own URL and only ``proxy_url`` (a
    regular-mode mitmdump with ``polar_reroute``) and ``ca_cert`` added to its environment."""
    preset = presets.PRESETS[harness]
    if preset.provider_url is None:
        raise EvalError(f"{harness} has no transparent mode (no provider URL in its preset)")
    bin_dir = bin_dir or install()
    with contextlib.ExitStack() as stack:
        if home is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"polar-{harness}-home-")))
        home.mkdir(parents=True, exist_ok=True)
        setup = presets.setup(
            harness,
            prompt,
            workspace=workspace,
            home=home,
            base_url=preset.provider_url,
            session_id=session_id,
            model=model,
            tools=tools,
            max_tokens=max_tokens,
        )
        argv, extra = preset.wire(setup)
        # Undo what the preset did only to change the base URL; the rest (model, key, telemetry off) stays.
        extra = {k: v for k, v in extra.items() if k not in BASE_URL_VARS}
        if preset.own_provider:
            extra = preset.own_provider(setup, extra)
        env = presets.base_env(setup.home, bin_dir) | extra | harness_env(harness, proxy_url, ca_cert)
        argv = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
        return presets.run_process(harness, argv, env, setup.workspace, timeout)


@dataclasses.dataclass
class Env:
    """Print the one line to export so HARNESS goes through the proxy with no base-URL change."""

    harness: tyro.conf.Positional[Transparent | Literal["sdk"]]
    """Which harness (``sdk``: the Python SDKs, openai / anthropic / google-genai)."""
    proxy_url: str = "http://127.0.0.1:8080"
    """The regular-mode mitmdump."""
    confdir: Path = Path("~/.mitmproxy")
    """mitmdump's ``confdir``, where it wrote mitmproxy-ca-cert.pem on first start."""
    session: str | None = None
    """Put this session id in the proxy URL (every call of the process filed under it, whatever its key)."""


@dataclasses.dataclass
class Run:
    """Start a regular-mode mitmdump rerouting the provider hosts to UPSTREAM and run one harness through it."""

    harness: tyro.conf.Positional[Transparent]
    """Which harness preset."""
    prompt: tyro.conf.Positional[str]
    """The task, passed to the harness as its non-interactive prompt."""
    upstream: str
    """Our inference server, http[s]://HOST[:PORT] (vLLM, SGLang, python -m eval serve)."""
    session: str
    """Session id, sent as the harness's API key."""
    workspace: Path = Path(".")
    """Folder the harness works in."""
    captures: Path = Path("captures")
    """polar_dir: where the records go."""
    confdir: Path = Path("polar-ca")
    """mitmdump's confdir: the CA it generates and the harness trusts."""
    model: str = "tiny"
    """Model name asked of the upstream (polar_model) and given to the harness."""
    timeout: float = 300.0
    """Seconds before the harness and its children are killed."""


Args = Env | Run


def main(command: Args) -> None:
    if isinstance(command, Env):
        ca_cert = command.confdir.expanduser() / CA_FILE
        if not ca_cert.exists():
            raise SystemExit(f"no {ca_cert}: start mitmdump with --set confdir={command.confdir} once first")
        env = harness_env(command.harness, command.proxy_url, ca_cert.resolve(), command.session)
        print("export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items()))
        return
    command.captures.mkdir(parents=True, exist_ok=True)
    log = command.captures / "mitmdump.log"
    with TransparentMitmdump(
        command.upstream, command.captures, command.confdir.resolve(), log=log, polar_model=command.model
    ) as mitm:
        result = run_transparent(
            command.harness,
            command.prompt,
            workspace=command.workspace,
            proxy_url=mitm.url,
            ca_cert=mitm.ca_cert,
            session_id=command.session,
            model=command.model,
            timeout=command.timeout,
        )
    print(result.stdout, end="")
    print(result.stderr, end="")
    status = "timed out" if result.timed_out else f"exit {result.exit_code}"
    print(f"{result.harness}: {status} after {result.duration_s:.1f} s; records in {command.captures}")
