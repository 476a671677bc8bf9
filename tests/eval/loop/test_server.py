"""``upstream = "url"``: a server the loop starts with server_command and reaches by server_url (here the reference
server, which takes vLLM's runtime LoRA routes), its adapters loaded, loaded again after a restart, and unloaded."""

import json
import sys
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.errors import EvalError
from eval.loop import run as loop
from eval.sessions.procs import free_port

# PEFT and transformers advise on deprecations: not this test's concern.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def served(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return {m["id"] for m in json.loads(response.read())["data"]}


def test_a_started_server_takes_adapters_again_by_name_and_frees_them_and_stops_with_the_loop(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    adapter = tmp_path / "grpo1"
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    port = free_port()
    command = (sys.executable, "-m", "eval", "serve", "--model", str(tiny_model_dir), "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    with loop.UrlServer(url, command, tmp_path / "server.log") as server:
        assert server.url == url and str(tiny_model_dir) in served(url)  # as vllm serve MODEL names it
        loop.load_adapter(url, "grpo1", adapter)
        # A server that kept it from an earlier attempt answers 400 "already loaded": unloaded, then loaded anew.
        loop.load_adapter(url, "grpo1", adapter)
        assert "grpo1" in served(url)
        loop.unload_adapter(url, "grpo1")
        assert "grpo1" not in served(url)
        proc = server.proc
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None  # stopped with the loop


def test_a_server_url_that_does_not_answer_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EvalError, match=rf"server_url {url}: GET /v1/models does not answer"):
        loop.UrlServer(url, (), log=None)  # type: ignore[arg-type]  # no command: no log is written
