"""Reading a benchmark's ``--trace`` file: this package's JSONL or a
Mooncake/aiperf trace, chosen by ``--trace-format`` (shared by the agentic,
live and DP benchmarks)."""

from __future__ import annotations

import argparse
from typing import Optional

from sglang_session_cache_bench.mooncake import DEFAULT_BLOCK_SIZE, detect_format, read_mooncake
from sglang_session_cache_bench.trace import Trace, TraceError, read_jsonl

TRACE_FORMATS = ("auto", "jsonl", "mooncake")


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
    return v


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def add_trace_format_options(parser) -> None:
    """``--trace-format``, ``--block-size`` and ``--trace-block-size``: how a
    ``--trace`` file is read."""
    parser.add_argument(
        "--trace-format", choices=TRACE_FORMATS, default="auto",
        help="format of --trace: this benchmark's JSONL or Mooncake/aiperf "
             "(timestamp, input_length, output_length, hash_ids); default: "
             "detected from the first line")
    parser.add_argument(
        "--block-size", type=positive_int, default=None, metavar="TOKENS",
        help=f"Mooncake: token ids per hash id in the replay (default "
             f"{DEFAULT_BLOCK_SIZE}); smaller scales the whole trace down for CPU runs")
    parser.add_argument(
        "--trace-block-size", type=positive_int, default=None, metavar="TOKENS",
        help=f"Mooncake: tokens per hash id in the recorded trace (default "
             f"{DEFAULT_BLOCK_SIZE})")


def read_trace(path: str, trace_format: str = "auto", block_size: Optional[int] = None,
               trace_block_size: Optional[int] = None) -> Trace:
    """A ``--trace`` file in ``trace_format`` (``auto``: ``detect_format``)."""
    if trace_format not in TRACE_FORMATS:
        raise TraceError(f"trace format must be one of {list(TRACE_FORMATS)}, "
                         f"got {trace_format!r}")
    fmt = detect_format(path) if trace_format == "auto" else trace_format
    if fmt == "mooncake":
        return read_mooncake(path, block_size=block_size or DEFAULT_BLOCK_SIZE,
                             trace_block_size=trace_block_size or DEFAULT_BLOCK_SIZE)
    if block_size or trace_block_size:
        raise TraceError(f"{path} is a JSONL trace; --block-size and --trace-block-size "
                         "apply to Mooncake traces only")
    return read_jsonl(path)


def trace_from_args(args) -> Optional[Trace]:
    """The ``--trace`` file of parsed ``args`` (options from
    ``add_trace_format_options``), or ``None`` without one (the caller
    generates a trace); the Mooncake-only options need a ``--trace``."""
    if not args.trace:
        if args.block_size or args.trace_block_size:
            raise TraceError("--block-size and --trace-block-size apply to a --trace file")
        return None
    return read_trace(args.trace, args.trace_format, args.block_size, args.trace_block_size)


__all__ = [
    "TRACE_FORMATS",
    "add_trace_format_options",
    "non_negative_int",
    "positive_int",
    "read_trace",
    "trace_from_args",
]
