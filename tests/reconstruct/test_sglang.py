"""SGLang end to end: the addon with ``polar_upstream=sglang`` in front of the reference server speaking SGLang's
token fields (``--flavor sglang``), then reconstruction.

The same scripted sessions run once against each flavor; the answers are teacher-forced, so the sampled ids and
log-probs are the same, and the traces must be too, whichever fields carried them.
"""

import json

import openai
import pytest

from eval.sessions.procs import Mitmdump, ReferenceServer
from reconstruct import reconstruct
from tests.captures import read_records

pytestmark = pytest.mark.slow

SCRIPT = [
    {"reasoning": "List first.", "content": None, "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
    {"content": "Two files.", "tool_calls": []},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
    }
]


def run_sessions(model_dir, tmp, flavor):
    tmp.mkdir()
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    with (
        ReferenceServer(model_dir, script=tmp / "script.json", log=tmp / "server.log", flavor=flavor) as server,
        Mitmdump(server.url, tmp / "captures", log=tmp / "mitm.log", polar_upstream=flavor) as mitm,
    ):
        for session, stream in (("streamed", True), ("plain", False)):
            client = openai.OpenAI(base_url=f"{mitm.url}/v1", api_key=session, max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "What files are here?"}]
            for _ in SCRIPT:
                if stream:
                    chunks = list(
                        client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=True)
                    )
                    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
                    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    reasoning = "".join(
                        getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices
                    )
                else:
                    message = (
                        client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS).choices[0].message
                    )
                    calls, content, reasoning = (
                        message.tool_calls or [],
                        message.content,
                        getattr(message, "reasoning", None),
                    )
                turn = {"role": "assistant", "content": content or None, "reasoning": reasoning or None}
                if calls:
                    turn["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
                        for c in calls
                    ]
                messages += [turn] + [{"role": "tool", "tool_call_id": c.id, "content": "a.py b.py"} for c in calls]
            client.close()  # its socket, left to the collector, would fail whichever test it is collected in
        records = read_records(tmp / "captures", expect=4)
    return records, reconstruct([tmp / "captures"])


def test_sglang_fields_give_the_same_traces_as_vllm_fields(tiny_model_dir, tmp_path):
    sglang_records, (sglang, stats) = run_sessions(tiny_model_dir, tmp_path / "sglang", "sglang")
    _, (vllm, _) = run_sessions(tiny_model_dir, tmp_path / "vllm", "vllm")
    for r in sglang_records:
        assert "prompt_token_ids" not in r["response_body"].split('"choices"')[0]  # no vLLM field at the top
        if r["streamed"]:
            assert r["injected"]["return_output_ids_in_sglext"] is True and '"sglext"' in r["response_body"]
        else:
            choice = json.loads(r["response_body"])["choices"][0]
            assert choice["response_token_ids"] and choice["meta_info"]["output_token_logprobs"]
    assert stats.calls == stats.merged_calls == 4 and stats.traces == 2 and stats.dropped == {}
    columns = ["session_id", "prompt_ids", "response_ids", "loss_mask", "n_calls", "finish_reason"]
    assert sglang.sort("session_id").select(columns).equals(vllm.sort("session_id").select(columns))
    for mine, theirs in zip(sglang.sort("session_id")["logprobs"], vllm.sort("session_id")["logprobs"], strict=True):
        assert mine.to_list() == pytest.approx(theirs.to_list(), abs=1e-5)
