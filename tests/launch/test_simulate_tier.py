"""kvengine simulate with a disk tier (--kv-disk-tokens): the real engine-core side of the tier over an in-memory
index, loads priced by the cost model. A memory cache too small to keep a prefix between its uses hits with the
tier up to the infinite cache's ceiling; a tier of one block adds nothing; loading costs simulated time."""

import json

from launch.simulate.replay import Replay, SimConfig
from launch.simulate.tier import TierModel
from launch.simulate.trace import parse_trace_lines
from protocol.config import engine_config

# Three conversations of 4 blocks of 512 tokens each, taken up in turn twice: with room for one conversation in
# memory, each second turn finds its prefix evicted; with the tier it finds it on disk.
TRACE = [{"timestamp": 10 * i, "input_length": 2048 + 100 * (i // 3), "output_length": 2,
          "hash_ids": [10 * (i % 3) + j for j in range(4)] + ([99 + i] if i >= 3 else [])} for i in range(6)]


def replay(kv_disk: TierModel | None):
    requests = parse_trace_lines([json.dumps(r) for r in TRACE])
    config = engine_config(block_size=16, max_num_seqs=4, max_num_batched_tokens=4096)
    sim = SimConfig(kv_cache_tokens=2600, as_fast_as_possible=False, kv_disk=kv_disk)
    return Replay(requests, config, sim).run(keep_per_request=True)


def test_the_tier_brings_evicted_prefixes_back_up_to_the_ceiling():
    memory = replay(None)
    tiered = replay(TierModel(tokens=10**6))
    assert memory.hit_rate < tiered.hit_rate == tiered.ceiling_hit_rate
    assert tiered.num_cached_tokens == tiered.ceiling_cached_tokens > memory.num_cached_tokens


def test_a_tier_of_one_block_adds_nothing_and_loads_cost_time():
    assert replay(TierModel(tokens=16)).hit_rate == replay(None).hit_rate
    slow, fast = replay(TierModel(tokens=10**6, read_cost_per_token=1e-3)), replay(TierModel(tokens=10**6))
    assert slow.hit_rate == fast.hit_rate and slow.ttft_p99_s > fast.ttft_p99_s
