"""The real EngineCore (scheduler + ledger) over InProcExecutor: greedy tokens equal transformers',
also when a small pool forces preemptions and when prefix caching serves a second wave."""

import pytest

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from tests.worker.harness import hf_greedy
from tests.worker.parity_support import FAMILIES, MAX_NEW, prompts
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model

pytest.importorskip("transformers")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run_engine(engine: EngineCore, waves: list[list[list[int]]], params=GREEDY) -> list[list[int]]:
    outs = []
    for w, wave in enumerate(waves):
        got = {f"{w}-{i}": [] for i in range(len(wave))}
        for i, p in enumerate(wave):
            engine.add_request(EngineCoreRequest(f"{w}-{i}", p, params, arrival_time=0.0))
        while engine.has_work():
            for o in engine.step().outputs:
                assert o.error is None, o.error
                got[o.request_id] += o.new_token_ids
        outs += got.values()
    return outs


@pytest.mark.parametrize("name,num_blocks", [("llama", 12), ("qwen2_sliding", 13)])  # two groups: more ids
def test_engine_with_preemption_and_prefix_cache_matches_transformers(name, num_blocks, tmp_path):
    spec = dict(FAMILIES[name])
    folder = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    first = prompts([70, 45, 33, 52, 20, 64], seed=4)
    second = [first[0][:48] + [9, 9], first[3] + [1, 2, 3]]
    config = engine_config(
        dtype="float32",
        model=str(folder),
        max_model_len=96,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        kv_cache_memory_bytes=[1 << 24],
        num_gpu_blocks_override=num_blocks,
        check_block_tables=True,
    )
    engine = EngineCore(config, InProcExecutor(config))
    try:
        got = run_engine(engine, [first, second])
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert got == hf_greedy(folder, first + second, MAX_NEW)
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_seeded_sampling_survives_preemption(tmp_path):
    """Same seeds give the same tokens whether or not a small pool preempts and recomputes."""
    folder = write_model(tmp_path, eos_token_id=None)
    batch = prompts([70, 45, 33, 52, 20, 64], seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=MAX_NEW, ignore_eos=True)
    results, preemptions = [], []
    for num_blocks in (12, 64):
        config = engine_config(model=str(folder), dtype="float32", max_model_len=96, max_num_batched_tokens=48,
                               kv_cache_memory_bytes=[1 << 24], num_gpu_blocks_override=num_blocks)
        engine = EngineCore(config, InProcExecutor(config))
        results.append(run_engine(engine, [batch], params))
        preemptions.append(engine.get_stats().num_preemptions)
        engine.shutdown()
    assert preemptions[0] > 0 and preemptions[1] == 0
    assert results[0] == results[1]
