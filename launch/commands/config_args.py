"""The engine flags, generated from `protocol.config.EngineConfig`: one flag per field, grouped by area.

Name: `--field-name`; default, help, choices and type from the field; booleans get `--x` and
`--no-x`. `config_from_args` builds the config back, and `config_to_flags` turns a config into the
flags that start a `kvengine serve` subprocess with it.
"""

import argparse
import re
from collections.abc import Iterable
from typing import Any

import msgspec.inspect as mi

from protocol.config import AREA_TYPES, AREAS, EngineConfig

# Single letters follow vLLM's human_readable_int: lowercase decimal, uppercase binary.
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
          "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """'4G' / '4GiB' (4 GiB), '4g' / '4GB' (4e9), '1e9' or a plain integer."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 4G or 4GiB, 512M, or 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_byte_list(text: str) -> list[int]:
    return [parse_bytes(part) for part in text.split(",")]


def _fields(area: str) -> tuple[mi.Field, ...]:
    info = mi.type_info(AREA_TYPES[area])
    assert isinstance(info, mi.StructType)
    return info.fields


def _unwrap(t: mi.Type) -> tuple[mi.Type, str, dict]:
    """(the non-None type, the help text, the extra metadata) of a field's type."""
    help_text, extra = "", {}
    if isinstance(t, mi.Metadata):
        help_text = (t.extra_json_schema or {}).get("description", "")
        extra = t.extra or {}
        t = t.type
    if isinstance(t, mi.UnionType):
        t = next(u for u in t.types if not isinstance(u, mi.NoneType))
    return t, help_text, extra


def _range(t: mi.Type) -> str:
    bounds = [f"{op} {getattr(t, a)}" for a, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
              if getattr(t, a, None) is not None]
    return f"; {', '.join(bounds)}" if bounds else ""


def add_config_args(parser: argparse.ArgumentParser, areas: Iterable[str] = AREAS) -> None:
    """One argument group per area; each field's flag stores into dest `area.field`."""
    for area in areas:
        group = parser.add_argument_group((AREA_TYPES[area].__doc__ or area).strip())
        for field in _fields(area):
            t, help_text, extra = _unwrap(field.type)
            names = [f"--{field.name.replace('_', '-')}", *extra.get("aliases", [])]
            kwargs: dict[str, Any] = {"dest": f"{area}.{field.name}", "default": field.default}
            if isinstance(t, mi.BoolType):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif isinstance(t, mi.LiteralType):
                kwargs["choices"] = list(t.values)
            elif extra.get("parse") == "bytes":
                kwargs["type"] = parse_byte_list if isinstance(t, mi.ListType) else parse_bytes
                kwargs["metavar"] = "BYTES"
            else:
                kwargs["type"] = {mi.IntType: int, mi.FloatType: float, mi.StrType: str}[type(t)]
                kwargs["metavar"] = field.name.split("_")[-1].upper()
            if isinstance(t, mi.BoolType):
                default = f" (default: {'on' if field.default else 'off'})"
            else:
                default = "" if field.default is None else f" (default: {field.default})"
            kwargs["help"] = f"{help_text}{_range(t)}{default}"
            group.add_argument(*names, **kwargs)


def config_from_args(args: argparse.Namespace, areas: Iterable[str] = AREAS) -> EngineConfig:
    """The EngineConfig the flags describe; areas without flags keep their defaults. Raises ValueError."""
    values = vars(args)
    # Each area by its field name, of its field's type: a pairing mypy cannot follow through str keys.
    built: dict[str, Any] = {
        area: AREA_TYPES[area](**{f.name: values[f"{area}.{f.name}"] for f in _fields(area)}) for area in areas
    }
    return EngineConfig(**built)


def config_to_flags(config: EngineConfig, areas: Iterable[str] = AREAS) -> list[str]:
    """The flags of every setting that differs from its default."""
    flags: list[str] = []
    for area in areas:
        value = getattr(config, area)
        for field in _fields(area):
            v = getattr(value, field.name)
            if v == field.default:
                continue
            name = f"--{field.name.replace('_', '-')}"
            if isinstance(v, bool):
                flags.append(name if v else f"--no-{name[2:]}")
            elif isinstance(v, list):
                flags += [name, ",".join(map(str, v))]
            else:
                flags += [name, str(v)]
    return flags


def flags_markdown() -> str:
    """docs/flags.md: one table per area, generated from the config (tests/launch/test_flags_doc.py keeps it fresh)."""
    out = ["# Flags", "",
           "Generated from `protocol/config.py` by `python -m launch.commands.config_args > docs/flags.md`; do not edit by hand.",
           "`kvengine serve` takes every flag; `generate` and `bench` take the model, cache, scheduler and parallel",
           "flags for the server they start. Names follow `vllm serve` where the concept is the same.", ""]
    for area in AREAS:
        doc = (AREA_TYPES[area].__doc__ or area).strip()
        out += [f"## {area}", "", *([doc, ""] if doc != area else []), "| flag | default | meaning |", "|---|---|---|"]
        for field in _fields(area):
            t, help_text, extra = _unwrap(field.type)
            names = " / ".join(f"`{n}`" for n in [f"--{field.name.replace('_', '-')}", *extra.get("aliases", [])])
            if isinstance(t, mi.BoolType):
                names += f" / `--no-{field.name.replace('_', '-')}`"
                default = "on" if field.default else "off"
            else:
                default = "–" if field.default is None else f"`{field.default}`"
            if isinstance(t, mi.LiteralType):
                help_text += f" (one of: {', '.join(map(str, t.values))})"
            meaning = (help_text + _range(t)).replace("|", "\\|")
            out.append(f"| {names} | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(flags_markdown(), end="")
