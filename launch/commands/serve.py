"""`kvengine serve`: parse the flags, bind the HTTP API's port, and run this host's part of the engine: the
engine-core process (engine_core/server.py), the data-parallel router (launch/data_parallel/), or a headless host's
workers (worker/headless.py)."""

import argparse
import logging

from engine_core.server import EngineServer
from launch.api_server.launcher import ApiServers
from launch.commands.config_args import add_config_args, config_from_args
from launch.data_parallel.server import DataParallelServer, check_data_parallel
from protocol.model.check import check_model
from worker.headless import HeadlessHost

logger = logging.getLogger("kvengine.serve")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the engine: an EngineCore process and one worker per rank",
                       description="Serve requests over ZeroMQ. With no flags: the built-in tiny model on CPU.")
    add_config_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        check_model(config.model.model)  # one line for a --model that cannot load, before any process starts
    except ValueError as e:
        print(f"kvengine serve: {e}")
        return 2
    logging.basicConfig(level=config.server.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.parallel.data_parallel_size > 1:
        refused = check_data_parallel(config)
        if refused is not None:
            print(f"kvengine serve: {refused}")
            return 2
        return DataParallelServer(config).run()
    if config.parallel.headless:
        return HeadlessHost(config).run()
    try:
        front_door = ApiServers(config) if config.server.api_server_count else None
    except OSError as e:
        logger.error("Start-up failed: cannot listen on http://%s:%d: %s", config.server.host, config.server.port, e)
        return 1
    return EngineServer(config, front_door).run()
