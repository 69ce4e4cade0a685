"""The API server process: `python -m launch.api_server.process SETTINGS_JSON`, started by `kvengine serve`.

It inherits the listening HTTP socket (one per `kvengine serve`, shared by every API process: the kernel
spreads connections among them) and connects to the engine core's ZeroMQ address as one more client.
"""

import logging
import sys
from contextlib import asynccontextmanager

import msgspec
import uvicorn

from launch.api_server.app import create_app
from launch.api_server.launcher import ApiServerSettings
from launch.api_server.serving import Served
from launch.api_server.text_model import load_text_model
from launch.client import AsyncEngineClient, install_uvloop


def main(argv: list[str]) -> int:
    settings = msgspec.json.decode(argv[0], type=ApiServerSettings)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    engine = AsyncEngineClient(settings.engine_address)
    served = Served(engine, load_text_model(settings.model), settings.model_name, settings.max_model_len,
                    settings.metrics_url)

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    config = uvicorn.Config(create_app(served, lifespan), fd=settings.fd, log_level=settings.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=1)
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
