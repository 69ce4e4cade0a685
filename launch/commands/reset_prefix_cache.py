"""`kvengine reset-prefix-cache`: drop every cached prefix of a running server."""

import argparse
import asyncio
import sys

from launch.client import AsyncEngineClient, EngineDeadError, install_uvloop


def add_reset_prefix_cache_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reset-prefix-cache", help="drop every cached prefix of a running server",
                       description="Frees the prefix cache (subscribers see AllBlocksCleared). The server refuses "
                                   "while running requests hold blocks; try again when it is idle.")
    p.add_argument("address", help="the server's address, e.g. ipc:///tmp/kv.sock or tcp://127.0.0.1:5555")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default: 10)")
    p.set_defaults(func=cmd_reset_prefix_cache)


async def _reset(address: str, timeout: float) -> bool:
    async with AsyncEngineClient(address) as client:
        await client.wait_ready(timeout)
        return await client.reset_prefix_cache()


def cmd_reset_prefix_cache(args: argparse.Namespace) -> int:
    install_uvloop()
    try:
        done = asyncio.run(_reset(args.address, args.timeout))
    except EngineDeadError as e:
        print(f"kvengine reset-prefix-cache: {e}", file=sys.stderr)
        return 1
    if not done:
        print("kvengine reset-prefix-cache: refused, running requests hold KV blocks; retry when idle",
              file=sys.stderr)
        return 1
    print("prefix cache reset")
    return 0
