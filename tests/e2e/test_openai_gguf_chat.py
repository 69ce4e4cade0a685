"""A Qwen2-style GGUF file over the HTTP API: random weights, a byte-level tokenizer trained in Qwen2's style and a
chat template, written as llama.cpp's conversion lays them out. The prompt ids the server's template and tokenizer
give are transformers' apply_chat_template ids on the same tokenizer, /v1/chat/completions answers with the text of
its tokens, and `kvengine generate --prompt` reads the same file."""

import subprocess
import sys

import pytest

from tests.e2e.openai_server import SMALL, start_api_server

pytest.importorskip("gguf")
pytest.importorskip("transformers")
from tests.protocol.gguf_vocab import add_byte_level_vocab
from tests.protocol.trained_tokenizers import QWEN2_CHAT, qwen2_tokenizer
from tests.worker.test_model_gguf import write_gguf
from worker.model.tiny import write_model

VOCAB = 448  # the model's rows: the tokenizer's ids and unused ones past them, as a real model pads its vocabulary
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "naïve café — 1234567 <tool_call>{\"a\": 1}</tool_call>\n\ttabs  and   spaces \U0001f999"},
]


def write_qwen2_gguf(tmp_path):
    hf = qwen2_tokenizer()
    folder = write_model(tmp_path / "hf", "Qwen2ForCausalLM", vocab_size=VOCAB)
    path = tmp_path / "qwen2.gguf"

    def add_vocab(w):
        add_byte_level_vocab(w, hf.backend_tokenizer, "qwen2", eos="<|im_end|>", vocab_size=VOCAB)
        w.add_chat_template(QWEN2_CHAT)

    write_gguf(folder, path, add_vocab)
    return hf, path


def test_qwen2_gguf_chat_over_http_has_transformers_template_ids(tmp_path, start_server):
    hf, path = write_qwen2_gguf(tmp_path)
    expected = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert hf.convert_tokens_to_ids("<tool_call>") in expected and hf.convert_tokens_to_ids("<|im_start|>") in expected
    api = start_api_server(start_server, "--model", str(path), "--served-model-name", "q", *SMALL)

    status, body = api.request("POST", "/tokenize", {"model": "q", "messages": MESSAGES})
    assert status == 200 and body["tokens"] == expected, body
    status, body = api.request("POST", "/tokenize", {"model": "q", "prompt": MESSAGES[1]["content"]})
    assert status == 200 and body["tokens"] == hf.encode(MESSAGES[1]["content"]), body

    request = {"model": "q", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}
    status, body = api.request("POST", "/v1/chat/completions", request)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(expected)
    choice = body["choices"][0]
    assert choice["message"]["content"] == hf.decode(choice["token_ids"], skip_special_tokens=True)


def test_generate_prompt_reads_the_tokenizer_of_a_qwen2_gguf(tmp_path):
    _, path = write_qwen2_gguf(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--model", str(path), "--prompt",
                           MESSAGES[1]["content"], "--max-tokens", "3", "--ignore-eos", *SMALL],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "finished: length, 3 tokens" in proc.stderr
