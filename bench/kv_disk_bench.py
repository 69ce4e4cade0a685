"""The disk tier's figures on this machine: TTFT of a 4k-token prompt loaded from the tier (after a restart: memory
is empty) against computed from scratch, with the built-in model in process; and the tier's write and read bandwidth
for blocks of that model (reads come from the page cache unless it was dropped).

    python -m bench.kv_disk_bench [--prompt-len 4095] [--blocks 1024]
"""

import argparse
import os
import tempfile
import time

from bench.timing import stopwatch
from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from protocol.kv_store.layout import DiskLayout
from worker.inproc_executor import InProcExecutor


def ttft(path: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token on a fresh engine over the tier at path, and the prompt tokens it had cached."""
    config = engine_config(max_model_len=len(prompt) + 1, max_num_batched_tokens=2048, kv_disk_path=path,
                           kv_cache_memory_bytes=[1 << 30])
    engine = EngineCore(config, InProcExecutor(config))
    try:
        start = time.perf_counter()
        engine.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=1), 0.0))
        cached = 0
        while engine.has_work():
            for out in engine.step().outputs:
                cached = out.num_cached_tokens
                if out.new_token_ids:
                    elapsed = time.perf_counter() - start
        return elapsed, cached
    finally:
        engine.shutdown()


def bandwidth(path: str, nblocks: int, block_bytes: int) -> tuple[float, float]:
    layout = DiskLayout(path, "bench")
    payload = memoryview(os.urandom(block_bytes))
    keys = [i.to_bytes(8, "big") for i in range(nblocks)]
    with stopwatch() as write:
        for key in keys:
            layout.write_block(key, payload)
    with stopwatch() as read:
        for key in keys:
            layout.read_block(key, block_bytes)
    total = nblocks * block_bytes
    return total / write.wall, total / read.wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=4095)
    p.add_argument("--blocks", type=int, default=1024)
    args = p.parse_args()
    prompt = [(i * 7919) % 1000 + 1 for i in range(args.prompt_len)]
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
        computed, _ = ttft(d, prompt)
        loaded, cached = ttft(d, prompt)
        (tier,) = [e.path for e in os.scandir(d)]
        files = [os.path.join(r, f) for r, _, fs in os.walk(tier) for f in fs if f.endswith(".kv")]
        block_bytes = os.path.getsize(files[0])
        write, read = bandwidth(os.path.join(d, "bw"), args.blocks, block_bytes)
    print(f"TTFT of a {args.prompt_len}-token prompt: computed {computed * 1000:.0f} ms, from the disk tier after a "
          f"restart {loaded * 1000:.0f} ms ({cached} tokens loaded, {computed / loaded:.1f}x)")
    print(f"disk tier, {args.blocks} blocks of {block_bytes:,} bytes: write {write / 1e6:.0f} MB/s, "
          f"read (checked) {read / 1e6:.0f} MB/s")


if __name__ == "__main__":
    main()
