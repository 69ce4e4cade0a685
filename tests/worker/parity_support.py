"""The model families, prompts and workers that the worker parity tests share (no tests in here)."""

import os

import torch

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams, SchedulerStats
from protocol.config import engine_config
from tests.worker.harness import kv_config
from worker.inproc_executor import InProcExecutor
from worker.worker import Worker

MAX_NEW = 10
WINDOW = 24
FAMILIES = {
    "llama": {"architecture": "LlamaForCausalLM"},
    # transformers 5 form: rope_theta inside rope_parameters, with Llama 3 scaling; tied head
    "llama3_tied": {
        "architecture": "LlamaForCausalLM",
        "tie_word_embeddings": True,
        "rope_theta": None,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "qwen2_bias": {"architecture": "Qwen2ForCausalLM", "rope_theta": 1000000.0},
    # layers 2 and 3 slide (i >= max_window_layers), as transformers' Qwen2Config decides
    "qwen2_sliding": {
        "architecture": "Qwen2ForCausalLM", "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2
    },
}


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


RAGGED = prompts([3, 17, 40, 75])


DEVICE = os.environ.get("KVENGINE_TEST_DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda
# The in-place C++ kernel is CPU-only; on CUDA both names resolve to the torch path.
BACKENDS = ["cpu", "torch"] if DEVICE == "cpu" else ["torch"]


BF16_LOGIT_TOL = 0.05  # of the logits' spread: bf16 weights, activations and KV cache; fp32 accumulation and norms


def make_worker(folder, backend, **kw):
    w = Worker(engine_config(
        attention_backend=backend,
        model=str(folder),
        device=DEVICE,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=[1 << 26],
        check_block_tables=True,
        **kw,
    ))
    assert w.runner.attention_backend == backend
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    return w, cfg


def padded_worker(folder, sizes, backend="cpu", max_num_seqs=256):
    w = Worker(engine_config(attention_backend=backend, model=str(folder), device="cpu", dtype="float32",
                             max_model_len=256, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=[1 << 26],
                             check_block_tables=True))
    w.runner.cuda_graph_sizes = sizes  # what the worker sets on CUDA; here the padded batches run eagerly
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    return w, cfg


def record_fills(w) -> list[tuple[int, int, int]]:
    """(real requests, padded tokens, padded requests) of every step the runner fills."""
    seen, fill = [], w.runner.kv.buffers.fill

    def recording(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs):
        seen.append((len(rows), num_padded_tokens, num_padded_reqs))
        return fill(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs)

    w.runner.kv.buffers.fill = recording
    return seen


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run_engine(engine: EngineCore, waves: list[list[list[int]]], params=GREEDY) -> list[list[int]]:
    """Outputs of each wave's prompts, a wave added once the previous one has finished."""
    outs = []
    for w, wave in enumerate(waves):
        got: dict[str, list[int]] = {f"{w}-{i}": [] for i in range(len(wave))}
        for i, p in enumerate(wave):
            engine.add_request(EngineCoreRequest(f"{w}-{i}", p, params, arrival_time=0.0))
        while engine.has_work():
            for o in engine.step().outputs:
                assert o.error is None, o.error
                got[o.request_id] += o.new_token_ids
        outs += got.values()
    return outs


def preempting_waves(folder, num_blocks: int, params=GREEDY, make_executor=InProcExecutor,
                     **settings) -> tuple[list[int], list[list[int]], SchedulerStats]:
    """Two waves through an in-process engine whose small pool forces preemption and whose second wave hits the
    first's prefixes: (the prompts, outputs (greedy by default), stats). make_executor: config -> the executor."""
    first = prompts([70, 45, 33, 52, 20, 64], seed=4)
    second = [first[0][:48] + [9, 9], first[3] + [1, 2, 3]]
    config = engine_config(dtype="float32", model=str(folder), max_model_len=96, max_num_seqs=8,
                           max_num_batched_tokens=48, kv_cache_memory_bytes=[1 << 24],
                           num_gpu_blocks_override=num_blocks, check_block_tables=True, **settings)
    engine = EngineCore(config, make_executor(config))
    try:
        return first + second, run_engine(engine, [first, second], params), engine.get_stats()
    finally:
        engine.shutdown()

