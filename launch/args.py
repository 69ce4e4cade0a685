"""The engine flags, shared by `serve` and by the commands that start their own server."""

import argparse
import re

from engine_core.config import SchedulerConfig
from launch.server import ServeConfig

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain integer."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 2GiB, 512MiB or 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_byte_list(text: str) -> list[int]:
    return [parse_bytes(part) for part in text.split(",")]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and devices")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder (config.json + safetensors) or a GGUF file; "
                        "default: the built-in tiny model (random weights, no download)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="worker processes, one per GPU")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: %(default)s")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache; auto: float32 on CPU, the model's dtype on CUDA")
    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.92,
                   help="CUDA: share of GPU memory for weights, activations and KV cache (default: %(default)s)")
    g.add_argument("--kv-cache-memory-bytes", type=parse_byte_list, default=None,
                   help="KV cache bytes per worker, skipping the memory profile (e.g. 2GiB); a comma list gives "
                        "one value per rank. CPU default: a share of available RAM")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="use exactly this many KV blocks")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prefixes (default: on)")
    g.add_argument("--prefix-caching-hash-algo", choices=["sha256", "xxhash"], default="sha256",
                   help="block hash: sha256 (default, cryptographic) or xxhash (faster)")
    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most running requests (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs, or priority (lower value first; preempts the largest value)")
    g.add_argument("--check-block-tables", action="store_true",
                   help="workers verify their block tables against a digest sent every step")
    g = parser.add_argument_group("server")
    g.add_argument("--address", default=None,
                   help="ZeroMQ address to serve on, e.g. ipc:///tmp/kv.sock or tcp://127.0.0.1:5555 "
                        "(default: a fresh ipc:// path, printed at start-up)")
    g.add_argument("--host", default="127.0.0.1", help="with --port: the address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=None, help="serve on tcp://HOST:PORT instead of ipc://")
    g.add_argument("--stats-interval", type=float, default=5.0, help="seconds between stats log lines")
    g = parser.add_argument_group("observability")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (default: off)")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV cache events (block stored / removed / all cleared) on this ZeroMQ PUB "
                        "address, e.g. tcp://127.0.0.1:5557 (default: off)")
    g.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZeroMQ address where late subscribers fetch missed event batches (bounded buffer)")
    g.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def engine_flags_from_args(args: argparse.Namespace) -> list[str]:
    """The same engine settings as command-line flags, to start a server subprocess with."""
    flags = []
    for action in _engine_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        name = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(f"--{'' if value else 'no-'}{action.dest.replace('_', '-')}")
        elif isinstance(action, argparse._StoreTrueAction):
            flags.append(name)
        elif isinstance(value, list):
            flags += [name, ",".join(map(str, value))]
        else:
            flags += [name, str(value)]
    return flags


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return parser


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    address = args.address or (f"tcp://{args.host}:{args.port}" if args.port is not None else None)
    scheduler = SchedulerConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_hash=args.prefix_caching_hash_algo,
        scheduling_policy=args.scheduling_policy,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        check_block_tables=args.check_block_tables,
        enable_kv_cache_events=args.kv_events_endpoint is not None,
    )
    return ServeConfig(
        scheduler=scheduler,
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        address=address,
        stats_interval=args.stats_interval,
        metrics_port=args.metrics_port,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        log_level=args.log_level,
    )
