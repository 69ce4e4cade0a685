"""Mooncake trace records: JSONL with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`,
one id per 512-token block of the prompt, the last block possibly partial."""

import json
from collections.abc import Iterable
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512  # Mooncake hash ids cover 512 tokens each


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in the trace file (the request id is "req-<index>")
    timestamp: float  # ms from the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """The trace file is malformed; the message names the line."""


def check_block_size(block_size: int) -> None:
    """The engine's blocks must tile the trace's blocks, or shared hash ids would not give shared blocks."""
    if block_size < 1 or TRACE_BLOCK_TOKENS % block_size:
        raise ValueError(f"--block-size must divide {TRACE_BLOCK_TOKENS}, got {block_size}")


def parse_trace_lines(lines: Iterable[str], limit: int | None = None, source: str = "trace") -> list[TraceRequest]:
    """Parse Mooncake JSONL, check every record, and order by arrival (stable for equal timestamps)."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if line.strip():
            out.append(_parse_record(line, len(out), f"{source}:{lineno}"))
    out.sort(key=lambda r: r.timestamp)  # stable: file order breaks ties
    return out


def _parse_record(line: str, index: int, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
        ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a Mooncake trace record ({e})") from None
    if not (isinstance(n_in, int) and n_in >= 1 and isinstance(n_out, int) and n_out >= 0):
        raise TraceError(f"{where}: input_length must be >= 1 and output_length >= 0")
    if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    expected = -(-n_in // TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: {len(ids)} hash ids for input_length {n_in} "
            f"(expected {expected} blocks of {TRACE_BLOCK_TOKENS} tokens)"
        )
    return TraceRequest(index, float(ts), n_in, n_out, tuple(ids))


def read_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    with open(path) as f:
        return parse_trace_lines(f, limit, path)
