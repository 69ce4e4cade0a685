"""Settings of the engine core (the workers' own settings live with the launcher)."""

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step; longer prompts are prefilled in chunks
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "sha256"  # or "xxhash"
    scheduling_policy: str = "fcfs"  # or "priority"
    watermark: float = 0.0  # share of blocks kept free when admitting while others run
    num_gpu_blocks_override: int | None = None
    check_block_tables: bool = False  # send a digest of every scheduled request's blocks to the workers
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is the null block)")
