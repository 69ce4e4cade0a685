"""The block count the ledger gets for a Gemma-style model (local and global layers) and an MoE model, from an
explicit budget and from the CPU default budget, equals the arithmetic written here."""

import pytest

from engine_core.core import EngineCore
from protocol import FullAttentionSpec, SlidingWindowSpec
from protocol.config import engine_config
from tests.worker.family_support import WINDOW, build_family
from worker.inproc_executor import InProcExecutor

pytest.importorskip("transformers")

MIB, BLOCK, FP32 = 1 << 20, 16, 4
LOCAL_GLOBAL = (["sliding_attention"] * 5 + ["full_attention"]) * 2  # Gemma 3's 5:1, twice


def plan(folder, **settings):
    config = engine_config(model=str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=64,
                           **settings)
    engine = EngineCore(config, InProcExecutor(config))
    engine.shutdown()
    return engine.kv_cache_config


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """12 layers, 10 local (window 24) and 2 global; 4 query heads over 1 KV head of 256 dims (Gemma 3 1B's)."""
    return build_family("gemma3", tmp_path_factory.mktemp("gemma"), num_hidden_layers=12, layer_types=LOCAL_GLOBAL,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Qwen3-MoE, 4 layers (one dense): 2 KV heads of 32 dims; experts hold no KV."""
    return build_family("qwen3_moe", tmp_path_factory.mktemp("moe"))


def test_gemma_layers_group_by_window_and_a_block_id_costs_one_group(gemma):
    page = 1 * BLOCK * (256 + 256) * FP32  # one layer's K and V of one block: 32 KiB
    # 10 local and 2 global layers: groups of gcd(10, 2) = 2 layers, 5 local groups and 1 global
    cfg = plan(gemma, kv_cache_memory_bytes=[4 * MIB])
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    assert [len(g.layer_names) for g in cfg.kv_cache_groups] == [2] * 6
    assert specs.count(SlidingWindowSpec(BLOCK, 1, 256, FP32, WINDOW)) == 5
    assert specs.count(FullAttentionSpec(BLOCK, 1, 256, FP32)) == 1
    assert cfg.num_blocks == 4 * MIB // (2 * page) == 64


def test_gemma_cpu_default_budget_counts_local_layers_by_their_window(gemma):
    # per request of 256 tokens: each local group holds at most cdiv(24 - 1 + 64, 16) + 1 = 7 blocks, the global
    # group 256 / 16 = 16; room for 2 requests and the null block
    cfg = plan(gemma, max_num_seqs=2)
    assert cfg.num_blocks == 2 * (5 * 7 + 16) + 1 == 103


def test_moe_layers_hold_kv_as_dense_ones(moe):
    page = 2 * BLOCK * (32 + 32) * FP32  # 8 KiB
    cfg = plan(moe, kv_cache_memory_bytes=[MIB])
    assert [len(g.layer_names) for g in cfg.kv_cache_groups] == [4]
    assert cfg.kv_cache_groups[0].kv_cache_spec == FullAttentionSpec(BLOCK, 2, 32, FP32)
    assert cfg.num_blocks == MIB // (4 * page) == 32
    assert plan(moe, max_num_seqs=3).num_blocks == 3 * (256 // BLOCK) + 1 == 49
