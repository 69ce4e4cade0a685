"""Helpers of the disk tier's in-process tests: a real EngineCore and in-process worker on the built-in model in
float32, over a tier folder."""

from pathlib import Path

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
PREFIX = [(i * 37) % 900 + 3 for i in range(6 * BLOCK + 5)]  # six full blocks and a bit


def make_engine(path: Path, **settings) -> EngineCore:
    config = engine_config(**{"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": [1 << 24],
                              "max_num_batched_tokens": 64, "kv_disk_path": str(path), "check_block_tables": True,
                              **settings})
    return EngineCore(config, InProcExecutor(config))


def run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY):
    """Tokens and cached prompt tokens per request."""
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for rid, prompt in prompts.items():
        engine.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def served_once(path: Path, prompts: dict[str, list[int]], **settings):
    engine = make_engine(path, **settings)
    try:
        tokens, cached = run(engine, prompts)
        tier = engine.scheduler.kv_connector.stats()
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back
    finally:
        engine.shutdown()
    return tokens, cached, tier


def tier_dir(path: Path) -> Path:
    (only,) = [p for p in path.iterdir() if p.is_dir()]
    return only


def block_files(path: Path) -> list[Path]:
    return sorted((tier_dir(path) / "blocks").rglob("*.kv"))
