"""Whole models over a quantized KV cache, through the parity harness (tiny random models of each parity family,
float32, chunked prefill): int8 gives the same greedy tokens as the model's own KV dtype on the parity prompts, and
every format keeps the first sampled token's logits within a stated distance of them; served through real processes,
an int8 cache holds at least 1.9x the tokens of bf16's in the same memory.

Greedy agreement measured on the parity prompts (tokens equal up to the first difference, of 40, per family):
int8 40/40 in every family in float32 (30-40 with a bfloat16 model, against bf16 KV); fp8_e4m3 31-40; fp8_e5m2
17-40. The random tiny models' logits lie close together, so a small error flips a near tie and every later token.
"""

import re
import subprocess
import sys

import pytest
import torch

from protocol.config import engine_config
from tests.worker.harness import Driver, kv_config
from tests.worker.kv_quant_support import QUANTS
from tests.worker.parity_support import BACKENDS, FAMILIES, MAX_NEW, RAGGED
from worker.model.tiny import write_model
from worker.worker import Worker

# max |logits - the unquantized run's| / their std, first sampled token of every parity prompt (float32): measured
# at most 0.030 (int8), 0.124 (fp8_e4m3), 0.278 (fp8_e5m2) over the four families; the bounds leave about 2x.
LOGIT_BOUND = {"int8": 0.06, "fp8_e4m3": 0.25, "fp8_e5m2": 0.5}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    spec = dict(FAMILIES[request.param])
    return write_model(tmp_path_factory.mktemp(request.param), spec.pop("architecture"), eos_token_id=None, **spec)


def make_worker(folder, backend: str, kv_cache_dtype: str):
    w = Worker(engine_config(attention_backend=backend, model=str(folder), device="cpu", dtype="float32",
                             max_model_len=256, kv_cache_memory_bytes=[1 << 26], check_block_tables=True,
                             kv_cache_dtype=kv_cache_dtype))
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    return w, cfg


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_gives_the_greedy_tokens_of_the_models_own_kv_dtype(family, backend):
    expected = Driver(*make_worker(family, backend, "auto"), chunk=7).run(RAGGED, MAX_NEW)
    assert Driver(*make_worker(family, backend, "int8"), chunk=7).run(RAGGED, MAX_NEW) == expected


def first_logits(folder, kv_cache_dtype: str) -> torch.Tensor:
    w, cfg = make_worker(folder, "cpu", kv_cache_dtype)
    captured = []
    logits = w.model.logits
    w.model.logits = lambda h: captured.append(logits(h)) or captured[-1]
    Driver(w, cfg, chunk=7).run(RAGGED, 1)
    return torch.cat(captured).float()


def test_first_token_logits_stay_within_each_formats_bound(family):
    base = first_logits(family, "auto")
    for quant in QUANTS:
        error = ((first_logits(family, quant) - base).abs().max() / base.std()).item()
        assert error <= LOGIT_BOUND[quant], (quant, error)
    assert (first_logits(family, "int8") - base).abs().max() > 0  # the cache really is quantized


def capacity_tokens(kv_cache_dtype: str) -> int:
    """`kvengine generate` with its own server (real processes) on 64 MiB of KV cache: the tokens its capacity log
    line reports, after a greedy request ran to its end on that cache."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "generate", "--prompt-token-ids", "5,6,7,8,9", "--max-tokens", "6",
         "--ignore-eos", "--dtype", "bfloat16", "--kv-cache-memory-bytes", "64MiB", "--kv-cache-dtype", kv_cache_dtype],
        capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "finished: length, 6 tokens" in proc.stdout + proc.stderr
    found = re.search(r"KV cache size: ([\d,]+) tokens", proc.stderr)
    assert found, proc.stderr[-2000:]
    return int(found.group(1).replace(",", ""))


def test_the_served_capacity_of_an_int8_cache_is_at_least_1_9x_bfloat16s():
    assert capacity_tokens("int8") >= 1.9 * capacity_tokens("auto")
