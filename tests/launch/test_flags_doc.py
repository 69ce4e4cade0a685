"""docs/flags.md is generated from protocol/config.py; a field added or changed there without regenerating it fails."""

import argparse
from pathlib import Path

from launch.commands.config_args import flags_markdown
from launch.commands.serve import add_serve_parser

DOC = Path(__file__).parents[2] / "docs" / "flags.md"


def test_flags_doc_is_generated_from_the_config():
    assert DOC.read_text() == flags_markdown(), "docs/flags.md is stale: python -m launch.commands.config_args > docs/flags.md"


def test_every_serve_flag_is_in_the_doc():
    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub)
    doc = DOC.read_text()
    flags = {s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    missing = sorted(f for f in flags if f"`{f}`" not in doc)
    assert not missing, f"serve flags not in docs/flags.md: {missing}"
