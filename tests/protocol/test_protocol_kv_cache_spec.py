"""page_size_bytes = num_kv_heads_per_rank * block_size * (head_size + head_size_v) * dtype_bytes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from protocol.kv_cache_spec import (
    KVCacheSizingError,
    blocks_per_request,
    check_fits_one_block,
    max_sliding_window_blocks,
    num_skipped_blocks,
)

# Llama-3.1-8B, bf16, block of 16 tokens: 8 KV heads x 16 tokens x (128 + 128) x 2 bytes
LLAMA_8B_PAGE = 8 * 16 * (128 + 128) * 2


def test_llama_3_1_8b_full_attention_page():
    assert LLAMA_8B_PAGE == 65_536
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
    assert spec.page_size_bytes == 65_536
    # 32 layers in one group: bytes_per_block = 2 MiB
    assert 32 * spec.page_size_bytes == 2 * 2**20


def test_head_size_v_zero_means_equal_to_head_size():
    implicit = FullAttentionSpec(16, 8, 128, 2)
    explicit = FullAttentionSpec(16, 8, 128, 2, head_size_v=128)
    assert implicit.head_size_v == 0
    assert implicit.page_size_bytes == explicit.page_size_bytes == 65_536


@pytest.mark.parametrize(
    "spec,expected",
    [
        (FullAttentionSpec(16, 4, 128, 2), 32_768),  # Llama-3.1-8B at TP=2: 4 heads per rank
        (FullAttentionSpec(16, 1, 128, 2), 8_192),  # TP=8: 1 head per rank
        (FullAttentionSpec(16, 8, 128, 4), 131_072),  # fp32
        (FullAttentionSpec(16, 8, 128, 1), 32_768),  # fp8
        (FullAttentionSpec(32, 8, 128, 2), 131_072),  # block of 32 tokens
        (FullAttentionSpec(16, 8, 192, 2, head_size_v=128), 8 * 16 * (192 + 128) * 2),  # = 81,920
        (FullAttentionSpec(16, 2, 64, 2, head_size_v=32), 2 * 16 * 96 * 2),  # = 6,144
    ],
)
def test_full_attention_page_sizes(spec, expected):
    assert spec.page_size_bytes == expected


def test_sliding_window_page_ignores_the_window():
    for window in (1, 128, 4096, 10**6):
        spec = SlidingWindowSpec(16, 8, 128, 2, sliding_window=window)
        assert spec.page_size_bytes == 65_536


def test_sliding_window_head_size_v():
    spec = SlidingWindowSpec(16, 8, 128, 2, sliding_window=4096, head_size_v=64)
    assert spec.page_size_bytes == 8 * 16 * (128 + 64) * 2 == 49_152
    assert SlidingWindowSpec(16, 8, 128, 2, 4096, head_size_v=0).page_size_bytes == 65_536


def test_page_size_is_not_on_the_wire():
    for cls in (FullAttentionSpec, SlidingWindowSpec):
        assert "page_size_bytes" not in cls.__struct_fields__


def test_specs_are_frozen_and_hashable():
    spec = FullAttentionSpec(16, 8, 128, 2)
    with pytest.raises(AttributeError):
        spec.block_size = 32
    assert {spec: 1}[FullAttentionSpec(16, 8, 128, 2)] == 1
    assert FullAttentionSpec(16, 8, 128, 2) != SlidingWindowSpec(16, 8, 128, 2, 4096)


def test_kv_cache_config_holds_both_spec_kinds():
    cfg = KVCacheConfig(
        10,
        [
            KVCacheGroupSpec(["l0", "l2"], FullAttentionSpec(16, 8, 128, 2)),
            KVCacheGroupSpec(["l1", "l3"], SlidingWindowSpec(16, 8, 128, 2, 512)),
        ],
    )
    # bytes_per_block: sum over a group's layers, max over groups
    per_group = [len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in cfg.kv_cache_groups]
    assert max(per_group) == 131_072


sizes = st.integers(1, 1024)


@given(sizes, sizes, sizes, st.sampled_from([1, 2, 4]), st.integers(0, 1024), st.integers(1, 10**6))
def test_page_size_formula(block_size, heads, head_size, dtype_bytes, head_size_v, window):
    v = head_size_v or head_size
    expected = heads * block_size * (head_size + v) * dtype_bytes
    assert FullAttentionSpec(block_size, heads, head_size, dtype_bytes, head_size_v).page_size_bytes == expected
    assert SlidingWindowSpec(block_size, heads, head_size, dtype_bytes, window, head_size_v).page_size_bytes == expected


@given(st.integers(0, 10_000), st.integers(1, 2048), st.sampled_from([1, 4, 16]))
def test_skipped_blocks_are_exactly_those_before_the_window(num_computed, window, block_size):
    """Token num_computed sees keys [num_computed - window + 1, num_computed]; a skipped block has none of them."""
    skipped = num_skipped_blocks(num_computed, window, block_size)
    first_visible = max(0, num_computed - window + 1)
    assert skipped * block_size <= first_visible  # every skipped block ends before the first visible key
    assert first_visible < (skipped + 1) * block_size  # the next block holds it (or is partly visible)


def test_skipped_blocks_examples():
    assert num_skipped_blocks(0, 4, 4) == 0
    assert num_skipped_blocks(6, 4, 4) == 0  # token 6 sees 3..6: block 0 (0..3) still holds key 3
    assert num_skipped_blocks(7, 4, 4) == 1  # token 7 sees 4..7
    assert num_skipped_blocks(100, 32, 16) == 4  # sees 69..100: blocks 0-3 (0..63) are gone


def test_sliding_window_block_cap():
    # The window behind a chunk's first token (63 tokens), the chunk (256), one partial block: cdiv(319, 16) + 1
    assert max_sliding_window_blocks(64, 16, 256) == 21
    assert max_sliding_window_blocks(1, 16, 16) == 2
    groups = [
        KVCacheGroupSpec(["a"], SlidingWindowSpec(16, 2, 64, 2, 64)),
        KVCacheGroupSpec(["b"], FullAttentionSpec(16, 2, 64, 2)),
    ]
    assert blocks_per_request(groups, 10_000, 256) == 21 + 625  # the window group is capped, the full one is not
    assert blocks_per_request(groups, 100, 256) == 7 + 7


def test_one_block_check_wording():
    check_fits_one_block(8192, 8192)
    with pytest.raises(KVCacheSizingError) as err:
        check_fits_one_block(8191, 8192, "--kv-cache-memory-bytes 8191")
    assert str(err.value) == (
        "No available memory for the cache blocks: one block needs 8,192 bytes but the KV cache budget is 8,191 bytes "
        "(--kv-cache-memory-bytes 8191). Try increasing --kv-cache-memory-bytes; on CUDA, increase "
        "--gpu-memory-utilization or lower --max-num-batched-tokens (it sets the size of the profile run)."
    )
    assert isinstance(err.value, ValueError)
    with pytest.raises(KVCacheSizingError, match="one block needs 8 KiB but the KV cache budget is 1000 B. Try"):
        check_fits_one_block(1000, 8192)
