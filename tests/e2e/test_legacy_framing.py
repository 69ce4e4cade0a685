"""A peer speaking legacy ZMTP/1.0 on the client socket must not stop the engine core."""

import asyncio
import socket

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.in_process import in_process_greedy
from tests.e2e.serve_support import prompts


def test_a_zmtp_1_0_message_on_the_ipc_socket_leaves_the_server_serving(start_server):
    server = start_server("--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB")
    asyncio.run(server.wait_ready())
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(server.address.removeprefix("ipc://"))
            raw.sendall(b"\x01\x00" + b"\x06\x00hello")  # ZMTP/1.0: an empty identity, then one 5-byte frame
    prompt = prompts(1, seed=21, lo=20, hi=30)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        async with AsyncEngineClient(server.address) as client:
            tokens = []
            async for out in client.generate(prompt, params):
                tokens += out.new_token_ids
            return tokens

    assert asyncio.run(run()) == in_process_greedy([prompt], params, max_model_len=256)[0]
    assert server.proc.poll() is None
