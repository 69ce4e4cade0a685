"""CUDA graphs on a GPU: captured at start-up for the decode sizes, replayed for decode steps, with transformers'
greedy tokens in float32 and bf16 logits within the stated tolerance; --enforce-eager captures nothing and gives
the same tokens. Skipped without CUDA; bench/gpu_check.sh runs it."""

import importlib.util

import pytest
import torch

from protocol.config import engine_config
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import BF16_LOGIT_TOL, FAMILIES, prompts
from worker.model.tiny import write_model
from worker.worker import Worker

# triton is not imported here: test_triton_attention.py must set TRITON_INTERPRET before its first import
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="the graphs replay the Triton kernel: pip install 'kvengine[cuda]'"),
]
pytest.importorskip("transformers")

LENGTHS, OUT_LENS = [3, 17, 40, 75, 9], [10, 8, 6, 4, 2]


@pytest.fixture(scope="module", params=["llama", "qwen2_sliding"])
def folder(request, tmp_path_factory):
    spec = dict(FAMILIES[request.param])
    return write_model(tmp_path_factory.mktemp(request.param), spec.pop("architecture"), eos_token_id=None, **spec)


def cuda_worker(folder, dtype="float32", **kw):
    w = Worker(engine_config(model=str(folder), device="cuda", attention_backend="triton", dtype=dtype,
                             max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=[1 << 26],
                             check_block_tables=True, **kw))
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    return w, cfg


def count_replays(w) -> list[int]:
    """The sizes of the graphs replayed, one entry per replay."""
    sizes, replay = [], w.runner.graphs.replay

    def counting(size):
        out = replay(size)
        if out is not None:
            sizes.append(size)
        return out

    w.runner.graphs.replay = counting
    return sizes


def test_replayed_decode_steps_equal_transformers_and_eager(folder):
    ps = prompts(LENGTHS, seed=4)
    expected = [out[:n] for out, n in zip(hf_greedy(folder, ps, max(OUT_LENS)), OUT_LENS, strict=True)]
    w, cfg = cuda_worker(folder)
    assert sorted(w.runner.graphs.graphs) == [1, 2, 4, 8]
    replays = count_replays(w)
    assert Driver(w, cfg).run(ps, OUT_LENS) == expected
    assert 8 in replays and 4 in replays  # 5 decodes padded to 8, 3 padded to 4
    eager, eager_cfg = cuda_worker(folder, enforce_eager=True)
    assert eager.runner.graphs.graphs == {}
    assert Driver(eager, eager_cfg, chunk=7).run(ps, OUT_LENS) == expected


def test_bfloat16_replayed_logits_stay_within_tolerance_of_transformers_float32(folder):
    """The decode step's logits (a replayed graph) against transformers' fp32 on the same tokens."""
    from transformers import AutoModelForCausalLM

    ps = prompts([3, 17, 40, 75], seed=6)
    w, cfg = cuda_worker(folder, dtype="bfloat16")
    replays = count_replays(w)
    captured, logits = [], w.model.logits
    w.model.logits = lambda h: captured.append(logits(h)) or captured[-1]
    outs = Driver(w, cfg).run(ps, 2)
    assert replays == [4]
    got = captured[1].float().cpu()  # the second step: four decodes
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.stack([hf(torch.tensor([p + o[:1]])).logits[0, -1] for p, o in zip(ps, outs, strict=True)])
    error = (got - want).abs().max() / want.std()
    assert error <= BF16_LOGIT_TOL, float(error)
