"""The API server process: `python -m launch.api_server.process SETTINGS_JSON`, started by `kvengine serve`.

It inherits the listening HTTP socket (one per `kvengine serve`, shared by every API process: the kernel
spreads connections among them) and connects to the engine core's ZeroMQ address as one more client. API keys
given in the environment (KVENGINE_API_KEY, KVENGINE_ADMIN_API_KEY) are read from its own, inherited one.
"""

import logging
import sys
from contextlib import asynccontextmanager

import msgspec

from launch.api_server.app import create_app
from launch.api_server.connections import HttpConfig, HttpServer
from launch.api_server.launcher import ApiServerSettings
from launch.api_server.state import Served
from launch.api_server.text_model import chat_template_text, load_text_model
from launch.client import AsyncEngineClient, install_uvloop


def main(argv: list[str]) -> int:
    settings = msgspec.json.decode(argv[0], type=ApiServerSettings)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    engine = AsyncEngineClient(settings.engine_address)
    server = settings.server
    text = load_text_model(settings.model)
    if server.chat_template is not None:
        try:
            text.chat_template = chat_template_text(server.chat_template)
        except OSError as e:
            logging.getLogger(__name__).error("--chat-template: cannot read %s: %s", server.chat_template, e)
            return 1
    served = Served(engine, text, settings.model_name, settings.max_model_len, settings.metrics_url, server,
                    settings.engine_window, priority_scheduling=settings.scheduling_policy == "priority")

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    config = HttpConfig(create_app(served, lifespan), max_connections=server.max_http_connections,
                        header_timeout=server.http_header_timeout, fd=settings.fd,
                        log_level=settings.log_level.lower(), access_log=False, timeout_graceful_shutdown=1,
                        timeout_keep_alive=server.http_keep_alive_timeout)  # type: ignore[arg-type]
    HttpServer(config, served).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
