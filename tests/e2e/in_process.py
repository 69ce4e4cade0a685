"""The same engine in one process (EngineCore + InProcExecutor): the reference for e2e token checks."""

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor


def in_process_greedy(prompts: list[list[int]], params: SamplingParams, max_model_len: int = 512,
                      kv_cache_memory_bytes: int = 8 << 20, model: str | None = None,
                      dtype: str = "auto") -> list[list[int]]:
    config = engine_config(model=model, dtype=dtype, max_model_len=max_model_len, check_block_tables=True,
                           kv_cache_memory_bytes=[kv_cache_memory_bytes])
    core = EngineCore(config, InProcExecutor(config))
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), prompt, params, 0.0))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while core.has_work():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
        return [tokens[str(i)] for i in range(len(prompts))]
    finally:
        core.shutdown()
