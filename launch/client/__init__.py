"""The Python client of a kvengine server: AsyncEngineClient (asyncio over ZeroMQ, n > 1 fanned out here) and the
KV event subscriber. `from launch.client import AsyncEngineClient` is the public import."""

from launch.client.engine_client import AsyncEngineClient, EngineDeadError, RequestOutput, install_uvloop

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestOutput", "install_uvloop"]
