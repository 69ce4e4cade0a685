"""A real chat model over the HTTP API: SmolLM2 (the GGUF from PyPI) answers through the official `openai` client."""

import openai

from tests.e2e.openai_server import start_api_server
from tests.launch.text_support import smollm2_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_chat_over_http_answers_paris_and_stops_at_a_stop_string(start_server):
    gguf = str(smollm2_path())
    api = start_api_server(start_server, "--model", gguf, "--served-model-name", "smollm2",
                           "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB")
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.choices[0].finish_reason in ("stop", "length")

    streamed = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text

    cut = text.index("Paris")
    stopped = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0,
                                             stop=["aris"])
    assert stopped.choices[0].message.content == text[:cut + 1] and stopped.choices[0].finish_reason == "stop"

    japanese = client.completions.create(model="smollm2", prompt="Translate to Japanese: good morning ->",
                                       max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in japanese]
    assert not any("\ufffd" in p for p in pieces)
