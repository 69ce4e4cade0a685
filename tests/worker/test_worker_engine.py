"""The real EngineCore (scheduler + ledger) over InProcExecutor: greedy tokens equal transformers',
also when a small pool forces preemptions and when prefix caching serves a second wave."""

import pytest

from engine_core.core import EngineCore
from protocol import SamplingParams
from protocol.config import engine_config
from tests.worker.harness import hf_greedy
from tests.worker.parity_support import FAMILIES, MAX_NEW, preempting_waves, prompts, run_engine
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model

pytest.importorskip("transformers")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("name,num_blocks", [("llama", 12), ("qwen2_sliding", 13)])  # two groups: more ids
def test_engine_with_preemption_and_prefix_cache_matches_transformers(name, num_blocks, tmp_path):
    spec = dict(FAMILIES[name])
    folder = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    asked, got, stats = preempting_waves(folder, num_blocks)
    assert got == hf_greedy(folder, asked, MAX_NEW)
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
