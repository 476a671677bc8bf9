"""Run the real agent harness CLIs non-interactively through the capture proxy, isolated: one ``Preset`` per CLI.

    python -m eval harness install     # npm install of eval/harness/package.json, once per version set
    python -m eval harness run pi "Fix the bug." --base-url http://127.0.0.1:8080 --session s1 --workspace /tmp/ws
    python -m eval harness run shell "Fix the bug." --command 'my-agent {instruction}' --base-url URL --session s1

``PRESETS`` holds one record per harness (``codex``, ``claude-code``, ``pi``, ``qwen-code``, ``gemini`` from npm;
``mini``, the small built-in agent of eval/harness/mini.py; ``shell``, any command with ``{instruction}`` replaced by
the shell-quoted prompt). A record's ``wire`` writes that harness's config into a fresh HOME, points its base URL at
the proxy and passes the session id as its API key (the addon maps the key to the session, see addon/session.py);
the rest of the record is what rollouts, transparent mode and the demo need to know about it. The ``shell``
command finds the proxy and the session in ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (``.../v1``),
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``, ``GOOGLE_GEMINI_BASE_URL``/``GEMINI_API_KEY`` and
``POLAR_SESSION_ID``.

The environment is built from scratch, so no key, proxy or config of the caller's leaks in; telemetry, update
checks and other nonessential traffic are off; stdin is /dev/null; the whole process group is killed at the
timeout. Wiring facts: shared/reference/stack.md §3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import tyro

from eval.errors import EvalError
from eval.harness.install import CACHE, PACKAGE_JSON, install
from eval.sessions.procs import OutputTail, check_proxy, stop_tree

__all__ = ["PRESETS", "HarnessRun", "Name", "Preset", "Setup", "base_env", "prepare", "run_harness", "run_process"]

API_KEY_ENV = "POLAR_API_KEY"  # where presets that read the key from a named variable find it
MINI = Path(__file__).with_name("mini.py")
# Bytes of a harness's stdout and of its stderr kept, the last ones (--limits.output): the final answer and the
# error are at the end, and a session that prints without end costs this much memory and disk, no more.
OUTPUT_KEEP = 4 << 20


@dataclasses.dataclass(frozen=True)
class HarnessRun:
    """What one harness run did."""

    harness: str
    command: list[str]
    exit_code: int | None  # None when it was killed at the timeout or at a limit
    timed_out: bool
    stdout: str  # its last OUTPUT_KEEP bytes (a first line says so when more was printed)
    stderr: str
    duration_s: float
    stdout_bytes: int = 0  # all it printed
    stderr_bytes: int = 0
    ended_by_limit: str | None = None  # which of the runtime's limits ended it, with the figures

    @classmethod
    def of(
        cls, harness: str, argv: list[str], code: int | None, out: OutputTail, err: OutputTail, duration: float
    ) -> HarnessRun:
        stdout, stderr = out.text(), err.text()
        return cls(harness, argv, code, code is None, stdout, stderr, round(duration, 3), out.size, err.size)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a preset needs to wire one run."""

    prompt: str
    workspace: Path
    home: Path
    base_url: str  # the proxy, without /v1 (transparent mode: the provider's own URL)
    session_id: str
    model: str
    tools: tuple[str, ...] | None  # only these built-in tools; None: the harness's default set
    max_tokens: int | None  # output cap per model call; None: the harness's default
    command: str | None  # the shell preset's command line, with {instruction} where the prompt goes
    max_turns: int | None = None  # model calls per session at most; None: the harness's default


@dataclasses.dataclass(frozen=True)
class Preset:
    """Everything eval knows about one harness CLI. Adding a harness is one entry in ``PRESETS`` (plus, for an npm
    CLI, its pin in package.json)."""

    wire: Callable[[Setup], tuple[list[str], dict[str, str]]]
    """Writes the harness's config under ``setup.home``; returns its argv and the environment added to base_env."""
    npm: bool = False
    """Installed from package.json by eval/harness/install.py."""
    provider_url: str | None = None
    """Transparent mode: the provider's own base URL the harness keeps; None: no transparent mode."""
    trust_vars: tuple[str, ...] = ()
    """Transparent mode: the CA variables its HTTP stack reads."""
    own_provider: Callable[[Setup, dict[str, str]], dict[str, str]] | None = None
    """Transparent mode: undo a base URL that lives in a config file rather than a variable (Codex's)."""
    config_folder: str | None = None
    """The folder it leaves in the workspace, kept out of the agent's patch."""
    tools: bool = True
    """It can be limited to some of its built-in tools (``tools=``)."""
    token_cap: bool = True
    """It can cap a call's output tokens (``max_tokens=``)."""
    turn_cap: bool = False
    """It can cap the model calls of a session (``max_turns=``)."""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _codex(s: Setup) -> tuple[list[str], dict[str, str]]:
    codex_home = s.home / ".codex"
    # Codex 0.171 speaks only the Responses API; wire_api="chat" makes it exit.
    _write(
        codex_home / "config.toml",
        f'model = {json.dumps(s.model)}\nmodel_provider = "polar"\n\n'
        f'[model_providers.polar]\nname = "polar"\nbase_url = {json.dumps(s.base_url + "/v1")}\n'
        f'env_key = "{API_KEY_ENV}"\nwire_api = "responses"\n',
    )
    argv = ["codex", "exec", "--skip-git-repo-check", "--cd", str(s.workspace)]
    # The sandbox would make the workspace read-only; the workspace is a scratch copy anyway.
    argv += ["--dangerously-bypass-approvals-and-sandbox"]
    # Only plain function tools (no multi-agent namespace, goal tools or server-side web search), and no
    # calls home: analytics and plugins are what reach github.com / chatgpt.com at startup.
    argv += ["--disable", "multi_agent", "--disable", "goals", "--disable", "plugins"]
    argv += ["-c", 'web_search="disabled"', "-c", "analytics.enabled=false"]
    return [*argv, s.prompt], {"CODEX_HOME": str(codex_home), API_KEY_ENV: s.session_id}


def _codex_own_provider(s: Setup, env: dict[str, str]) -> dict[str, str]:
    # Codex's built-in "openai" provider: its default URL; `codex exec` reads the key from CODEX_API_KEY.
    (s.home / ".codex" / "config.toml").write_text(f"model = {json.dumps(s.model)}\n")
    return env | {"CODEX_API_KEY": s.session_id}


def _claude_code(s: Setup) -> tuple[list[str], dict[str, str]]:
    argv = ["claude", "-p", s.prompt, "--model", s.model, "--output-format", "json"]
    argv += ["--permission-mode", "bypassPermissions"]
    if s.tools is not None:
        argv += ["--tools", ",".join(s.tools)]
    env = {
        "ANTHROPIC_BASE_URL": s.base_url,
        "ANTHROPIC_API_KEY": s.session_id,
        "CLAUDE_CONFIG_DIR": str(s.home / ".claude"),
        # Side calls (titles, summaries) go to the "small fast" model: the same served model here.
        "ANTHROPIC_SMALL_FAST_MODEL": s.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": s.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    if s.max_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(s.max_tokens)
    if os.geteuid() == 0:
        env["IS_SANDBOX"] = "1"  # else it refuses bypassPermissions as root
    return argv, env


def _pi(s: Setup) -> tuple[list[str], dict[str, str]]:
    agent_dir = s.home / ".pi" / "agent"
    model: dict[str, object] = {"id": s.model}
    if s.max_tokens is not None:
        model["maxTokens"] = s.max_tokens
    provider = {
        "baseUrl": s.base_url + "/v1",
        "api": "openai-completions",
        "apiKey": s.session_id,
        # Chat templates want one leading system message and no reasoning_effort field.
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [model],
    }
    _write(agent_dir / "models.json", json.dumps({"providers": {"polar": provider}}, indent=2))
    argv = ["pi", "-p", s.prompt, "--provider", "polar", "--model", s.model, "--no-session"]
    if s.tools is not None:
        argv += ["--tools", ",".join(s.tools)]
    return argv, {"PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}


def _qwen_code(s: Setup) -> tuple[list[str], dict[str, str]]:
    provider: dict[str, object] = {"id": s.model, "name": s.model, "baseUrl": s.base_url + "/v1", "envKey": API_KEY_ENV}
    if s.max_tokens is not None:  # else it asks for 32000 whatever the context left
        provider["generationConfig"] = {"samplingParams": {"max_tokens": s.max_tokens}}
    settings: dict[str, object] = {
        "modelProviders": {"openai": [provider]},
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": s.model},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    if s.tools is not None:
        # core drops the other built-in tools; eager keeps the rest (agent, skill, goals) out of the request,
        # reachable only through its tool_search / tool_call bridge.
        settings["tools"] = {"core": list(s.tools), "eager": list(s.tools)}
    _write(s.home / ".qwen" / "settings.json", json.dumps(settings, indent=2))
    # 0.24 takes the prompt as a positional argument (-p is deprecated) and runs headless without a TTY.
    return ["qwen", s.prompt, "--yolo"], {API_KEY_ENV: s.session_id, "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}


def _gemini(s: Setup) -> tuple[list[str], dict[str, str]]:
    settings: dict[str, object] = {
        # Without it: "Invalid auth method selected", exit 41.
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    if s.tools is not None:
        settings["tools"] = {"core": list(s.tools)}
    _write(s.home / ".gemini" / "settings.json", json.dumps(settings, indent=2))
    # Naming the model skips the routing call that the default "auto" model makes first.
    argv = ["gemini", "-p", s.prompt, "-m", s.model, "--approval-mode", "yolo"]
    env = {
        "GOOGLE_GEMINI_BASE_URL": s.base_url,
        "GEMINI_API_KEY": s.session_id,  # arrives as x-goog-api-key
        "GEMINI_CLI_TRUST_WORKSPACE": "true",  # else it refuses to run headless (exit 55)
    }
    return argv, env


def _mini(s: Setup) -> tuple[list[str], dict[str, str]]:
    prompt_file = s.home / "prompt.txt"  # a file, not an argument: issue texts can pass the argv size limit
    _write(prompt_file, s.prompt)
    # Run by path with -P: the workspace (the cwd) must not shadow a module, and mini.py imports nothing of ours.
    argv = [sys.executable, "-P", str(MINI), "--base-url", s.base_url + "/v1", "--api-key", s.session_id]
    argv += ["--model", s.model, "--workspace", str(s.workspace), "--prompt-file", str(prompt_file)]
    if s.max_tokens is not None:
        argv += ["--max-tokens", str(s.max_tokens)]
    if s.max_turns is not None:
        argv += ["--max-steps", str(s.max_turns)]
    return argv, {}


def _shell(s: Setup) -> tuple[list[str], dict[str, str]]:
    if not s.command or "{instruction}" not in s.command:
        raise EvalError("the shell harness needs a command with {instruction} in it, e.g. 'my-agent -p {instruction}'")
    env = {
        "OPENAI_BASE_URL": s.base_url + "/v1",
        "OPENAI_API_KEY": s.session_id,
        "ANTHROPIC_BASE_URL": s.base_url,
        "ANTHROPIC_API_KEY": s.session_id,
        "GOOGLE_GEMINI_BASE_URL": s.base_url,
        "GEMINI_API_KEY": s.session_id,
        "POLAR_SESSION_ID": s.session_id,
    }
    return ["bash", "-c", s.command.replace("{instruction}", shlex.quote(s.prompt))], env


# Node adds NODE_EXTRA_CA_CERTS to its own roots (NODE_USE_ENV_PROXY makes its fetch use HTTPS_PROXY); Codex
# (Rust) replaces its roots with SSL_CERT_FILE, hence a full bundle there (eval/harness/transparent.py).
NODE = ("NODE_EXTRA_CA_CERTS", "NODE_USE_ENV_PROXY")
OPENAI = "https://api.openai.com"
ANTHROPIC = "https://api.anthropic.com"
GOOGLE = "https://generativelanguage.googleapis.com"

PRESETS: dict[str, Preset] = {
    # Codex sends no output cap, and with its switches only its 4 plain function tools.
    "codex": Preset(
        _codex, npm=True, provider_url=OPENAI, trust_vars=("SSL_CERT_FILE",), own_provider=_codex_own_provider,
        config_folder=".codex", tools=False, token_cap=False,
    ),
    "claude-code": Preset(_claude_code, npm=True, provider_url=ANTHROPIC, trust_vars=NODE, config_folder=".claude"),
    "pi": Preset(_pi, npm=True, provider_url=OPENAI, trust_vars=NODE, config_folder=".pi"),
    "qwen-code": Preset(_qwen_code, npm=True, provider_url=OPENAI, trust_vars=NODE, config_folder=".qwen"),
    "gemini": Preset(
        _gemini, npm=True, provider_url=GOOGLE, trust_vars=NODE, config_folder=".gemini", token_cap=False
    ),
    "mini": Preset(_mini, tools=False, turn_cap=True),  # its one tool is bash
    "shell": Preset(_shell, tools=False, token_cap=False),
}  # fmt: skip
# The harness names as a type, for the CLIs' choices; from the registry, so a new entry needs no second edit.
if TYPE_CHECKING:
    Name = str  # a Literal built at run time is tyro's to read, not mypy's
else:
    Name = Literal[tuple(PRESETS)]


def base_env(home: Path, bin_dir: Path | None, system_path: str | None = None) -> dict[str, str]:
    """A fresh environment: nothing of the caller's (keys, proxies, configs) reaches the harness. ``system_path``:
    the PATH after ``bin_dir`` (default: this process's; a container's runtime gives its image's)."""
    path = system_path or os.environ.get("PATH", os.defpath)
    env = {
        "HOME": str(home),
        "USER": os.environ.get("USER", "polar"),
        # Node 22 from the install comes first: the latest Claude Code and Qwen Code need it.
        "PATH": os.pathsep.join([str(bin_dir), path]) if bin_dir else path,
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",  # "dumb" makes Gemini CLI warn on every run
        "NO_COLOR": "1",
        "TMPDIR": str(home / "tmp"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "NO_PROXY": "127.0.0.1,localhost",
    }
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def setup(
    harness: str,
    prompt: str,
    *,
    workspace: Path,
    home: Path,
    base_url: str,
    session_id: str,
    model: str,
    tools: Sequence[str] | None = None,
    max_tokens: int | None = None,
    max_turns: int | None = None,
    command: str | None = None,
) -> Setup:
    """The :class:`Setup` of one run, refusing a setting the harness does not have."""
    preset = PRESETS[harness]
    for option, value, supported in [
        ("tools", tools, preset.tools),
        ("max_tokens", max_tokens, preset.token_cap),
        ("max_turns", max_turns, preset.turn_cap),
    ]:
        if value is not None and not supported:
            raise EvalError(f"{harness} has no setting for {option}")
    return Setup(
        prompt=prompt,
        workspace=workspace.resolve(),
        home=home.resolve(),
        base_url=base_url.rstrip("/"),
        session_id=session_id,
        model=model,
        tools=tuple(tools) if tools is not None else None,
        max_tokens=max_tokens,
        command=command,
        max_turns=max_turns,
    )


def run_harness(
    harness: str,
    prompt: str,
    *,
    workspace: Path,
    base_url: str,
    session_id: str,
    model: str = "tiny",
    timeout: float = 300.0,
    tools: Sequence[str] | None = None,
    max_tokens: int | None = None,
    max_turns: int | None = None,
    command: str | None = None,
    home: Path | None = None,
    bin_dir: Path | None = None,
) -> HarnessRun:
    """Run ``harness`` on ``prompt`` in ``workspace`` on this machine against ``base_url`` (the proxy, without /v1).

    ``tools`` keeps only those of the harness's built-in tools (its own names) and ``max_tokens`` caps each call's
    output, for models whose context the full tool list or the default cap would overrun; a harness without such a
    setting raises EvalError. ``command`` is the ``shell`` harness's command line. ``home`` (default: a temporary
    folder, removed afterwards) receives the harness's config and state; pass one to keep its logs. ``bin_dir``
    defaults to the installed CLIs (eval/harness/install.py), which only the npm harnesses need. Rollouts run it
    through a runtime instead (eval/sessions/runtime.py), which may put it in a container.
    """
    with contextlib.ExitStack() as stack:
        if home is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"polar-{harness}-home-")))
        argv, env = prepare(
            harness,
            prompt,
            workspace=workspace,
            home=home,
            base_url=base_url,
            session_id=session_id,
            model=model,
            tools=tools,
            max_tokens=max_tokens,
            max_turns=max_turns,
            command=command,
            bin_dir=bin_dir,
        )
        argv = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
        return run_process(harness, argv, env, workspace.resolve(), timeout)


def prepare(
    harness: str,
    prompt: str,
    *,
    workspace: Path,
    home: Path,
    base_url: str,
    session_id: str,
    model: str,
    tools: Sequence[str] | None = None,
    max_tokens: int | None = None,
    max_turns: int | None = None,
    command: str | None = None,
    bin_dir: Path | None = None,
    system_path: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the whole environment of one run, its config written under ``home``; ``workspace`` and
    ``base_url`` as the harness will see them (in a container: /testbed and the container's own relay)."""
    preset = PRESETS[harness]
    if preset.npm:
        bin_dir = bin_dir or install()
    home.mkdir(parents=True, exist_ok=True)
    s = setup(
        harness,
        prompt,
        workspace=workspace,
        home=home,
        base_url=base_url,
        session_id=session_id,
        model=model,
        tools=tools,
        max_tokens=max_tokens,
        max_turns=max_turns,
        command=command,
    )
    argv, extra = preset.wire(s)
    return argv, base_env(s.home, bin_dir, system_path) | extra


def run_process(
    harness: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float, *, keep: int = OUTPUT_KEEP
) -> HarnessRun:
    """``argv`` under ``timeout``, its tree stopped afterwards; of its stdout and stderr, the sizes and the last
    ``keep`` bytes each (eval.sessions.procs.OutputTail), so printing without end costs no memory."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    out, err = OutputTail(proc.stdout, keep), OutputTail(proc.stderr, keep)
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    duration = time.monotonic() - start
    stop_tree(proc)  # shell tools and helpers it left running go with it, and with them the pipes' last writers
    return HarnessRun.of(harness, argv, code, out, err, duration)


@dataclasses.dataclass
class Install:
    """Install the pinned harness CLIs (npm) into the cache and print their bin folder."""

    package_json: Path = PACKAGE_JSON
    """The package.json that pins the CLIs."""
    cache: Path = CACHE
    """Folder holding one install per package.json hash."""


@dataclasses.dataclass
class Run:
    """Run one harness on a prompt through the proxy and print its exit code, duration and output."""

    harness: tyro.conf.Positional[Name]
    """Which harness preset."""
    prompt: tyro.conf.Positional[str]
    """The task, passed to the harness as its non-interactive prompt."""
    base_url: str
    """The proxy's base URL, without /v1."""
    session: str
    """Session id, sent as the harness's API key."""
    workspace: Path = Path(".")
    """Folder the harness works in."""
    model: str = "tiny"
    """Model name the harness asks for."""
    timeout: float = 300.0
    """Seconds before the harness and its children are killed."""
    tools: tuple[str, ...] | None = None
    """Only these of the harness's built-in tools (its own names); default: all."""
    max_tokens: int | None = None
    """Output tokens per model call; default: the harness's own cap."""
    command: str | None = None
    """The shell harness's command line, with {instruction} where the shell-quoted prompt goes."""
    home: Path | None = None
    """Keep the harness's HOME (config, logs) here; default: a temporary folder, removed afterwards."""


Args = Install | Run


def main(command: Args) -> None:
    if isinstance(command, Install):
        print(install(command.package_json, command.cache))
        return
    check_proxy(command.base_url)  # a proxy without the capture addon would forward the calls unrecorded
    result = run_harness(
        command.harness,
        command.prompt,
        workspace=command.workspace,
        base_url=command.base_url,
        session_id=command.session,
        model=command.model,
        timeout=command.timeout,
        tools=command.tools,
        max_tokens=command.max_tokens,
        command=command.command,
        home=command.home,
    )
    print(result.stdout, end="")
    print(result.stderr, end="")
    status = "timed out" if result.timed_out else f"exit {result.exit_code}"
    print(f"{result.harness}: {status} after {result.duration_s:.1f} s")
