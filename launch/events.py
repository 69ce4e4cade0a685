"""`kvengine events`: subscribe to a server's KV cache events and print them."""

import argparse

import msgspec
import zmq

from launch.kv_events import KVEventSubscriber
from protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def add_events_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="print a server's KV cache events (stored / removed / cleared)")
    p.add_argument("endpoint", help="the server's --kv-events-endpoint")
    p.add_argument("--replay-endpoint", default=None,
                   help="the server's --kv-events-replay-endpoint: fetch batches missed before joining or in gaps")
    p.add_argument("--from-seq", type=int, default=0, help="first batch wanted (with --replay-endpoint)")
    p.add_argument("--count", type=int, default=None, help="exit after this many batches")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.set_defaults(func=cmd_events)


def format_batch(batch: KVEventBatch) -> str:
    lines = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            lines.append(f"seq {batch.seq} stored  group {event.group_id}: {len(event.block_hashes)} block(s) "
                         f"{' '.join(h.hex()[:12] for h in event.block_hashes)}")
        elif isinstance(event, BlockRemoved):
            lines.append(f"seq {batch.seq} removed group {event.group_id}: "
                         f"{' '.join(h.hex()[:12] for h in event.block_hashes)}")
        elif isinstance(event, AllBlocksCleared):
            lines.append(f"seq {batch.seq} all blocks cleared")
    return "\n".join(lines)


def cmd_events(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    subscriber = KVEventSubscriber(ctx, args.endpoint, args.replay_endpoint, args.from_seq)
    seen = 0
    try:
        while args.count is None or seen < args.count:
            for batch in subscriber.recv(timeout_ms=1000)[: None if args.count is None else args.count - seen]:
                print(msgspec.json.encode(batch).decode() if args.json else format_batch(batch), flush=True)
                seen += 1
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
        ctx.term()
    return 0


