"""bench/peer_bench.py gives every engine the same dtype and KV bytes: auto resolves as the worker's --dtype auto
does on this CPU, and the KV budget follows the dtype's size."""

import torch

from bench.peer_bench import resolve_dtype, workload_kv_bytes
from worker.ops.cpu_attention import cpu_has_bf16

CONFIG = {"hidden_size": 960, "num_attention_heads": 15, "num_key_value_heads": 5, "num_hidden_layers": 32}


def test_auto_is_the_workers_choice_and_names_pass_through():
    assert resolve_dtype("auto") == ("bfloat16" if cpu_has_bf16() else "float32")
    assert getattr(torch, resolve_dtype("auto")) in (torch.bfloat16, torch.float32)
    assert [resolve_dtype(n) for n in ("bfloat16", "float32")] == ["bfloat16", "float32"]


def test_kv_bytes_follow_the_dtype():
    tokens = 64 * 640
    bf16 = workload_kv_bytes(CONFIG, tokens, "bfloat16")
    per_token = 2 * 32 * 5 * 64 * 2  # K and V, layers, kv heads, head size, bytes
    assert bf16 == -(-per_token * tokens * 5 // 4 // 2**20) * 2**20
    assert workload_kv_bytes(CONFIG, tokens, "float32") in (2 * bf16, 2 * bf16 - 2**20)
