"""A sweep: one replay per cache size, for hit rate against capacity (like Figure 9 of the Mooncake paper)."""

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise

from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.replay import Replay, SimConfig
from launch.simulate.result import SimResult
from launch.simulate.tokens import TokenSynthesizer
from launch.simulate.trace import TraceRequest
from protocol.config import EngineConfig, with_settings


def log_spaced(lo: float, hi: float, points: int) -> list[int]:
    if points < 1 or lo <= 0 or hi < lo:
        raise ValueError("a sweep needs 0 < min <= max and at least one point")
    if points == 1:
        return [int(lo)]
    ratio = (hi / lo) ** (1 / (points - 1))
    return sorted({round(lo * ratio**k) for k in range(points)})


def sweep_point(config: EngineConfig, sim: SimConfig, tokens: int) -> tuple[EngineConfig, SimConfig]:
    """The settings of the replay with `tokens` usable KV tokens (at least one block)."""
    bs = config.cache.block_size
    tokens = max(int(tokens), bs)
    max_model_len = config.model.max_model_len
    if max_model_len is not None:  # a fixed length the pool cannot hold would fail start-up
        max_model_len = min(max_model_len, tokens // bs * bs)
    return (with_settings(config, num_gpu_blocks_override=None, max_model_len=max_model_len),
            replace(sim, kv_cache_tokens=tokens))


def sweep(
    requests: Sequence[TraceRequest],
    config: EngineConfig,
    sim: SimConfig,
    capacities_tokens: Sequence[int],
    progress: bool = False,
    on_result: Callable[[SimResult], object] | None = None,
) -> list[SimResult]:
    """One replay per cache size (usable tokens), smallest first; the ceiling is counted once."""
    hits = count_prefix_hits(requests, config.cache.block_size)
    synthesizer = TokenSynthesizer(sim.seed)
    results = []
    for tokens in sorted(capacities_tokens):
        result = Replay(requests, *sweep_point(config, sim, tokens), hits, synthesizer).run(progress)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def monotonic_violations(results: Sequence[SimResult], tolerance: float = 0.0) -> list[str]:
    """Sweep points where a larger cache gave a lower hit rate."""
    out = []
    ordered = sorted(results, key=lambda r: r.kv_cache_tokens)
    for a, b in pairwise(ordered):
        if b.hit_rate < a.hit_rate - tolerance:
            out.append(
                f"hit rate falls from {a.hit_rate:.4%} at {a.kv_cache_tokens:,} tokens "
                f"to {b.hit_rate:.4%} at {b.kv_cache_tokens:,} tokens"
            )
    return out
