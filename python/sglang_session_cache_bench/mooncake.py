"""Mooncake / aiperf trace import for the agentic benchmark.

A Mooncake trace (the format of the public FAST'25 traces, replayed by aiperf)
is JSONL, one request per line::

    {"timestamp": 0, "input_length": 1200, "output_length": 52, "hash_ids": [0, 1, 2]}
    {"timestamp": 1830, "input_length": 1800, "output_length": 26, "hash_ids": [0, 1, 2, 3]}
    {"session_id": "s1", "delay": 2000, "input_length": 400, "output_length": 26, "hash_ids": [9]}

``timestamp``
    arrival in milliseconds. Required, except on a later turn of a
    ``session_id`` that gives ``delay`` instead.
``input_length``, ``output_length``
    prompt and output tokens (integers, >= 1 and >= 0).
``hash_ids``
    one id per block of ``trace_block_size`` prompt tokens (512 in the
    published traces; the last block may be partial): equal leading ids mean
    an equal prefix. So ``input_length`` must need exactly ``len(hash_ids)``
    blocks.
``session_id`` (optional)
    the conversation, as aiperf's multi-turn traces give it. A later turn whose
    ``hash_ids`` start with the previous turn's whole list is its full prompt;
    otherwise it carries only the new blocks and the prompt is the previous
    prompt + the previous output + those blocks (aiperf accumulates history
    that way).
``delay`` (optional, with ``session_id``)
    milliseconds after the session's previous turn; used when ``timestamp``
    is absent.

Expansion: each distinct hash id becomes one block of ``block_size`` token
ids (ids numbered by first appearance, so they are dense and below 2**40);
a prompt is its blocks' ids cut to ``input_length`` scaled by
``block_size / trace_block_size``. Output lengths are scaled the same way, so
``--block-size 16`` replays a 512-block trace 32x smaller with the same
sharing structure. Outputs are fresh ids from 2**39 up (never equal to a
block id), so ``--save-trace`` writes a JSONL trace that replays the same.

Requests replay in timestamp order (ties in file order); their times drive
the session TTL. Without ``session_id``, sessions are inferred: a request
whose ``hash_ids`` extend an earlier request's *full* list -- one that is
longer than a single leading block, so that sharing only a system prompt
block does not make a conversation -- is the next turn of the latest such
conversation, when that list is the conversation's latest turn. A request
that extends an older turn (or a list another request already continued)
starts a conversation of its own: in a recorded trace a shared prefix is
more often another user with the same system prompt and task than a branch,
and merging users would serialize their turns. Conversations with one
request are one-shot traffic (untagged); the others get ids ``conv-<n>``
(``conv-<n>-<k>`` where a line already uses that id). By default a session
is closed right after its last turn (``workload_modes`` can drop the closes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

from sglang_session_cache_bench.trace import (
    FRESH_TOKEN_BASE,
    Trace,
    TraceError,
    TraceRequest,
    _check_session_id,
    _type_name,
    json_lines,
)

DEFAULT_BLOCK_SIZE = 512
# Output ids: below the JSONL limit (2**40), so a delta turn's prompt, which
# resends an earlier output, stays a valid JSONL prompt (--save-trace), and
# far above any block id.
OUTPUT_TOKEN_BASE = 1 << 39
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids", "session_id", "delay")
INFERRED_SESSION_PREFIX = "conv-"
# An inferred next turn must share more than this many leading blocks.
MIN_SHARED_BLOCKS = 2


@dataclass
class _Line:
    lineno: int
    time: float  # seconds
    input_length: int
    output_length: int
    hash_ids: tuple
    session_id: Optional[str]


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: {key!r} must be an integer, got {_type_name(v)} {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: {key!r} must be >= {minimum}, got {v}")
    return v


def _ms_field(obj: dict, key: str, where: str) -> Optional[float]:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TraceError(f"{where}: {key!r} must be a number of milliseconds, got "
                         f"{_type_name(v)} {v!r}")
    if v < 0:
        raise TraceError(f"{where}: {key!r} must be >= 0, got {v}")
    return float(v)


def _parse_line(obj, lineno: int, trace_block_size: int, last_time: dict) -> _Line:
    where = f"line {lineno}"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {_type_name(obj)}")
    unknown = sorted(k for k in obj if k not in FIELDS)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}; a Mooncake line takes "
                         f"{list(FIELDS)}")
    sid = obj.get("session_id")
    if sid is not None:
        sid = _check_session_id(sid, where)
    n_in = _int_field(obj, "input_length", where, 1)
    n_out = _int_field(obj, "output_length", where, 0)
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    hashes = obj["hash_ids"]
    if not isinstance(hashes, list) or not hashes:
        raise TraceError(f"{where}: 'hash_ids' must be a non-empty array of integers, "
                         f"got {_type_name(hashes) if not isinstance(hashes, list) else 'empty array'}")
    for i, h in enumerate(hashes):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(f"{where}: hash_ids[{i}] must be an integer >= 0, got "
                             f"{_type_name(h)} {h!r}")
    blocks = -(-n_in // trace_block_size)
    if blocks != len(hashes):
        raise TraceError(
            f"{where}: 'input_length' {n_in} needs {blocks} block(s) of "
            f"{trace_block_size} tokens but 'hash_ids' has {len(hashes)} "
            f"(is the trace's block size {trace_block_size}? see --trace-block-size)")
    ts = _ms_field(obj, "timestamp", where)
    delay = _ms_field(obj, "delay", where)
    if delay is not None and sid is None:
        raise TraceError(f"{where}: 'delay' needs a 'session_id'")
    if ts is not None:
        t = ts / 1000.0
    elif delay is not None and sid in last_time:
        t = last_time[sid] + delay / 1000.0
    else:
        raise TraceError(f"{where}: missing field 'timestamp' (only a later turn of a "
                         f"session_id may give 'delay' instead)")
    if sid is not None:
        last_time[sid] = t
    return _Line(lineno, t, n_in, n_out, tuple(hashes), sid)


def _read_lines(path: str, trace_block_size: int) -> list:
    lines: list = []
    last_time: dict = {}
    for lineno, obj in json_lines(path):
        try:
            lines.append(_parse_line(obj, lineno, trace_block_size, last_time))
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
    if not lines:
        raise TraceError(f"{path}: the trace has no requests")
    return lines


class _BlockTokens:
    """Hash id -> its block of token ids (dense, by first appearance). Blocks
    are built once and shared, so prompts that resend a block reuse its int
    objects instead of allocating new ones."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict = {}

    def expand(self, hashes: tuple, length: int) -> list:
        bs, blocks = self.block_size, self.blocks
        out: list = []
        for h in hashes:
            block = blocks.get(h)
            if block is None:
                k = len(blocks)
                if (k + 1) * bs > OUTPUT_TOKEN_BASE:
                    raise TraceError("the trace has too many distinct blocks; use a "
                                     "smaller --block-size")
                block = blocks[h] = list(range(k * bs, (k + 1) * bs))
            out.extend(block)
        del out[length:]
        return out


class _TipTrie:
    """Conversations by the hash-id list of their latest turn, for finding the
    conversation a request continues in O(len(hash_ids))."""

    def __init__(self):
        self.root: dict = {}
        self.tip_of: dict = {}  # id(node) -> conversation index
        self.tip_node: dict = {}  # conversation index -> node

    def continues(self, hashes: tuple) -> Optional[int]:
        """The conversation whose latest turn's full list ``hashes`` strictly
        extends by more than ``MIN_SHARED_BLOCKS - 1`` shared blocks (the
        deepest such tip)."""
        node, found = self.root, None
        for depth, h in enumerate(hashes[:-1], start=1):
            node = node.get(h)
            if node is None:
                break
            if depth >= MIN_SHARED_BLOCKS:
                conv = self.tip_of.get(id(node))
                if conv is not None:
                    found = conv
        return found

    def set_tip(self, conv: int, hashes: tuple) -> None:
        old = self.tip_node.pop(conv, None)
        if old is not None and self.tip_of.get(id(old)) == conv:
            del self.tip_of[id(old)]
        node = self.root
        for h in hashes:
            node = node.setdefault(h, {})
        prev = self.tip_of.get(id(node))
        if prev is not None:  # an identical list: the latest conversation owns it
            self.tip_node.pop(prev, None)
        self.tip_of[id(node)] = conv
        self.tip_node[conv] = node


def _scaled(n: int, block_size: int, trace_block_size: int) -> int:
    return -(-n * block_size // trace_block_size)


def read_mooncake(path: str, block_size: int = DEFAULT_BLOCK_SIZE,
                  trace_block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Read a Mooncake/aiperf JSONL trace (format in the module docstring)."""
    for name, v in (("block_size", block_size), ("trace_block_size", trace_block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TraceError(f"{name} must be a positive integer, got {v!r}")
    lines = _read_lines(path, trace_block_size)
    lines.sort(key=lambda ln: (ln.time, ln.lineno))
    tokens = _BlockTokens(block_size)
    fresh = iter(range(OUTPUT_TOKEN_BASE, FRESH_TOKEN_BASE))
    trie = _TipTrie()
    explicit: dict = {}  # session_id -> (hashes, prompt, output) of its last turn
    conv_of: list = []  # per request: inferred conversation index, or None
    sizes: list = []  # inferred conversation index -> number of requests
    requests: list = []
    for ln in lines:
        length = _scaled(ln.input_length, block_size, trace_block_size)
        output = [next(fresh) for _ in range(_scaled(ln.output_length, block_size,
                                                     trace_block_size))]
        prompt = tokens.expand(ln.hash_ids, length)
        conv = None
        if ln.session_id is not None:
            prev = explicit.get(ln.session_id)
            if prev is not None and ln.hash_ids[: len(prev[0])] != prev[0]:
                prompt = prev[1] + prev[2] + prompt  # a delta turn
            explicit[ln.session_id] = (ln.hash_ids, prompt, output)
        else:
            conv = trie.continues(ln.hash_ids)
            if conv is None:
                conv = len(sizes)
                sizes.append(0)
            sizes[conv] += 1
            trie.set_tip(conv, ln.hash_ids)
        conv_of.append(conv)
        requests.append(TraceRequest(prompt, output, session_id=ln.session_id,
                                     line=ln.lineno, time=ln.time))
    # Name multi-request conversations; one-request ones stay one-shot.  A
    # name a line gives as its own session_id is not reused.
    names: dict = {}
    for c, n in enumerate(sizes):
        if n > 1:
            name, k = f"{INFERRED_SESSION_PREFIX}{c}", 0
            while name in explicit:
                k += 1
                name = f"{INFERRED_SESSION_PREFIX}{c}-{k}"
            names[c] = name
    last: dict = {}
    turns: dict = {}
    for i, (req, conv) in enumerate(zip(requests, conv_of)):
        if conv is not None:
            req.session_id = names.get(conv)
        if req.session_id is not None:
            turns[req.session_id] = turns.get(req.session_id, 0) + 1
            req.turn = turns[req.session_id]
            last[req.session_id] = i
    for i in last.values():
        requests[i].close = True
    params = {
        "format": "mooncake",
        "block_size": block_size,
        "trace_block_size": trace_block_size,
        "explicit_sessions": len(explicit),
        "inferred_sessions": len(names),
        "inferred_oneshots": sum(1 for n in sizes if n == 1),
    }
    return Trace(requests, source=path, params=params)


def detect_format(path: str) -> str:
    """``"mooncake"`` or ``"jsonl"`` from the first non-blank line; raises
    ``TraceError`` when that line does not tell."""
    with contextlib.closing(json_lines(path)) as lines:  # the first line only
        first = next(lines, None)
    if first is None:
        raise TraceError(f"{path}: the trace has no requests")
    lineno, obj = first
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: line {lineno}: expected a JSON object, got {_type_name(obj)}")
    mooncake = {"hash_ids", "input_length"} & obj.keys()
    own = {"tokens", "text", "close"} & obj.keys()
    if mooncake and not own:
        return "mooncake"
    if own and not mooncake:
        return "jsonl"
    raise TraceError(
        f"{path}: line {lineno}: cannot tell the trace format (a Mooncake line has "
        f"'hash_ids' and 'input_length', a JSONL line 'tokens' or 'text'); pass "
        f"--trace-format mooncake or --trace-format jsonl")


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "INFERRED_SESSION_PREFIX",
    "detect_format",
    "read_mooncake",
]
