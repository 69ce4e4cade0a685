"""An ipc:// path a live server answers on is not taken over; a stale socket file there is replaced."""

import asyncio
import socket

from launch.client import AsyncEngineClient
from tests.e2e.conftest import wait_exit
from tests.e2e.serve_support import GREEDY, SMALL, collect

PROMPT = [5, 17, 300, 42, 9]


def serve_at(start_server, address: str):
    """A server on a given address (after the fixture's own --address, so this one wins)."""
    server = start_server("--address", address, *SMALL)
    server.address = address
    return server


async def generate(address: str):
    async with AsyncEngineClient(address) as client:
        return await collect(client, PROMPT)


def test_a_second_server_on_a_live_address_exits_and_the_first_keeps_serving(start_server, tmp_path):
    address = f"ipc://{tmp_path}/shared.sock"
    first = serve_at(start_server, address)
    asyncio.run(first.wait_ready())
    second = serve_at(start_server, address)
    assert wait_exit(second.proc, 120) == 1, second.output()
    assert f"Start-up failed: a server is already listening on {address}" in second.output()
    tokens, last = asyncio.run(generate(address))
    assert len(tokens) == GREEDY.max_tokens and last.finish_reason == "length"


def test_a_stale_socket_file_is_replaced(start_server, tmp_path):
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as left_behind:  # a server that died without removing its file
        left_behind.bind(str(path))
    assert path.is_socket()
    server = serve_at(start_server, f"ipc://{path}")
    asyncio.run(server.wait_ready())
    assert "Removed a stale socket file" in server.output()
    tokens, last = asyncio.run(generate(server.address))
    assert len(tokens) == GREEDY.max_tokens and last.finish_reason == "length"
