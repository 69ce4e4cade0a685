"""The figures of one replay, and the checks every replay must pass."""

from dataclasses import asdict, dataclass


@dataclass
class SimResult:
    num_requests: int
    num_finished: int
    num_rejected: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix hits at first admission, summed (rejected requests count 0)
    hit_rate: float
    ceiling_cached_tokens: int  # direct count, infinite cache
    ceiling_hit_rate: float
    num_output_tokens: int
    num_preemptions: int
    num_steps: int
    num_prefill_tokens_computed: int
    num_decode_tokens_computed: int
    num_blocks: int
    kv_cache_tokens: int  # usable: (num_blocks - 1) * block_size
    block_size: int
    max_model_len: int
    peak_kv_usage: float
    mean_kv_usage: float  # weighted by simulated step time
    sim_time_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    wall_time_s: float
    free_blocks_at_end: int
    hash_algo: str
    prefix_caching: bool
    per_request_cached_tokens: list[int] | None = None  # trace order of arrival; -1 when rejected

    def checks(self) -> list[str]:
        """Problems the replay must not have; empty when all is well."""
        problems = []
        if self.num_finished + self.num_rejected != self.num_requests:
            problems.append(f"only {self.num_finished + self.num_rejected} of {self.num_requests} requests finished")
        if self.free_blocks_at_end != self.num_blocks - 1:
            problems.append(f"pool ends with {self.free_blocks_at_end} free blocks, expected {self.num_blocks - 1}")
        if self.num_cached_tokens > self.ceiling_cached_tokens:
            problems.append("more prefix hits than the infinite-cache ceiling")
        return problems

    def to_dict(self, per_request: bool = False) -> dict:
        d = asdict(self)
        if not per_request:
            d.pop("per_request_cached_tokens")
        return d
