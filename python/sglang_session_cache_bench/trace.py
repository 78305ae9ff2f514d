"""Agentic traces for ``sglang_session_cache_bench.agentic``: a seeded generator
and a JSONL reader.

A trace is an ordered list of events, replayed one after another:

``TraceRequest``
    one request: its prompt token ids, the token ids the "model" produces, an
    optional session id and whether the session is closed once the request
    finishes.
``TraceClose``
    ``/close_session`` for a session id, without a request.

This module imports neither torch nor sglang, so a trace can be built or
checked cheaply (the benchmark validates ``--trace`` before it loads SGLang).

JSONL format (one JSON object per line; blank lines are skipped)
----------------------------------------------------------------

Request line::

    {"session_id": "agent-1", "tokens": [12, 7, 99], "output_len": 32}
    {"session_id": "agent-1", "text": "...whole conversation...", "output": "...", "close": true}
    {"tokens": [5, 6, 7, 8], "output_len": 16}          # one-shot (no session)

``session_id``
    non-empty string, or ``null`` / absent for a one-shot request.
``tokens`` | ``text`` (exactly one, required)
    the full prompt the client sends: for a session turn, the whole
    conversation so far (history, previous outputs, new tool output or user
    message). ``tokens``: non-empty list of integers in ``[0, 2**40)``.
    ``text``: non-empty string, mapped to ids by ``tokenize_text``.
``output_len`` (integer >= 0)
    number of tokens the request generates. 0 and 1 both mean "prefill only":
    the token sampled at prefill never gets KV of its own. Required unless
    ``output`` is given.
``output`` (optional: list of integers, or a string tokenized like ``text``)
    the tokens the model produced. Give it when later turns resend this
    output, so the replay decodes exactly those ids and the next turn can hit
    them in the cache. Without it the replay generates fresh ids (from
    ``2**40`` upwards, never equal to a prompt id). When both are given,
    ``output_len`` must equal the length of ``output``.
``close`` (optional boolean, default false)
    close the session right after this request finishes (needs a session).
``time`` (optional number >= 0)
    arrival in seconds of trace time. The replay sets the session cache's
    clock to it, so ``--session-radix-cache-ttl`` expires idle sessions in
    trace time. Lines replay in file order, so times may not go backwards; a
    line without ``time`` arrives when the line before it did (0 at the start).

Close line::

    {"close": "agent-1"}
    {"close": "agent-1", "time": 812.5}

closes ``agent-1`` at that point of the trace (no other fields but ``time``).
A session that is never closed is "abandoned": its requests stop and its
session references stay until eviction takes them.

Any other field, a wrong type, a negative length, an empty session id or a
line that is not a JSON object raises ``TraceError`` naming the line number.

Text tokenizer: ``text`` (and string ``output``) is split with the regular
expression ``\\s+|\\w+|[^\\w\\s]`` (runs of whitespace, runs of word
characters, single punctuation characters); each piece becomes the first 4
bytes of its UTF-8 BLAKE2b digest as a big-endian integer (so ids are in
``[0, 2**32)``). It is deterministic across processes and machines, and a text
that extends another text tokenizes to an extension of its ids, except at the
boundary where the old text ended inside a word or whitespace run -- as with a
real tokenizer.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

__all__ = [
    "FRESH_TOKEN_BASE",
    "MAX_TOKEN_ID",
    "GeneratorConfig",
    "TraceClose",
    "TraceError",
    "TraceRequest",
    "Trace",
    "generate_trace",
    "ideal_stats",
    "read_jsonl",
    "tokenize_text",
    "write_jsonl",
]

#: Prompt / output ids given in a trace must be below this.
MAX_TOKEN_ID = 1 << 40
#: Generated output ids (for requests without ``output``) start here.
FRESH_TOKEN_BASE = MAX_TOKEN_ID

_PIECE_RE = re.compile(r"\s+|\w+|[^\w\s]")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line."""


@dataclass
class TraceRequest:
    prompt: list  # token ids sent (the whole conversation for a session turn)
    output: list  # token ids produced; len(output) == output_len
    session_id: Optional[str] = None
    close: bool = False
    # For reports: which turn of its session this is (1-based), 0 for one-shot.
    turn: int = 0
    line: int = 0  # JSONL line number (0 for generated traces)
    time: float = 0.0  # arrival, seconds of trace time (drives the session TTL)
    # One-shot traffic that a tag-everything client still tagged; reports
    # count it as one-shot (``is_oneshot``), the cache sees a session.
    tagged_oneshot: bool = False

    @property
    def output_len(self) -> int:
        return len(self.output)

    @property
    def is_oneshot(self) -> bool:
        return self.session_id is None or self.tagged_oneshot


@dataclass
class TraceClose:
    session_id: str
    line: int = 0
    time: float = 0.0


Event = Union[TraceRequest, TraceClose]


@dataclass
class Trace:
    events: list
    source: str = "generated"
    params: dict = field(default_factory=dict)

    @property
    def requests(self) -> list:
        return [e for e in self.events if isinstance(e, TraceRequest)]

    def summary(self) -> dict:
        reqs = self.requests
        sess = [r for r in reqs if not r.is_oneshot]
        return {
            "source": self.source,
            "requests": len(reqs),
            "session_requests": len(sess),
            "oneshot_requests": len(reqs) - len(sess),
            "sessions": len({r.session_id for r in sess}),
            "tagged_oneshots": sum(1 for r in reqs if r.tagged_oneshot),
            "closes": sum(1 for r in reqs if r.close)
            + sum(1 for e in self.events if isinstance(e, TraceClose)),
            "sessions_closed": sessions_closed(self.events),
            "duration_s": self.events[-1].time - self.events[0].time if self.events else 0.0,
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "output_tokens": sum(len(r.output) for r in reqs),
            "max_request_tokens": max(
                (len(r.prompt) + len(r.output) for r in reqs), default=0
            ),
        }


def sessions_closed(events) -> int:
    """Sessions that a close ended: a close of a session with no request since
    the previous close (or none at all) ends nothing and is not counted."""
    open_ids: set = set()
    n = 0
    for ev in events:
        if isinstance(ev, TraceRequest):
            if ev.session_id is not None:
                open_ids.add(ev.session_id)
            sid = ev.session_id if ev.close else None
        else:
            sid = ev.session_id
        if sid is not None and sid in open_ids:
            open_ids.discard(sid)
            n += 1
    return n


# --------------------------------------------------------------------------
# Text tokenizer
# --------------------------------------------------------------------------


def tokenize_text(text: str) -> list:
    """Deterministic whitespace/word/punctuation tokenizer (see module doc)."""
    return [
        int.from_bytes(
            hashlib.blake2b(piece.encode("utf-8"), digest_size=4).digest(), "big"
        )
        for piece in _PIECE_RE.findall(text)
    ]


# --------------------------------------------------------------------------
# JSONL reader / writer
# --------------------------------------------------------------------------

_REQUEST_FIELDS = ("session_id", "tokens", "text", "output_len", "output", "close", "time")


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _token_list(value, what: str, where: str, allow_empty: bool) -> list:
    if not isinstance(value, list):
        raise TraceError(
            f"{where}: {what!r} must be an array of integers, got {_type_name(value)}"
        )
    if not value and not allow_empty:
        raise TraceError(f"{where}: {what!r} is empty")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TraceError(
                f"{where}: {what}[{i}] must be an integer, got {_type_name(t)} {t!r}"
            )
        if t < 0 or t >= MAX_TOKEN_ID:
            raise TraceError(
                f"{where}: {what}[{i}] = {t} is outside [0, 2**40)"
            )
    return list(value)


def _check_session_id(value, where: str, key: str = "session_id") -> str:
    if not isinstance(value, str):
        raise TraceError(
            f"{where}: {key!r} must be a non-empty string, got {_type_name(value)}"
        )
    if not value.strip():
        raise TraceError(f"{where}: {key!r} is an empty string")
    return value


def parse_event(obj, lineno: int, fresh: Iterable[int]) -> Event:
    """One decoded JSONL line -> event. ``fresh`` yields generated output ids."""
    where = f"line {lineno}"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {_type_name(obj)}")

    t = _event_time(obj, where)
    if "close" in obj and (isinstance(obj["close"], str) or len(obj) == 1 + ("time" in obj)):
        # Close event: {"close": "<session id>"} (+ optional "time").
        extra = sorted(k for k in obj if k not in ("close", "time"))
        if extra:
            raise TraceError(
                f"{where}: a close event {{\"close\": \"<session id>\"}} takes no "
                f"other fields but 'time', got {extra}"
            )
        return TraceClose(_check_session_id(obj["close"], where, "close"), line=lineno,
                          time=t)

    unknown = sorted(k for k in obj if k not in _REQUEST_FIELDS)
    if unknown:
        raise TraceError(
            f"{where}: unknown field(s) {unknown}; a request takes "
            f"{list(_REQUEST_FIELDS)}, a close event is {{\"close\": \"<session id>\"}}"
        )

    sid = obj.get("session_id")
    if sid is not None:
        sid = _check_session_id(sid, where)

    has_tokens, has_text = "tokens" in obj, "text" in obj
    if has_tokens and has_text:
        raise TraceError(f"{where}: give either 'tokens' or 'text', not both")
    if has_tokens:
        prompt = _token_list(obj["tokens"], "tokens", where, allow_empty=False)
    elif has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise TraceError(f"{where}: 'text' must be a string, got {_type_name(text)}")
        prompt = tokenize_text(text)
        if not prompt:
            raise TraceError(f"{where}: 'text' is empty")
    else:
        raise TraceError(f"{where}: missing field 'tokens' or 'text' (the prompt)")

    output = None
    if "output" in obj:
        out = obj["output"]
        if isinstance(out, str):
            output = tokenize_text(out)
        elif isinstance(out, list):
            output = _token_list(out, "output", where, allow_empty=True)
        else:
            raise TraceError(
                f"{where}: 'output' must be an array of integers or a string, "
                f"got {_type_name(out)}"
            )

    if "output_len" in obj:
        n = obj["output_len"]
        if isinstance(n, bool) or not isinstance(n, int):
            raise TraceError(
                f"{where}: 'output_len' must be an integer, got {_type_name(n)} {n!r}"
            )
        if n < 0:
            raise TraceError(f"{where}: 'output_len' must be >= 0, got {n}")
        if output is not None and n != len(output):
            raise TraceError(
                f"{where}: 'output_len' is {n} but 'output' has {len(output)} tokens"
            )
        if output is None:
            output = [next(fresh) for _ in range(n)]
    elif output is None:
        raise TraceError(f"{where}: missing field 'output_len' (or 'output')")

    close = obj.get("close", False)
    if not isinstance(close, bool):
        raise TraceError(
            f"{where}: 'close' must be a boolean on a request line "
            f"(or a session id string on a close event), got {_type_name(close)}"
        )
    if close and sid is None:
        raise TraceError(f"{where}: 'close': true needs a 'session_id'")
    return TraceRequest(prompt, output, session_id=sid, close=close, line=lineno, time=t)


def _event_time(obj: dict, where: str) -> Optional[float]:
    """Optional ``time`` (seconds of trace time); ``None`` when absent."""
    if "time" not in obj:
        return None
    t = obj["time"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise TraceError(f"{where}: 'time' must be a number of seconds, got "
                         f"{_type_name(t)} {t!r}")
    if t < 0:
        raise TraceError(f"{where}: 'time' must be >= 0, got {t}")
    return float(t)


def open_trace(path: str):
    """A trace file opened for reading as text (a leading UTF-8 BOM is
    skipped), or ``TraceError`` naming the file."""
    try:
        return open(path, "r", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace: {exc.strerror or exc}") from None


def json_lines(path: str):
    """``(line number, parsed object)`` for each non-blank line of a trace
    file; ``TraceError`` naming the file and line for text that is not UTF-8
    or a line that is not JSON."""
    fh = open_trace(path)
    with fh:
        try:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise TraceError(
                        f"{path}: line {lineno}: invalid JSON: {exc.msg} "
                        f"(column {exc.colno})"
                    ) from None
                yield lineno, obj
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text: {exc.reason}") from None


def read_jsonl(path: str) -> Trace:
    """Read a JSONL trace (format in the module docstring)."""
    fresh = iter(range(FRESH_TOKEN_BASE, FRESH_TOKEN_BASE + (1 << 62)))
    events: list = []
    turns: dict = {}
    clock = 0.0
    for lineno, obj in json_lines(path):
        try:
            ev = parse_event(obj, lineno, fresh)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        # Lines without a time happen when the previous line did;
        # times may not go backwards (the replay is in file order).
        if ev.time is None:
            ev.time = clock
        elif ev.time < clock:
            raise TraceError(
                f"{path}: line {lineno}: 'time' {ev.time:g} is before the "
                f"previous line's {clock:g} (lines replay in file order)")
        clock = ev.time
        if isinstance(ev, TraceRequest) and ev.session_id is not None:
            turns[ev.session_id] = turns.get(ev.session_id, 0) + 1
            ev.turn = turns[ev.session_id]
        elif isinstance(ev, TraceClose):
            turns.pop(ev.session_id, None)
        if isinstance(ev, TraceRequest) and ev.close:
            turns.pop(ev.session_id, None)
        events.append(ev)
    if not any(isinstance(e, TraceRequest) for e in events):
        raise TraceError(f"{path}: the trace has no requests")
    return Trace(events, source=path)


def write_jsonl(trace: Trace, path: str) -> None:
    """Write ``trace`` in the JSONL format (token ids, explicit outputs)."""
    with open(path, "w", encoding="utf-8") as fh:
        for ev in trace.events:
            if isinstance(ev, TraceClose):
                obj = {"close": ev.session_id}
            else:
                obj = {"session_id": ev.session_id, "tokens": list(ev.prompt)}
                # Generated ids (>= 2**40) are not valid JSONL ids; the
                # reader generates fresh ones again from the length.
                if any(t >= FRESH_TOKEN_BASE for t in ev.output):
                    obj["output_len"] = len(ev.output)
                else:
                    obj["output"] = list(ev.output)
                if ev.close:
                    obj["close"] = True
            obj["time"] = round(ev.time, 6)
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")


# --------------------------------------------------------------------------
# Seeded generator
# --------------------------------------------------------------------------


@dataclass
class GeneratorConfig:
    """Workload knobs. Token counts are scaled down about 4x from a real
    deployment (2k-token agent system prompt, tool outputs of a few hundred to
    2k tokens, unrelated one-shot prompts of 1k-8k tokens) to keep the CPU
    replay fast; the ratios are what matter."""

    sessions: int = 64  # agent sessions over the whole trace
    concurrency: int = 48  # sessions open at the same time
    turns: int = 8  # mean turns per session (each draws from turns +- turns/4)
    system_prompt: int = 512  # shared by every agent session
    task: tuple = (64, 256)  # first user message
    model_output: tuple = (16, 96)  # tokens generated per turn (tool call / reply)
    tool_output: tuple = (64, 512)  # appended after each turn
    # Tool latency between turns: log-normal (most tool calls are quick, a few
    # -- builds, test runs -- take much longer) around a per-session mean.
    latency_sigma: float = 1.0
    user_followup: float = 0.15  # chance a turn's addition is a short user message instead
    user_message: tuple = (16, 64)
    abandon: float = 0.25  # sessions that stop early and are never closed
    oneshot_frac: float = 0.4  # share of all requests that are one-shot traffic
    oneshot_templates: int = 4  # one-shot apps, each with its own short system prompt
    oneshot_template: int = 96
    oneshot_body: tuple = (256, 2048)  # ~1k-8k-token RAG / summarization prompts, scaled
    oneshot_output: tuple = (8, 64)
    # One-shot traffic over shared documents (0: every body is unique). Each
    # one-shot then reads one of ``shared_docs`` documents (popularity ~ 1/rank)
    # and asks a unique question about it, so one-shots share prefixes.
    shared_docs: int = 0
    doc_tokens: tuple = (512, 2048)
    doc_question: tuple = (16, 128)
    # Trace seconds per unit of the simulated clock: per-session mean gaps
    # between turns are 0.5-2 units, i.e. 7.5-30 s of trace time (model time
    # plus tool time), so an idle TTL of tens of seconds to minutes matters.
    time_scale: float = 15.0
    vocab: int = 128_000
    seed: int = 0

    def validate(self) -> None:
        ints = ("sessions", "concurrency", "turns", "system_prompt",
                "oneshot_templates", "oneshot_template", "vocab")
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name in ("system_prompt",
                                                              "oneshot_template") else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.shared_docs, int) or self.shared_docs < 0:
            raise ValueError(f"shared_docs must be an integer >= 0, got {self.shared_docs!r}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")
        for name in ("task", "model_output", "tool_output", "user_message",
                     "oneshot_body", "oneshot_output", "doc_tokens", "doc_question"):
            lo, hi = getattr(self, name)
            if not (0 <= lo <= hi):
                raise ValueError(f"{name} must be a range 0 <= lo <= hi, got {(lo, hi)}")
        for name in ("abandon", "user_followup"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if not 0.0 <= self.oneshot_frac < 1.0:
            raise ValueError(f"oneshot_frac must be in [0, 1), got {self.oneshot_frac}")
        if self.task[1] < 1 or self.oneshot_body[1] < 1:
            raise ValueError("task and oneshot_body must allow at least one token")


def _tokens(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(vocab) for _ in range(n)]


def generate_trace(cfg: GeneratorConfig) -> Trace:
    """Build a seeded agentic trace.

    Sessions: up to ``concurrency`` agent sessions are open at once; when one
    ends the next starts, until ``sessions`` have run. Each turn sends the
    whole conversation: system prompt + task + for every earlier turn the
    model output and the tool output (or a user message) that followed it.
    Turns of different sessions interleave in the order of a simulated clock
    (each session waits a log-normal "tool latency" between turns around a
    per-session mean, so quick tool calls, slow ones and fast and slow agents
    mix). A session either runs all
    its turns and is closed after the last one, or (with probability
    ``abandon``) stops after a random earlier turn and is never closed.

    One-shot traffic: ``oneshot_frac`` of all requests, inserted at uniformly
    random positions. Each is one of ``oneshot_templates`` short app prompts
    followed by a unique body.
    """
    cfg.validate()
    rng = random.Random(cfg.seed)
    vocab = cfg.vocab
    system = _tokens(rng, cfg.system_prompt, vocab)

    # Plan the sessions.
    plans = []
    for i in range(cfg.sessions):
        lo, hi = max(1, cfg.turns - cfg.turns // 4), cfg.turns + cfg.turns // 4
        n_turns = rng.randint(lo, hi)
        abandoned = n_turns > 1 and rng.random() < cfg.abandon
        if abandoned:
            n_turns = rng.randint(1, n_turns - 1)
        plans.append({
            "sid": f"agent-{i}",
            "turns": n_turns,
            "abandoned": abandoned,
            "latency": rng.uniform(0.5, 2.0),
        })

    # Simulated clock: a heap of (arrival time, tie-break seq, plan index).
    heap: list = []
    seq = 0
    state: dict = {}
    started = 0
    session_events: list = []

    def start(idx: int, t: float) -> None:
        nonlocal seq
        task = _tokens(rng, rng.randint(*cfg.task), vocab)
        state[idx] = {"context": system + task, "turn": 0}
        # First turn shortly after the session starts.
        heapq.heappush(heap, (t + rng.expovariate(2.0), seq, idx))
        seq += 1

    while started < min(cfg.concurrency, cfg.sessions):
        start(started, 0.0)
        started += 1

    while heap:
        now, _, idx = heapq.heappop(heap)
        plan, st = plans[idx], state[idx]
        st["turn"] += 1
        output = _tokens(rng, rng.randint(*cfg.model_output), vocab)
        last = st["turn"] == plan["turns"]
        close = last and not plan["abandoned"]
        session_events.append(
            TraceRequest(list(st["context"]), output, session_id=plan["sid"],
                         close=close, turn=st["turn"], time=now * cfg.time_scale)
        )
        if last:
            del state[idx]
            if started < cfg.sessions:
                start(started, now)
                started += 1
            continue
        if rng.random() < cfg.user_followup:
            added = _tokens(rng, rng.randint(*cfg.user_message), vocab)
        else:
            added = _tokens(rng, rng.randint(*cfg.tool_output), vocab)
        st["context"] = st["context"] + output + added
        sigma = cfg.latency_sigma
        # Log-normal with mean plan["latency"].
        delay = rng.lognormvariate(math.log(plan["latency"]) - sigma * sigma / 2, sigma)
        heapq.heappush(heap, (now + delay, seq, idx))
        seq += 1

    # One-shot traffic at random positions.
    n_session = len(session_events)
    n_oneshot = int(round(n_session * cfg.oneshot_frac / (1.0 - cfg.oneshot_frac)))
    templates = [_tokens(rng, cfg.oneshot_template, vocab)
                 for _ in range(cfg.oneshot_templates)]
    slots = sorted(rng.randrange(n_session + 1) for _ in range(n_oneshot))
    oneshot_body = _shared_doc_bodies(rng, cfg) if cfg.shared_docs else (
        lambda: _tokens(rng, rng.randint(*cfg.oneshot_body), vocab))
    events: list = []
    j = 0
    for pos in range(n_session + 1):
        # One-shots in a gap arrive evenly between its two session turns.
        t_lo = session_events[pos - 1].time if pos > 0 else 0.0
        t_hi = session_events[pos].time if pos < n_session else t_lo
        in_gap = sum(1 for k in range(j, len(slots)) if slots[k] == pos)
        for k in range(in_gap):
            body = oneshot_body()
            prompt = rng.choice(templates) + body
            if not prompt:
                prompt = _tokens(rng, 1, vocab)
            events.append(TraceRequest(
                prompt, _tokens(rng, rng.randint(*cfg.oneshot_output), vocab),
                time=t_lo + (t_hi - t_lo) * (k + 1) / (in_gap + 1)))
        j += in_gap
        if pos < n_session:
            events.append(session_events[pos])

    params = {k: (list(v) if isinstance(v, tuple) else v)
              for k, v in cfg.__dict__.items()}
    params["abandoned_sessions"] = sum(1 for p in plans if p["abandoned"])
    return Trace(events, source="generated", params=params)


def _shared_doc_bodies(rng: random.Random, cfg: GeneratorConfig):
    """One-shot bodies over shared documents: a document drawn with
    popularity ~ 1/rank, then a unique question."""
    docs = [_tokens(rng, rng.randint(*cfg.doc_tokens), cfg.vocab)
            for _ in range(cfg.shared_docs)]
    weights = [1.0 / (k + 1) for k in range(cfg.shared_docs)]

    def body() -> list:
        doc = rng.choices(docs, weights)[0]
        return doc + _tokens(rng, rng.randint(*cfg.doc_question), cfg.vocab)

    return body


def _inserted(ev: TraceRequest) -> list:
    # What cache_finished_req inserts: the prompt plus every output token but
    # the last (the last sampled token never gets KV).
    return ev.prompt + ev.output[: max(0, len(ev.output) - 1)]


def ideal_stats(trace: Trace) -> dict:
    """What an infinite FULL cache (page size 1) would do with ``trace``.

    ``hit_tokens``: prompt tokens reused -- for each request the longest prefix
    of its prompt (without the last token, which the scheduler always
    recomputes) already inserted by an earlier request.
    ``footprint``: distinct tokens the cache would hold at the end.
    """
    children: dict = {}  # (node id, token) -> node id; node 0 is the root
    hit = 0
    nodes = 0
    for ev in trace.events:
        if not isinstance(ev, TraceRequest):
            continue
        node = 0
        limit = len(ev.prompt) - 1
        for pos, t in enumerate(ev.prompt):
            if pos >= limit:
                break
            nxt = children.get((node, t))
            if nxt is None:
                break
            node = nxt
            hit += 1
        node = 0
        for t in _inserted(ev):
            key = (node, t)
            nxt = children.get(key)
            if nxt is None:
                nodes += 1
                nxt = children[key] = nodes
            node = nxt
    return {"hit_tokens": hit, "footprint": nodes}
