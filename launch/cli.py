"""The `kvengine` command: one subcommand per module in launch/commands/."""

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from launch.commands.bench import add_bench_parser
from launch.commands.events import add_events_parser
from launch.commands.generate import add_generate_parser
from launch.commands.make_model import add_make_model_parser
from launch.commands.reset_prefix_cache import add_reset_prefix_cache_parser
from launch.commands.serve import add_serve_parser
from launch.commands.simulate import add_simulate_parser


def kvengine_version() -> str:
    try:
        return version("kvengine")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvengine",
        description="An LLM engine core with a paged KV cache: one EngineCore process (scheduler + KV block "
                    "ledger) and one worker process per GPU, connected by ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvengine_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_serve_parser, add_generate_parser, add_bench_parser, add_simulate_parser, add_events_parser,
                add_reset_prefix_cache_parser, add_make_model_parser):
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
