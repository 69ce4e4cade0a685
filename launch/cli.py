"""The `kvengine` command: serve, generate, bench, events, simulate, make-model."""

import argparse
import logging
import sys

from launch.args import add_engine_args, serve_config_from_args


def cmd_serve(args: argparse.Namespace) -> int:
    from launch.server import EngineServer

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return EngineServer(serve_config_from_args(args)).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvengine",
        description="An LLM engine core with a paged KV cache: one EngineCore process (scheduler + KV block "
                    "ledger) and one worker process per GPU, connected by ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the engine: an EngineCore process and one worker per rank",
                           description="Serve requests over ZeroMQ. With no flags: the built-in tiny model on CPU.")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from launch.bench import add_bench_parser
    from launch.events import add_events_parser
    from launch.generate import add_generate_parser
    from launch.make_model import add_make_model_parser
    from launch.simulate import add_simulate_parser

    add_generate_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_events_parser(sub)
    add_make_model_parser(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
