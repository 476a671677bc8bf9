"""Transparent mode end to end: the official SDKs and the Claude Code and Codex CLIs on their providers' own URLs,
with only HTTPS_PROXY and the CA set, reach the reference server through `mitmdump --mode regular` + polar_reroute.

    python -m pytest tests/eval/harness/test_transparent.py -m slow

Every model call is recorded with token ids; a host the proxy is not told about passes unrecorded; capture-only
records calls on their way to the "provider" (the reference server under a name of its own) with no secret on
disk. Each proxy's CA is generated into the test's temporary confdir, never ~/.mitmproxy.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from google import genai
from transformers import AutoTokenizer

from eval.harness.transparent import TransparentMitmdump, harness_env, run_transparent
from eval.sessions.procs import ReferenceServer
from tests.captures import read_records, tokens_of, v1_bytes
from tests.eval.harness.test_harnesses import CASES, COMMAND, FINAL, PROMPT, RUN_TIMEOUT, script, token_ids

pytestmark = pytest.mark.slow

SECRET = "sk-live-0123456789abcdefSECRET"
GOOGLE_SECRET = "AIzaSyD-transparent-SECRET"


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, reference_server, tmp_path_factory):
    """Provider hosts rerouted to the reference server; the same server, named by its address, capture-only."""
    tmp = tmp_path_factory.mktemp("transparent")
    upstream = reference_server(tiny_model_dir)
    address = upstream.removeprefix("http://")
    with TransparentMitmdump(
        upstream, tmp / "captures", tmp / "conf", log=tmp / "mitmdump.log", polar_model="tiny", polar_capture=address
    ) as mitm:
        mitm.captures, mitm.upstream = tmp / "captures", upstream
        yield mitm


@pytest.fixture
def sdk_env(proxy, monkeypatch):
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in harness_env("sdk", proxy.url, proxy.ca_cert).items():
        monkeypatch.setenv(name, value)


def assert_captured(proxy, session, api):
    [record] = read_records(proxy.captures, session=session, expect=1)
    assert (record["api"], record["session_source"], record["complete"]) == (api, "api_key", True), record["error"]
    prompt, sampled, logprobs = tokens_of(record)
    assert prompt and sampled and len(logprobs) == len(sampled)


def test_openai_sdk_chat_and_responses(proxy, sdk_env):
    client = openai.OpenAI(api_key="sdk-openai", max_retries=0, timeout=60)  # api.openai.com, the default
    chat = client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message is not None
    assert_captured(proxy, "sdk-openai", "chat")
    client = openai.OpenAI(api_key="sdk-responses", max_retries=0, timeout=60)
    events = [e.type for e in client.responses.create(model="gpt-5", input="hi", max_output_tokens=4, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    assert_captured(proxy, "sdk-responses", "responses")


def test_anthropic_sdk(proxy, sdk_env):
    client = anthropic.Anthropic(api_key="sdk-anthropic", max_retries=0, timeout=60)
    with client.messages.stream(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        message = s.get_final_message()
    assert message.role == "assistant"
    assert_captured(proxy, "sdk-anthropic", "anthropic")


def test_google_sdk(proxy, sdk_env):
    client = genai.Client(api_key="sdk-google")
    answer = client.models.generate_content(model="gemini-x", contents="hi", config={"max_output_tokens": 4})
    assert answer.candidates
    assert_captured(proxy, "sdk-google", "google")


def test_unnamed_host_passes_unrecorded(proxy):
    # "localhost" is the reference server under a name the proxy was not given.
    other = proxy.upstream.replace("127.0.0.1", "localhost")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(proxy=proxy.url, trust_env=False) as client:
        answer = client.post(f"{other}/v1/chat/completions", json=body, headers={"authorization": "Bearer sdk-pass"})
    assert answer.status_code == 200 and "prompt_token_ids" not in answer.json()  # no token fields were added
    assert read_records(proxy.captures, session="sdk-pass", timeout=1) == []


def test_capture_only_records_without_secrets(proxy):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {SECRET}", "x-goog-api-key": GOOGLE_SECRET, "cookie": "c=SECRET"}
    # The proxy URL's user name files every call of this client under run-7 (the key is a real secret).
    with httpx.Client(proxy=proxy.url.replace("://", "://run-7@"), trust_env=False) as client:
        answer = client.post(f"{proxy.upstream}/v1/chat/completions?key={GOOGLE_SECRET}", json=body, headers=headers)
    assert answer.status_code == 200
    [record] = read_records(proxy.captures, session="run-7", expect=1)
    assert (record["api"], record["upstream"], record["injected"], record["session_source"]) == (
        "chat",
        "plain",
        {},
        "header",
    )
    assert json.loads(record["response_body"])["choices"]
    data = v1_bytes(proxy.captures)
    assert SECRET.encode() not in data and GOOGLE_SECRET.encode() not in data and b"c=SECRET" not in data


CLIS = ("claude-code", "codex")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir, harness_bin, tmp_path_factory):
    """Both CLIs at once, each with its own scripted server and proxy (their scripts name different tools)."""

    def trip(harness):
        tmp, case = tmp_path_factory.mktemp(f"transparent-{harness}"), CASES[harness]
        (tmp / "script.json").write_text(json.dumps(script(case)))
        (tmp / "workspace").mkdir()
        with (
            ReferenceServer(tiny_model_dir, script=tmp / "script.json", log=tmp / "server.log") as server,
            TransparentMitmdump(
                server.url, tmp / "captures", tmp / "conf", log=tmp / "mitmdump.log", polar_model="tiny"
            ) as mitm,
        ):
            run = run_transparent(
                harness,
                PROMPT,
                workspace=tmp / "workspace",
                proxy_url=mitm.url,
                ca_cert=mitm.ca_cert,
                session_id=f"transparent-{harness}",
                timeout=RUN_TIMEOUT,
                tools=case.tools,
                home=tmp / "home",
                bin_dir=harness_bin,
            )
        return run, tmp

    with ThreadPoolExecutor(max_workers=len(CLIS)) as pool:
        yield {harness: pool.submit(trip, harness) for harness in CLIS}


@pytest.mark.timeout(2 * RUN_TIMEOUT + 120)
@pytest.mark.parametrize("harness", CLIS)
def test_cli_round_trip(harness, cli_runs, tokenizer):
    run, tmp = cli_runs[harness].result()
    explain = f"exit {run.exit_code}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}\nlogs: {tmp}"
    assert run.exit_code == 0, explain
    assert (tmp / "workspace" / "proof.txt").read_text() == "written by the agent"
    records = read_records(tmp / "captures")  # mitmdump has stopped: every record is on disk
    assert records, explain
    # Only model calls: policy_limits, HEAD probes and Codex's WebSocket attempt were answered by the proxy.
    assert {(r["api"], r["session_id"], r["session_source"]) for r in records} == {
        (CASES[harness].api, f"transparent-{harness}", "api_key")
    }
    answered = [token_ids(r) for r in records if r["status"] == 200]
    assert answered and all(prompt and completion for prompt, completion in answered)
    # The tool call, then the final answer, as the ids the model sampled (as in tests/eval/harness/test_harnesses.py).
    texts = [tokenizer.decode(completion, skip_special_tokens=True) for _, completion in answered]
    call = next(i for i, text in enumerate(texts) if CASES[harness].tool in text and json.dumps(COMMAND)[1:-1] in text)
    assert any(text.strip() == FINAL for text in texts[call + 1 :]), texts


@pytest.mark.timeout(RUN_TIMEOUT + 120)
def test_rollout_transparent_claude_code_resolves_a_toy_task(tiny_model_dir, harness_bin, tmp_path):
    """python -m eval rollout --transparent: Claude Code on its own URL fixes a toy task through the reroute."""
    import eval.score
    from eval.runs import read_rewards, read_sessions
    from eval.sessions import rollout
    from eval.tasks.load import load_tasks

    task = min(load_tasks("toy"), key=lambda t: len(t["patch"]))
    apply_gold = {"command": f"git apply <<'EOF_GOLD'\n{task['patch']}EOF_GOLD", "description": "Apply the fix"}
    case = CASES["claude-code"]
    steps = [
        {"content": None, "tool_calls": [{"name": case.tool, "arguments": apply_gold}]},
        {"content": FINAL, "tool_calls": []},
    ]
    (tmp_path / "script.json").write_text(json.dumps(steps))
    run = tmp_path / "run"
    with (
        ReferenceServer(tiny_model_dir, script=tmp_path / "script.json", log=tmp_path / "server.log") as server,
        TransparentMitmdump(
            server.url, tmp_path / "captures", tmp_path / "conf", log=tmp_path / "mitm.log", polar_model="tiny"
        ) as mitm,
    ):
        args = rollout.Args(
            tasks="toy",
            instance_ids=(task["instance_id"],),
            harness="claude-code",
            proxy=mitm.url,
            out=run,
            tools=case.tools,
            timeout=RUN_TIMEOUT,
            transparent=True,
            ca_cert=mitm.ca_cert,
        )
        assert rollout.main(args) == 0
    session = read_sessions(run).row(0, named=True)
    assert (session["status"], session["patch"]) == ("ok", task["patch"]), session["error"]
    records = read_records(tmp_path / "captures", session=session["session_id"])
    assert records and {r["api"] for r in records} == {"anthropic"} and all(r["translated"] for r in records)
    assert eval.score.main(eval.score.Args(run)) == 0
    assert read_rewards(run).row(0, named=True)["reward"] == 1.0
