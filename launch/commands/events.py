"""`kvengine events`: subscribe to a server's KV cache events and print them."""

import argparse
import sys

import msgspec
import zmq

from launch.client.kv_event_subscriber import KVEventSubscriber, SeqBatch
from launch.commands.local_server import Interrupted
from launch.commands.stop_signals import raise_on_stop_signals
from protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from protocol.kv_events import ExternalBlockHash


def add_events_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="print a server's KV cache events (stored / removed / cleared)")
    p.add_argument("endpoint", help="the server's --kv-events-endpoint")
    p.add_argument("--replay-endpoint", default=None,
                   help="the server's --kv-events-replay-endpoint: fetch batches missed before joining or in gaps")
    p.add_argument("--from-seq", type=int, default=0, help="first batch wanted (with --replay-endpoint)")
    p.add_argument("--count", type=int, default=None, help="exit after this many batches")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait at start for a sign of the server (default: 10; 0: wait forever). With "
                        "--replay-endpoint, the replay socket must answer within S, else exit 1. Without it, an idle "
                        "server and no server look the same (an idle server publishes nothing): if no batch arrives "
                        "within S, one line says so; then exit 1 with --count, else keep waiting")
    p.set_defaults(func=cmd_events)


def short_hash(block_hash: ExternalBlockHash) -> str:
    return (block_hash.hex() if isinstance(block_hash, bytes) else f"{block_hash:016x}")[:12]


def format_batch(seq: int, batch: KVEventBatch) -> str:
    lines = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            kind = f" ({event.kv_cache_spec_kind})" if event.kv_cache_spec_kind else ""
            lines.append(f"seq {seq} stored  group {event.group_idx}{kind}: {len(event.block_hashes)} block(s) "
                         f"{' '.join(map(short_hash, event.block_hashes))}")
        elif isinstance(event, BlockRemoved):
            lines.append(f"seq {seq} removed group {event.group_idx}: {' '.join(map(short_hash, event.block_hashes))}")
        elif isinstance(event, AllBlocksCleared):
            lines.append(f"seq {seq} all blocks cleared")
    return "\n".join(lines)


def batch_json(seq: int, batch: KVEventBatch) -> str:
    """One object per batch: the frame's seq, then the batch's fields; events as vLLM's maps ("type" first)."""
    return msgspec.json.encode({"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                                "events": batch.events}).decode()


def cmd_events(args: argparse.Namespace) -> int:
    """SIGINT or SIGTERM ends it with exit code 0: following a server until stopped is its normal use."""
    raise_on_stop_signals()
    ctx = zmq.Context()
    subscriber = KVEventSubscriber(ctx, args.endpoint, args.replay_endpoint, args.from_seq)
    try:
        return follow(subscriber, args)
    except Interrupted:
        return 0
    except (TimeoutError, RuntimeError) as e:  # no replay answer, or a malformed message
        print(f"kvengine events: {e}", file=sys.stderr)
        return 1
    finally:
        subscriber.close()
        ctx.term()


def follow(subscriber: KVEventSubscriber, args: argparse.Namespace) -> int:
    """Print batches until --count; the first wait is bounded by --timeout (see its help)."""
    timeout_ms = round(args.timeout * 1000) or None
    seen = 0

    def show(batches: list[SeqBatch]) -> None:
        nonlocal seen
        for seq, batch in batches[: None if args.count is None else args.count - seen]:
            print(batch_json(seq, batch) if args.json else format_batch(seq, batch), flush=True)
            seen += 1

    if args.replay_endpoint:
        show(subscriber.catch_up(timeout_ms))  # the liveness probe; also prints what was missed before joining
    else:
        first = subscriber.recv(timeout_ms)
        if not first:
            print(f"kvengine events: no events at {args.endpoint} within {args.timeout:g} s (an idle server "
                  "publishes nothing; --replay-endpoint checks that the server is there)", file=sys.stderr)
            if args.count is not None:
                return 1
        show(first)
    while args.count is None or seen < args.count:
        show(subscriber.recv(timeout_ms=1000))
    return 0


