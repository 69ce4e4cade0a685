"""Log-probabilities through the native client and the HTTP API, against transformers' own (float32)."""

import asyncio

import openai
import pytest
import torch

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.openai_server import SMALL, start_api_server

pytest.importorskip("transformers")
PROMPT = [5, 17, 300, 42, 9, 77, 81]
FP32 = ("--dtype", "float32")


def hf_logprobs(model_folder: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(tokens), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture
def model_folder(tmp_path):
    from launch.cli import main

    folder = str(tmp_path / "tiny")
    assert main(["make-model", folder]) == 0
    return folder


def test_native_logprobs_are_transformers_and_the_greedy_token_is_the_most_likely(start_server, model_folder):
    server = start_server("--model", model_folder, *FP32, *SMALL)
    asyncio.run(server.wait_ready())

    async def run():
        async with AsyncEngineClient(server.address) as client:
            outs = [o async for o in client.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                                            ignore_eos=True))]
            plain = [o async for o in client.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))]
            return outs, plain

    outs, plain = asyncio.run(run())
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert len(logprobs) == len(tokens) == 6
    expected = hf_logprobs(model_folder, PROMPT, tokens)
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.top_token_ids[0] == token and lp.top_logprobs[0] == lp.logprob  # greedy: the most likely
        assert len(lp.top_token_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
        top = expected[i].topk(3)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    assert all(o.logprobs is None for o in plain)  # only when asked


def test_http_logprobs_in_openais_completion_and_chat_shapes(start_server):
    api = start_api_server(start_server, *SMALL)
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused")
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # greedy: no alternative is likelier than the token taken (tokens that decode alike share one key)
    assert all(1 <= len(top) <= 2 and max(top.values()) <= p + 1e-6
               for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == done.choices[0].text
    sampled = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=1.5, seed=3,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    sampled = sampled.choices[0].logprobs  # tokens as ids: no two share a key, as two that decode alike would
    # each map holds the token taken, also where it was not the most likely (OpenAI: up to logprobs + 1 entries)
    assert any(len(top) == 2 for top in sampled.top_logprobs)
    for t, top, p in zip(sampled.tokens, sampled.top_logprobs, sampled.token_logprobs, strict=True):
        assert len(top) <= 2 and top[t] == pytest.approx(p), (t, top, p)
    streamed = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                         stream=True)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [t for c in chunks for t in c.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    for body, param in [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                        ({"top_logprobs": 2}, "top_logprobs")]:
        status, error = api.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
        assert status == 400 and error["error"]["param"] == param, error
