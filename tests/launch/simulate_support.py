"""Shared pieces of the simulate tests: a hand-written trace with hand-computed hits, and configs."""

import dataclasses
import json
from typing import Any

from launch.simulate.replay import SimConfig
from launch.simulate.trace import TraceRequest, parse_trace_lines
from protocol.config import EngineConfig, engine_config

# A hand-written trace. Blocks are 512 tokens; the last block of a prompt may be partial.
#   r0  [1,2]     1024 tokens: nothing seen before                                     -> 0
#   r1  [1,2,3]   1500 tokens: [1,2] seen whole                                        -> 1024
#   r2  [1,4]      600 tokens: [1] seen; [1,4] new (block 4 holds 88 tokens here)      -> 512
#   r3  [1,2]     1024 tokens: the whole prompt seen, but the last token is computed:
#                 min(1024, 1023) rounded down to the block size -> 1008 (bs 16), 512 (bs 512)
#   r4  [1,2,3]   1300 tokens: r1 had 476 tokens of block 3, r4 has 276: 1024 + 276 = 1300,
#                 capped at 1299 -> 1296 (bs 16), 1024 (bs 512)
#   r5  [1,4,8]   1100 tokens: block 4 is full here but r2 had only its first 88 tokens:
#                 512 + 88 = 600 -> 592 (bs 16), 512 (bs 512); block 8 is never reached
#   r6  [9]        100 tokens: new                                                     -> 0
HAND_TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 20, "input_length": 600, "output_length": 2, "hash_ids": [1, 4]},
    {"timestamp": 30, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 40, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 50, "input_length": 1100, "output_length": 3, "hash_ids": [1, 4, 8]},
    {"timestamp": 60, "input_length": 100, "output_length": 2, "hash_ids": [9]},
]
HAND_PROMPT_TOKENS = 1024 + 1500 + 600 + 1024 + 1300 + 1100 + 100  # 6648
HAND_HITS = {
    16: [0, 1024, 512, 1008, 1296, 592, 0],  # 4432
    64: [0, 1024, 512, 960, 1280, 576, 0],  # 1023 -> 960, 1299 -> 1280, 600 -> 576
    512: [0, 1024, 512, 512, 1024, 512, 0],  # 3584
}

SIM_FIELDS = {f.name for f in dataclasses.fields(SimConfig)}


def hand_trace() -> list[TraceRequest]:
    return parse_trace_lines(json.dumps(r) for r in HAND_TRACE)


def fast_config(**settings: Any) -> tuple[EngineConfig, SimConfig]:
    """Engine settings (xxhash unless given) and the replay's own, from one set of keywords."""
    settings.setdefault("prefix_caching_hash_algo", "xxhash")
    sim = {name: settings.pop(name) for name in list(settings) if name in SIM_FIELDS}
    return engine_config(**settings), SimConfig(**sim)


def write_trace(tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in HAND_TRACE) + "\n")
    return str(path)
