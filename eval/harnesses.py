"""Run the real agent harness CLIs non-interactively through the capture proxy, isolated; install them from npm.

    python -m eval.harnesses install       # npm install of tests/harness/package.json, once per version set
    python -m eval.harnesses run pi "Fix the bug." --base-url http://127.0.0.1:8080 --session s1 --workspace /tmp/ws
    python -m eval.harnesses run shell "Fix the bug." --command 'my-agent {instruction}' --base-url URL --session s1

One preset per harness (``codex``, ``claude-code``, ``pi``, ``qwen-code``, ``gemini``) writes that harness's
config into a fresh HOME, points its base URL at the proxy, and passes the session id as its API key (the addon
maps the key to the session, see addon/session.py). Two more need no npm: ``mini``, the small built-in agent of
eval/mini.py, and ``shell``, any command with ``{instruction}`` replaced by the shell-quoted prompt, which finds
the proxy and the session in ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (``.../v1``), ``ANTHROPIC_BASE_URL``/
``ANTHROPIC_API_KEY``, ``GOOGLE_GEMINI_BASE_URL``/``GEMINI_API_KEY`` and ``POLAR_SESSION_ID``.

The environment is built from scratch, so no key, proxy or config of the caller's leaks in; telemetry, update
checks and other nonessential traffic are off; stdin is /dev/null; the whole process group is killed at the
timeout. Wiring facts: shared/reference/stack.md §3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import tyro

__all__ = ["CACHE", "HARNESSES", "NPM_HARNESSES", "PACKAGE_JSON", "HarnessRun", "NpmMissing", "install", "run_harness"]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_JSON = ROOT / "tests" / "harness" / "package.json"
CACHE = ROOT / "tests" / ".cache" / "harness"
INSTALLED = ".installed"  # written last: its presence means the install finished
API_KEY_ENV = "POLAR_API_KEY"  # where presets that read the key from a named variable find it

Name = Literal["codex", "claude-code", "pi", "qwen-code", "gemini", "mini", "shell"]


class NpmMissing(RuntimeError):
    """npm is not on PATH, so the harness CLIs cannot be installed."""


@dataclasses.dataclass(frozen=True)
class HarnessRun:
    """What one harness run did."""

    harness: str
    command: list[str]
    exit_code: int | None  # None when it was killed at the timeout
    timed_out: bool
    stdout: str
    stderr: str
    duration_s: float


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a preset needs to wire one run."""

    prompt: str
    workspace: Path
    home: Path
    base_url: str  # the proxy, without /v1
    session_id: str
    model: str
    tools: tuple[str, ...] | None  # only these built-in tools; None: the harness's default set
    max_tokens: int | None  # output cap per model call; None: the harness's default
    command: str | None  # the shell preset's command line, with {instruction} where the prompt goes
    max_turns: int | None = None  # model calls per session at most (mini only); None: the harness's default


# A preset writes its config files under setup.home and returns (argv, extra environment).
Preset = Callable[[Setup], tuple[list[str], dict[str, str]]]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _refuse(harness: str, option: str, value: object) -> None:
    if value is not None:
        raise ValueError(f"{harness} has no setting for {option}")


def _codex(s: Setup) -> tuple[list[str], dict[str, str]]:
    # Codex sends no output cap, and with the switches below only its 4 plain function tools.
    _refuse("codex", "tools", s.tools)
    _refuse("codex", "max_tokens", s.max_tokens)
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
    _refuse("gemini", "max_tokens", s.max_tokens)
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
    _refuse("mini", "tools", s.tools)  # its one tool is bash
    prompt_file = s.home / "prompt.txt"  # a file, not an argument: issue texts can pass the argv size limit
    _write(prompt_file, s.prompt)
    # -P: the workspace (the cwd) must not shadow our modules; the venv's editable install finds eval.mini.
    argv = [sys.executable, "-P", "-m", "eval.mini", "--base-url", s.base_url + "/v1", "--api-key", s.session_id]
    argv += ["--model", s.model, "--workspace", str(s.workspace), "--prompt-file", str(prompt_file)]
    if s.max_tokens is not None:
        argv += ["--max-tokens", str(s.max_tokens)]
    if s.max_turns is not None:
        argv += ["--max-steps", str(s.max_turns)]
    return argv, {}


def _shell(s: Setup) -> tuple[list[str], dict[str, str]]:
    _refuse("shell", "tools", s.tools)
    _refuse("shell", "max_tokens", s.max_tokens)
    if not s.command or "{instruction}" not in s.command:
        raise ValueError("the shell harness needs a command with {instruction} in it, e.g. 'my-agent -p {instruction}'")
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


HARNESSES: dict[str, Preset] = {
    "codex": _codex,
    "claude-code": _claude_code,
    "pi": _pi,
    "qwen-code": _qwen_code,
    "gemini": _gemini,
    "mini": _mini,
    "shell": _shell,
}
NPM_HARNESSES = frozenset({"codex", "claude-code", "pi", "qwen-code", "gemini"})  # the CLIs that install() brings


def base_env(home: Path, bin_dir: Path | None) -> dict[str, str]:
    """A fresh environment: nothing of the caller's (keys, proxies, configs) reaches the harness."""
    path = os.environ.get("PATH", os.defpath)
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
    """Run ``harness`` on ``prompt`` in ``workspace`` against ``base_url`` (the proxy, without /v1).

    ``tools`` keeps only those of the harness's built-in tools (its own names) and ``max_tokens`` caps each call's
    output, for models whose context the full tool list or the default cap would overrun; a harness without such a
    setting raises ValueError. ``command`` is the ``shell`` harness's command line. ``home`` (default: a temporary
    folder, removed afterwards) receives the harness's config and state; pass one to keep its logs. ``bin_dir``
    defaults to the installed CLIs (:func:`install`), which only the npm harnesses need.
    """
    preset = HARNESSES[harness]
    if harness in NPM_HARNESSES:
        bin_dir = bin_dir or install()
    with contextlib.ExitStack() as stack:
        if home is None:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"polar-{harness}-home-")))
        home.mkdir(parents=True, exist_ok=True)
        setup = Setup(
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
        if max_turns is not None and harness != "mini":
            raise ValueError(f"{harness} has no setting for max_turns (only mini has)")
        argv, extra = preset(setup)
        env = base_env(setup.home, bin_dir) | extra
        argv = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
        return run_process(harness, argv, env, setup.workspace, timeout)


def run_process(harness: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> HarnessRun:
    # Output goes to files, not pipes: a tool's background child that keeps a pipe open would hang the read.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        duration = time.monotonic() - start
        # The harness's own process group: shell tools and helpers it left running go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return HarnessRun(harness, argv, code, code is None, stdout, stderr, round(duration, 3))


def install(package_json: Path = PACKAGE_JSON, cache: Path = CACHE) -> Path:
    """Install the CLIs pinned in ``package_json`` once, under ``cache/<hash of package_json>``; returns the
    ``node_modules/.bin`` folder. A file lock lets parallel test workers and rollouts share one install; a
    version bump changes the hash, installs afresh and removes the old install."""
    spec = package_json.read_bytes()
    lock_file = package_json.with_name("package-lock.json")
    lock = lock_file.read_bytes() if lock_file.exists() else b""
    key = hashlib.sha256(spec + lock).hexdigest()[:16]
    target = cache / key
    bin_dir = target / "node_modules" / ".bin"
    if (target / INSTALLED).exists():
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissing("npm is not on PATH: install Node.js with npm to run the harness CLIs")
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".lock"):
        if (target / INSTALLED).exists():  # another process finished it while we waited
            return bin_dir
        shutil.rmtree(target, ignore_errors=True)  # a half-done install from a killed run
        target.mkdir()
        (target / "package.json").write_bytes(spec)
        if lock:  # the shipped lock pins the transitive packages too; `npm install` follows it
            # (`npm ci` would refuse it: npm leaves other platforms' optional packages out of the lock)
            (target / "package-lock.json").write_bytes(lock)
        cmd = [npm, "install", "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error"]
        done = subprocess.run(cmd, cwd=target, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed in {target} ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        (target / INSTALLED).write_text(json.dumps({"package_json": str(package_json), "t": time.time()}))
        for old in cache.iterdir():
            if old.is_dir() and old.name != key:
                shutil.rmtree(old, ignore_errors=True)
    return bin_dir


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def main(command: Install | Run) -> None:
    if isinstance(command, Install):
        print(install(command.package_json, command.cache))
        return
    from eval.services import check_proxy  # here: eval.services is not needed to install the CLIs

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


if __name__ == "__main__":
    main(tyro.extras.subcommand_cli_from_dict({"install": Install, "run": Run}))
