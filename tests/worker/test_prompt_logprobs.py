"""Prompt log-probabilities through the engine core and the real worker equal transformers' float32 log-softmax of
the same prompt (within 1e-4): in one prefill, across a chunked prefill, and when the prefix is cached."""

import pytest
import torch

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from tests.worker.parity_support import prompts
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model

pytest.importorskip("transformers")

TOL = 1e-4
PROMPT = prompts([45], seed=7)[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", eos_token_id=None)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' float32 log-softmax at every position of PROMPT: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def engine(folder, **kw) -> EngineCore:
    config = engine_config(**{"model": str(folder), "dtype": "float32", "max_model_len": 256,
                              "check_block_tables": True, "kv_cache_memory_bytes": [8 << 20], **kw})
    return EngineCore(config, InProcExecutor(config))


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Every output of each request, merged: {id: (token ids, prompt logprobs, cached tokens)}."""
    for rid, prompt, params in requests:
        assert core.add_request(EngineCoreRequest(rid, prompt, params, 0.0)) is None
    got: dict = {rid: ([], None, 0) for rid, _, _ in requests}
    while core.has_work():
        for out in core.step().outputs:
            tokens, prompt_lps, _ = got[out.request_id]
            lps = out.prompt_logprobs if prompt_lps is None else prompt_lps
            got[out.request_id] = (tokens + out.new_token_ids, lps, out.num_cached_tokens)
    return got


def assert_matches(prompt_lps, reference, k: int) -> None:
    assert len(prompt_lps) == len(PROMPT) - 1
    for p, lp in enumerate(prompt_lps):
        row = reference[p]
        assert lp.logprob == pytest.approx(float(row[PROMPT[p + 1]]), abs=TOL)
        assert lp.rank == int((row > row[PROMPT[p + 1]]).sum()) + 1
        best = row.topk(k)
        assert lp.top_token_ids == best.indices.tolist()
        assert lp.top_logprobs == pytest.approx(best.values.tolist(), abs=TOL)


def test_one_prefill(folder, reference):
    core = engine(folder)
    try:
        got = run(core, [("r", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3))])
    finally:
        core.shutdown()
    tokens, prompt_lps, _ = got["r"]
    assert len(tokens) == 3
    assert_matches(prompt_lps, reference, 3)


def test_chunked_prefill(folder, reference):
    core = engine(folder, max_num_batched_tokens=16, max_model_len=64)
    try:
        got = run(core, [("r", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)),
                         ("other", PROMPT[:20], SamplingParams(max_tokens=4, prompt_logprobs=0))])
    finally:
        core.shutdown()
    assert_matches(got["r"][1], reference, 2)
    assert [lp.top_token_ids for lp in got["other"][1]] == [[]] * 19


def test_a_cached_prefix_is_computed_again_for_them(folder, reference):
    """As in vLLM, a request that asks for prompt log-probabilities skips the prefix cache; others still hit."""
    core = engine(folder)
    try:
        first = run(core, [("warm", PROMPT, SamplingParams(max_tokens=1))])
        again = run(core, [("r", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))])
        hit = run(core, [("hit", PROMPT, SamplingParams(max_tokens=1))])
    finally:
        core.shutdown()
    assert first["warm"][1] is None and first["warm"][2] == 0
    assert again["r"][2] == 0
    assert_matches(again["r"][1], reference, 1)
    assert hit["hit"][2] == 32  # two full blocks of 16


def test_a_one_token_prompt_has_an_empty_list(folder):
    core = engine(folder)
    try:
        got = run(core, [("r", [5], SamplingParams(max_tokens=1, prompt_logprobs=1))])
    finally:
        core.shutdown()
    assert got["r"][1] == []
