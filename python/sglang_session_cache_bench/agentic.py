"""Agentic-session benchmark: replay multi-turn agent sessions through the real,
patched SGLang ``UnifiedRadixCache`` on CPU, with the session cache off and on.

    python -m sglang_session_cache_bench.agentic [--quick] [--trace FILE.jsonl]
    sglang-session-cache-bench ...            (the same, once installed)

Workload (``--trace`` replaces it with a recorded one; format in
``sglang_session_cache_bench.trace``): up to ``--concurrency`` agent sessions
are open at once, ``--sessions`` in total. Every turn resends the whole
conversation -- a shared system prompt, the task, and for each earlier turn the
model's output and the tool output (or user message) appended after it -- so
all reuse comes from the prefix cache. Some sessions are closed after their
last turn; others are abandoned mid-way and never closed. Unrelated one-shot
requests (a few app templates + unique bodies) make up ``--oneshot-frac`` of
the traffic and arrive interleaved.

``--trace`` also reads Mooncake/aiperf traces (``sglang_session_cache_bench.mooncake``);
``--tag``/``--close``/``--mode`` replay the trace as clients that tag and close
differently would send it (``sglang_session_cache_bench.workload_modes``).

Replay: for every shape (FULL, FULL+SWA, FULL+SWA+Mamba) and every pool size,
the same trace runs twice on a fresh cache built by
``sglang_session_cache_bench.harness`` -- once with ``enable_session=False`` and once
with ``enable_session=True``. Each request goes through what the scheduler
does: ``ensure_session_generation`` on arrival, prefill
(``init_next_round_input`` match, lock, ``alloc_for_extend`` with eviction),
``output_len - 1`` decode steps, ``release_kv_cache`` (``cache_finished_req``,
where the session reference is registered); a close calls
``release_radix_session``. Requests run one at a time, in trace order and in
trace time: each event's ``time`` is the session cache's clock
(``sglang_session_cache_bench.trace_clock``), so ``--session-radix-cache-ttl``
expires idle sessions as it would on a server.

Metrics (per run):

hit rate
    reused prompt tokens / prompt tokens, where *reused* is the prefix the
    request matched on device at admission (``len(req.prefix_indices)`` after
    ``init_next_round_input``) and *prompt tokens* count every prompt token of
    every request. ``session`` and ``one-shot`` split it by request class.
kept
    share of follow-up session turns (turn >= 2) whose match covered at least
    the previous turn's whole prompt: the session's history survived.
recomputed
    prompt tokens - reused tokens (what prefill had to compute).
evicted
    FULL tokens the cache evicted (sum of ``EvictResult.num_tokens_evicted``
    over every ``evict`` call); SWA tokens and Mamba states are in the JSON.
ms/req
    wall time per request (prefill + decode + finish, evictions included) on
    this CPU harness -- it measures the cache bookkeeping, not a model, and
    single runs are noisy: ``request_cost`` measures the cost paired.
gain
    on - off in hit-rate points, and relative, (on - off) / off.
windows (``--windows N``)
    the hit rate off and on within each of N equal windows of the trace's
    requests, and the relative gain per window.  The learned protection
    (``--session-radix-cache-max-protected-fraction auto``) starts from full
    protection and settles as evidence comes in, so the first window shows
    its warm-up and the later ones where it settled; several ``--mode`` runs
    also print the worst window after the first.

At the end of each run the harness's ``check()`` (``sanity_check`` + exact
slot conservation for every pool) runs, session state is validated, and the
whole tree is evicted to confirm every pool comes back free. Anything wrong is
listed under ``issues`` (stdout and JSON) and the exit status is 1.

Outputs: a table per shape on stdout, progress on stderr, and in ``--out``
(default ``bench_out/``): ``agentic_results.json`` (rewritten after every run,
so a run cut short keeps what it measured) and ``agentic_hit_rate.png`` (hit
rate vs pool size, off vs on, one panel per shape).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from sglang_session_cache_bench.trace import (
    GeneratorConfig,
    Trace,
    TraceClose,
    TraceError,
    generate_trace,
    ideal_stats,
    write_jsonl,
)
from sglang_session_cache.protection_policy import (
    FRACTION_FIELD,
    FROM_TURN_FIELD,
    ProtectionOptionError,
    normalize_fraction,
    normalize_from_turn,
)
from sglang_session_cache.session_ttl import SessionTTLError, normalize_ttl
from sglang_session_cache_bench import trace_clock
from sglang_session_cache_bench.trace_files import (
    add_trace_format_options,
    positive_int,
    trace_from_args,
)
from sglang_session_cache_bench.workload_modes import (
    CLOSE_CHOICES,
    DEFAULT_MODE_TTL,
    MODES,
    TAG_CHOICES,
    apply_policy,
    mode_ttl,
)
from sglang_session_cache_bench.trace_clock import TraceClock

logger = logging.getLogger(__name__)

SHAPES = ("full", "swa", "swa_mamba")
SHAPE_TITLES = {"full": "FULL", "swa": "FULL+SWA", "swa_mamba": "FULL+SWA+Mamba"}
# Pool sizes as a share of the trace's footprint (distinct tokens an infinite
# cache would hold at the end); an explicit token count works too.
DEFAULT_SIZES = ("3%", "5%", "8%", "12%", "16%", "24%")
QUICK_SIZES = ("12%", "25%")
SLIDING_WINDOW = 128
# SGLang's default --swa-full-tokens-ratio.
SWA_FULL_TOKENS_RATIO = 0.8
# Mamba state slots per pool token (one state per 128 KV tokens), plus room
# for admissions (alloc_req_slots wants 3 free slots per request).
MAMBA_TOKENS_PER_SLOT = 128
MAX_NUM_REQS = 4

RESULTS_JSON = "agentic_results.json"
PLOT_PNG = "agentic_hit_rate.png"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------


def _parse_sizes(text: str) -> list:
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if part.endswith("%"):
                v = float(part[:-1])
                if not 0 < v <= 1000:
                    raise ValueError
                sizes.append(part)
            else:
                v = int(part.replace("_", ""))
                if v <= 0:
                    raise ValueError
                sizes.append(v)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad size {part!r}: give a token count (e.g. 30000) or a share "
                f"of the trace footprint (e.g. 15%)"
            ) from None
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes is empty")
    return sizes


def pool_size_option(text: str):
    """An argparse type: one pool size, a token count or a share of the
    trace footprint (``8%``), checked like ``--sizes``."""
    sizes = _parse_sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"give one pool size, got {text!r}")
    return sizes[0]


def parse_shapes(text: str) -> list:
    shapes = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise argparse.ArgumentTypeError(
            f"unknown shape(s) {bad}; choose from {', '.join(SHAPES)}"
        )
    return list(dict.fromkeys(shapes))


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _protection_option(normalize):
    """An argparse type from a protection_policy normalizer (``auto`` or a
    value), reporting its error as a usage error."""

    def parse(text: str):
        try:
            return normalize(text)
        except ProtectionOptionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


fraction_option = _protection_option(normalize_fraction)
from_turn_option = _protection_option(normalize_from_turn)


def _parse_modes(text: str) -> list:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))


def _ttl(text: str) -> Optional[float]:
    try:
        return normalize_ttl(text)
    except SessionTTLError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    d = GeneratorConfig()
    p = argparse.ArgumentParser(
        prog="sglang-session-cache-bench",
        description=(
            "Replay multi-turn agentic sessions through the real patched "
            "UnifiedRadixCache (CPU) with the session cache off and on, for "
            "FULL, FULL+SWA and FULL+SWA+Mamba caches and several pool sizes."
        ),
        epilog=("The same trace against live servers over HTTP: "
                "sglang-session-cache-bench live --help"),
    )
    w = p.add_argument_group("workload (built-in generator)")
    w.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    w.add_argument("--sessions", type=positive_int, default=None,
                   help=f"agent sessions in the trace (default {d.sessions})")
    w.add_argument("--concurrency", type=positive_int, default=None,
                   help=f"sessions open at the same time (default {d.concurrency})")
    w.add_argument("--turns", type=positive_int, default=None,
                   help=f"mean turns per session (default {d.turns})")
    w.add_argument("--system-prompt", type=int, default=None, metavar="TOKENS",
                   help=f"shared agent system prompt (default {d.system_prompt})")
    w.add_argument("--oneshot-frac", type=_fraction, default=None,
                   help=f"share of requests that are one-shot (default {d.oneshot_frac})")
    w.add_argument("--abandon", type=_fraction, default=None,
                   help=f"share of sessions abandoned without close (default {d.abandon})")
    w.add_argument("--shared-docs", type=int, default=None, metavar="N",
                   help="one-shot requests read one of N shared documents, so "
                        "one-shot traffic shares prefixes (default 0: unique bodies)")
    w.add_argument("--trace", metavar="FILE.jsonl",
                   help="replay a recorded trace instead of generating one")
    add_trace_format_options(w)
    w.add_argument("--save-trace", metavar="FILE.jsonl",
                   help="also write the replayed trace as JSONL")
    c = p.add_argument_group(
        "client behaviour (how requests are tagged and sessions end)")
    c.add_argument("--mode", type=_parse_modes, default=None, metavar="MODE[,MODE...]",
                   help="named presets of --tag/--close/TTL, run one after another: "
                        + "; ".join(f"{m.name}: {m.about}" for m in MODES.values())
                        + f" (the TTL modes use {DEFAULT_MODE_TTL:g}s unless "
                          "--session-radix-cache-ttl is given)")
    c.add_argument("--tag", choices=TAG_CHOICES, default="sessions",
                   help="sessions: as the trace says; all: every one-shot request "
                        "gets a session id of its own, never closed (default sessions)")
    c.add_argument("--close", choices=CLOSE_CHOICES, default="auto",
                   help="auto: as the trace says; last-turn: close every session "
                        "after its last request; never: drop every close (default auto)")
    c.add_argument("--session-radix-cache-ttl", type=_ttl, default=None, metavar="SECONDS",
                   dest="ttl",
                   help="idle TTL of the session cache, in trace time (generated "
                        "clock, JSONL 'time', Mooncake 'timestamp'); default off")
    c.add_argument("--session-radix-cache-protect-from-turn", type=from_turn_option,
                   default=None, metavar="N|auto", dest="protect_from_turn",
                   help="session on: protect a session from its N-th request, or "
                        "'auto' (learned from how often sessions return; "
                        "default: the server default)")
    c.add_argument("--session-radix-cache-max-protected-fraction", type=fraction_option,
                   default=None, metavar="F|auto", dest="max_protected_fraction",
                   help="session on: most of each pool that references may "
                        "protect, or 'auto' (learned; default: the server default)")
    c.add_argument("--baseline", action="store_true",
                   help="also replay with the protection before earned protection "
                        "and the bound (first request protected, no bound: "
                        "protect-from-turn 1, max-protected-fraction 1) and report "
                        "the share of its gain that the session-on run keeps")
    r = p.add_argument_group("replay")
    r.add_argument("--shapes", type=parse_shapes, default=list(SHAPES),
                   help=f"comma list of {','.join(SHAPES)} (default: all)")
    r.add_argument("--sizes", type=_parse_sizes, default=None,
                   help=("comma list of pool sizes: token counts or shares of the "
                         "trace footprint, e.g. 30000,15%% (default "
                         + ",".join(DEFAULT_SIZES).replace("%", "%%") + ")"))
    r.add_argument("--windows", type=positive_int, default=None, metavar="N",
                   help="also report the hit rate in N equal windows of the trace's "
                        "requests, off and on: how the gain develops while the "
                        "learned protection settles (the first window is its warm-up)")
    r.add_argument("--check-every", type=int, default=0, metavar="N",
                   help="also run the slot-conservation check every N requests")
    r.add_argument("--quick", action="store_true",
                   help="tiny run (12 sessions, 2 sizes) for smoke tests")
    r.add_argument("--out", default="bench_out",
                   help="output directory for the JSON and PNG (default bench_out/)")
    r.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def _generator_config(args) -> GeneratorConfig:
    cfg = GeneratorConfig(seed=args.seed)
    if args.quick:
        cfg.sessions, cfg.concurrency, cfg.turns = 12, 8, 5
        cfg.system_prompt = 256
        cfg.oneshot_templates = 2
        cfg.oneshot_body = (64, 512)
    for name in ("sessions", "concurrency", "turns", "system_prompt",
                 "oneshot_frac", "abandon", "shared_docs"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    return cfg


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


@dataclass
class RunStats:
    shape: str
    pool_tokens: int
    session: bool
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    session_prompt_tokens: int = 0
    session_reused_tokens: int = 0
    oneshot_prompt_tokens: int = 0
    oneshot_reused_tokens: int = 0
    followups: int = 0
    followups_kept: int = 0
    requests_with_hit: int = 0  # requests that reused > 0 tokens
    evicted_tokens: int = 0
    evicted_swa_tokens: int = 0
    evicted_mamba_states: int = 0
    evict_calls: int = 0
    closes: int = 0  # close events
    sessions_closed: int = 0  # closes that ended an open session
    released_refs: int = 0
    request_seconds: float = 0.0
    # Cache work of every event (requests, closes, clock ticks).
    event_seconds: float = 0.0
    seconds: float = 0.0
    stream_digest: str = ""
    issues: list = field(default_factory=list)
    # The session metrics a server would export, read at the end of the
    # trace: what protection learned (scale, return rate, first-turn rule)
    # and the lifecycle counters (opened, closed, expired, ...).
    session_metrics: dict = field(default_factory=dict)
    # ``--windows``: (prompt tokens, reused tokens) so far at the end of each
    # window of requests, so a run shows how its hit rate develops (the
    # learned protection starts from full protection and settles later).
    window_marks: list = field(default_factory=list)

    @property
    def window_hit_rates(self) -> list:
        """Hit rate within each ``--windows`` window, in trace order."""
        out, prompt, reused = [], 0, 0
        for p, r in self.window_marks:
            out.append(_ratio(r - reused, p - prompt))
            prompt, reused = p, r
        return out

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hit_rate
        d["session_hit_rate"] = _ratio(self.session_reused_tokens, self.session_prompt_tokens)
        d["oneshot_hit_rate"] = _ratio(self.oneshot_reused_tokens, self.oneshot_prompt_tokens)
        d["kept_rate"] = _ratio(self.followups_kept, self.followups)
        d["recomputed_tokens"] = self.recomputed_tokens
        d["ms_per_request"] = self.ms_per_request
        if self.window_marks:
            d["window_hit_rates"] = self.window_hit_rates
        return d

    @property
    def hit_rate(self) -> float:
        return _ratio(self.reused_tokens, self.prompt_tokens)

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def ms_per_request(self) -> float:
        return 1000.0 * self.request_seconds / self.requests if self.requests else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def make_harness(shape: str, pool_tokens: int, enable_session: bool, max_context_len: int):
    """A fresh real cache of ``shape`` with a ``pool_tokens`` FULL pool."""
    from sglang_session_cache_bench import harness as hz

    swa_tokens = max(1, int(pool_tokens * SWA_FULL_TOKENS_RATIO))
    common = dict(enable_session=enable_session, max_num_reqs=MAX_NUM_REQS,
                  max_context_len=max_context_len)
    if shape == "full":
        return hz.make_full_cache(num_tokens=pool_tokens, page_size=1, **common)
    if shape == "swa":
        return hz.make_swa_cache(
            num_tokens=pool_tokens, swa_num_tokens=swa_tokens, page_size=1,
            sliding_window_size=SLIDING_WINDOW, **common)
    if shape == "swa_mamba":
        return hz.make_swa_mamba_cache(
            num_tokens=pool_tokens, swa_num_tokens=swa_tokens,
            mamba_num_slots=mamba_slots(pool_tokens), page_size=1,
            sliding_window_size=SLIDING_WINDOW, **common)
    raise ValueError(f"unknown shape {shape!r}")


def mamba_slots(pool_tokens: int) -> int:
    return pool_tokens // MAMBA_TOKENS_PER_SLOT + 3 * MAX_NUM_REQS


def min_pool_tokens(trace: Trace) -> int:
    """Smallest FULL pool that can run the trace's longest request (its SWA
    pool is ``SWA_FULL_TOKENS_RATIO`` of it and needs the whole prompt)."""
    longest = trace.summary()["max_request_tokens"]
    return int(longest / SWA_FULL_TOKENS_RATIO) + 2


def _count_evictions(cache, stats: RunStats) -> None:
    """Wrap ``cache.evict`` on this instance to sum what each call evicted."""
    orig = cache.evict

    def evict(params):
        result = orig(params)
        stats.evict_calls += 1
        stats.evicted_tokens += result.num_tokens_evicted
        stats.evicted_swa_tokens += result.swa_num_tokens_evicted
        stats.evicted_mamba_states += result.mamba_num_evicted
        return result

    cache.evict = evict


def replay(trace: Trace, shape: str, pool_tokens: int, enable_session: bool,
           check_every: int = 0, ttl: Optional[float] = None, windows: int = 0) -> RunStats:
    """Run ``trace`` once on a fresh cache, in trace time (each event's
    ``time`` is the session cache's clock, so ``ttl`` expires idle sessions
    as the trace unfolds); see the module doc for metrics.  ``windows``:
    also record the hit rate in that many equal windows of requests."""
    steps = replay_steps(trace, shape, pool_tokens, enable_session, check_every, ttl,
                         windows=windows)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def replay_steps(trace: Trace, shape: str, pool_tokens: int, enable_session: bool,
                 check_every: int = 0, ttl: Optional[float] = None,
                 timer=time.perf_counter, windows: int = 0):
    """``replay`` one event at a time: a generator that yields before every
    trace event and once after the last (before the end-of-run checks), and
    returns the ``RunStats`` (``StopIteration.value``), so two caches can
    replay the same trace in lockstep (``request_cost``).
    ``timer`` times the cache work of each event (``RunStats.event_seconds``)."""
    summary = trace.summary()
    h = make_harness(shape, pool_tokens, enable_session,
                     max_context_len=summary["max_request_tokens"] + 8)
    cache = h.cache
    clock = TraceClock()
    trace_clock.attach(cache, clock, ttl)
    stats = RunStats(shape=shape, pool_tokens=pool_tokens, session=enable_session)
    _count_evictions(cache, stats)
    digest = hashlib.blake2b(digest_size=16)
    prev_prompt_len: dict = {}
    open_ids: set = set()
    # The request count that ends each window (at most one window per
    # request, so every window holds at least one).
    windows = min(windows, summary["requests"])
    window_ends = [summary["requests"] * (k + 1) // windows for k in range(windows)]
    t_run = time.perf_counter()
    for ev in trace.events:
        yield
        t_ev = timer()
        clock.advance(ev.time)
        if isinstance(ev, TraceClose):
            stats.released_refs += cache.release_radix_session(ev.session_id) or 0
            stats.event_seconds += timer() - t_ev
            stats.closes += 1
            stats.sessions_closed += ev.session_id in open_ids
            open_ids.discard(ev.session_id)
            prev_prompt_len.pop(ev.session_id, None)
            digest.update(b"C" + ev.session_id.encode())
            continue
        sid = ev.session_id
        t0 = timer()
        req = h.new_req(ev.prompt, session_id=sid, output_ids=ev.output)
        # A request "arrives": the scheduler stamps its session generation.
        cache.ensure_session_generation(req)
        n_out = len(ev.output)
        matched = h.prefill(req, finishing=n_out <= 1)
        if n_out > 1:
            h.decode(req, n_out - 1)
        h.finish(req)
        if ev.close:
            stats.released_refs += cache.release_radix_session(sid) or 0
        t1 = timer()
        stats.request_seconds += t1 - t0
        stats.event_seconds += t1 - t_ev

        if sid is not None:
            open_ids.add(sid)
        if ev.close:
            stats.closes += 1
            stats.sessions_closed += 1
            open_ids.discard(sid)
        digest.update(b"R" + (sid or "").encode() + b"\0")
        digest.update(req.origin_input_ids.tobytes())
        digest.update(n_out.to_bytes(4, "little"))
        n = len(ev.prompt)
        stats.requests += 1
        stats.prompt_tokens += n
        stats.reused_tokens += matched
        stats.requests_with_hit += matched > 0
        if ev.is_oneshot:
            stats.oneshot_prompt_tokens += n
            stats.oneshot_reused_tokens += matched
        else:
            stats.session_prompt_tokens += n
            stats.session_reused_tokens += matched
            prev = prev_prompt_len.get(sid)
            if prev is not None:
                stats.followups += 1
                stats.followups_kept += matched >= prev
            if ev.close:
                prev_prompt_len.pop(sid, None)
            else:
                prev_prompt_len[sid] = n
        while (len(stats.window_marks) < windows
               and window_ends[len(stats.window_marks)] <= stats.requests):
            stats.window_marks.append((stats.prompt_tokens, stats.reused_tokens))
        if check_every and stats.requests % check_every == 0:
            _check(h, stats, f"after request {stats.requests}")
    # The trace is done; what follows are the checks (a profiler stops here).
    yield
    stats.seconds = time.perf_counter() - t_run
    stats.stream_digest = digest.hexdigest()
    del cache.evict  # stop counting: the checks below evict everything
    _check(h, stats, "end of trace")
    if getattr(cache, "session_ref_tracker", None) is not None:
        stats.session_metrics = cache.session_metrics()
    _check_drains(h, stats)
    return stats


def _check(h, stats: RunStats, when: str) -> None:
    try:
        h.check()
        if stats.session:
            h.cache.validate_session_state()
    except Exception as exc:  # reported, not hidden
        stats.issues.append(f"{when}: {type(exc).__name__}: {exc}")


def _check_drains(h, stats: RunStats) -> None:
    """Evict everything: soft protection means every pool must come back free."""
    try:
        h.evict_all()
        avail = h.available()
        problems = []
        if avail["full"] != h.full_allocator.size:
            problems.append(f"full {avail['full']}/{h.full_allocator.size} free")
        if h.has_swa and avail["swa"] != h.swa_allocator.size:
            problems.append(f"swa {avail['swa']}/{h.swa_allocator.size} free")
        if h.mamba_allocator is not None and avail["mamba"] != h.mamba_allocator.size:
            problems.append(f"mamba {avail['mamba']}/{h.mamba_allocator.size} free")
        if problems:
            stats.issues.append("after evicting everything: " + ", ".join(problems))
        h.check()
    except Exception as exc:
        stats.issues.append(f"evict-all: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------


def resolve_sizes(sizes: list, footprint: int, minimum: int,
                  notes: Optional[list] = None) -> list:
    """Requested sizes -> sorted distinct pool sizes in tokens. Raised and
    merged sizes are logged and, when ``notes`` is given, described there."""
    out: dict = {}  # tokens -> requested labels
    for s in sizes:
        tokens = int(round(footprint * float(s[:-1]) / 100.0)) if isinstance(s, str) else s
        label = s if isinstance(s, str) else f"{s:,}"
        if tokens < minimum:
            msg = (f"pool size {label} ({tokens:,} tokens) raised to {minimum:,} tokens: "
                   f"the longest request needs that")
            logger.warning(msg)
            if notes is not None:
                notes.append(msg)
            tokens = minimum
        out.setdefault(tokens, []).append(label)
    for tokens, labels in out.items():
        if len(labels) > 1 and notes is not None:
            notes.append(f"pool sizes {' and '.join(labels)} are all {tokens:,} tokens: "
                         f"run once")
    return sorted(out)


def run_benchmark(args, trace: Trace, ttl: Optional[float] = None,
                  on_cell=None) -> dict:
    """The sweep: every shape x size x (off, on). Returns the results dict
    that is written as JSON; ``on_cell(results)`` is called after every run
    so a caller can save what has been measured so far."""
    import torch

    from sglang_session_cache_bench.harness import release_server_args

    # The pools' index tensors are small; with more than one intra-op thread,
    # every allocator torch.cat pays a thread-pool hand-off (measured ~7 ms vs
    # ~0.02 ms for a 100k-element cat on a 2-core box), which would swamp the
    # cache bookkeeping this benchmark times. Same setting for off and on.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sweep(args, trace, ttl, on_cell or (lambda results: None))
    finally:
        torch.set_num_threads(threads)
        release_server_args()


def _sweep(args, trace: Trace, ttl: Optional[float], on_cell) -> dict:
    summary = trace.summary()
    ideal = ideal_stats(trace)
    footprint = ideal["footprint"]
    size_notes: list = []
    sizes = resolve_sizes(
        args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES),
        footprint, min_pool_tokens(trace), size_notes)
    results = {
        "trace": summary,
        "trace_params": trace.params,
        "workload": {"tag": trace.params.get("tag", "sessions"),
                     "close": trace.params.get("close", "auto"),
                     "session_radix_cache_ttl": ttl},
        "ideal": {
            "hit_tokens": ideal["hit_tokens"],
            "hit_rate": _ratio(ideal["hit_tokens"], summary["prompt_tokens"]),
            "footprint_tokens": footprint,
        },
        "config": {
            "page_size": 1,
            "sliding_window": SLIDING_WINDOW,
            "swa_full_tokens_ratio": SWA_FULL_TOKENS_RATIO,
            "mamba_tokens_per_slot": MAMBA_TOKENS_PER_SLOT,
            "max_num_reqs": MAX_NUM_REQS,
            "eviction_policy": "lru",
            "sizes": sizes,
            "size_notes": size_notes,
        },
        "shapes": {},
        "issues": [],
        "complete": False,
    }
    t0 = time.perf_counter()
    keys = ("off", "on") + (("base",) if getattr(args, "baseline", False) else ())
    n_runs = len(args.shapes) * len(sizes) * len(keys)
    done = 0
    try:
        for shape in args.shapes:
            rows = results["shapes"].setdefault(shape, [])
            for pool in sizes:
                row = {"pool_tokens": pool, "pool_share": _ratio(pool, footprint)}
                rows.append(row)
                for key in keys:
                    st = _run_cell(args, trace, results, shape, pool, key, ttl)
                    done += 1
                    row[key] = st.as_dict() if st is not None else None
                    _finish_row(results, shape, row)
                    on_cell(results)
                    if st is not None:
                        _log(f"[agentic] {done}/{n_runs} {SHAPE_TITLES[shape]:<15} "
                             f"pool={pool:>7,} session={key:<3} hit={st.hit_rate:.3f} "
                             f"{st.seconds:5.1f}s (elapsed {time.perf_counter() - t0:6.1f}s)")
        results["complete"] = True
    except KeyboardInterrupt:
        results["interrupted"] = True
        _log(f"[agentic] interrupted after {done}/{n_runs} runs; keeping what was measured")
    results["seconds"] = time.perf_counter() - t0
    return results


#: The ``base`` runs: session protection as before earned protection and the
#: bound existed (every finished request protected, nothing withdrawn).
BASELINE_OPTIONS = {FROM_TURN_FIELD: 1, FRACTION_FIELD: 1.0}


def _run_cell(args, trace, results, shape, pool, key, ttl) -> Optional[RunStats]:
    from sglang_session_cache_bench import harness

    on = key != "off"
    where = f"{SHAPE_TITLES[shape]} pool={pool} session={key}"
    options = harness.SESSION_SERVER_ARGS
    if key == "base":
        options = dict(options, **BASELINE_OPTIONS)
    try:
        with harness.session_server_args(options):
            st = replay(trace, shape, pool, on, check_every=args.check_every,
                        ttl=ttl if on else None, windows=args.windows or 0)
    except Exception as exc:
        traceback.print_exc()
        results["issues"].append(f"{where}: replay failed: {type(exc).__name__}: {exc}")
        return None
    results["issues"].extend(f"{where}: {issue}" for issue in st.issues)
    return st


def _relative_gain(off: float, on: float) -> Optional[float]:
    """(on - off) / off, or ``None`` when off reused nothing."""
    return (on - off) / off if off else None


def _finish_row(results: dict, shape: str, row: dict) -> None:
    if not (row.get("off") and row.get("on")):
        return
    off, on_ = row["off"]["hit_rate"], row["on"]["hit_rate"]
    row["gain"] = _relative_gain(off, on_)
    row["gain_points"] = 100.0 * (on_ - off)
    offs, ons = row["off"].get("window_hit_rates"), row["on"].get("window_hit_rates")
    if offs and ons:
        row["window_gains"] = [_relative_gain(a, b) for a, b in zip(offs, ons)]
    if row.get("base"):
        base_points = 100.0 * (row["base"]["hit_rate"] - off)
        row["base_gain_points"] = base_points
        # Share of the baseline's gain the session-on run keeps.
        row["kept_of_base"] = row["gain_points"] / base_points if base_points > 0 else None
    if any(row[k] and row[k]["stream_digest"] != row["off"]["stream_digest"]
           for k in ("on", "base") if k in row):
        results["issues"].append(
            f"{SHAPE_TITLES[shape]} pool={row['pool_tokens']}: off and on replayed "
            f"different request streams")


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else f"{n:,}"


COST_BENCH = "python -m sglang_session_cache_bench.request_cost"
LEGEND = [
    "pool = FULL pool in tokens (%fp: share of the footprint); hit = reused "
    "prompt tokens / prompt tokens (device prefix match at admission);",
    "kept = follow-up turns that matched their whole previous prompt; evicted = "
    "FULL tokens evicted; gain = on - off in points (relative in brackets);",
    "ms/req = wall time per request on this CPU harness: noisy, single runs; for "
    f"the cost of sessions use the paired benchmark ({COST_BENCH})",
]


def _share(share: float) -> str:
    return f"{100 * share:.1f}%" if share < 0.1 else f"{100 * share:.0f}%"


def _relative(gain: Optional[float]) -> str:
    return "n/a" if gain is None else f"{100 * gain:+.1f}%"


def _gain(row: dict) -> str:
    if row.get("gain_points") is None:
        return ""
    rel = f" ({_relative(row['gain'])})" if row.get("gain") is not None else ""
    return f"{row['gain_points']:+.1f} pt{rel}"


def format_tables(results: dict, legend: bool = True) -> str:
    s = results["trace"]
    ideal = results["ideal"]
    wl = results.get("workload", {})
    ttl = wl.get("session_radix_cache_ttl")
    mode = results.get("mode")
    lines = [
        f"Agentic sessions on the real UnifiedRadixCache (CPU): {s['requests']} requests "
        f"= {s['session_requests']} session turns in {s['sessions']} sessions "
        f"({s.get('sessions_closed', s['closes'])} closed) + {s['oneshot_requests']} "
        f"one-shot; {s['prompt_tokens']:,} prompt tokens",
        f"trace: {s['source']}; footprint {ideal['footprint_tokens']:,} tokens; "
        f"infinite-cache hit rate (FULL, page 1) {ideal['hit_rate']:.3f}; "
        f"{s.get('duration_s', 0.0):,.0f} s of trace time",
        (f"mode {mode}: " if mode else "")
        + f"tag {wl.get('tag', 'sessions')}"
        + (f" ({s['tagged_oneshots']} one-shots tagged with their own id)"
           if s.get("tagged_oneshots") else "")
        + f", close {wl.get('close', 'auto')}, session TTL "
        + (f"{ttl:g} s of trace time (sessions on)" if ttl else "off"),
    ]
    if legend:
        lines += LEGEND
        if any(row.get("base") for rows in results["shapes"].values() for row in rows):
            lines.append("base = session on with the protection before earned "
                         "protection and the bound (first request protected, no bound); "
                         "'% of base' = share of its gain kept")
    for note in results["config"].get("size_notes", []):
        lines.append(f"note: {note}")
    header = (f"{'pool':>8} {'%fp':>5} {'session':>7} {'hit':>6} {'session':>8} "
              f"{'one-shot':>8} {'kept':>5} {'reused':>8} {'recomputed':>10} "
              f"{'evicted':>8} {'ms/req':>6}  gain")
    for shape, rows in results["shapes"].items():
        lines.append("")
        lines.append(f"== {SHAPE_TITLES[shape]} ==")
        lines.append(header)
        for row in rows:
            first = True
            for key in ("off", "on", "base"):
                if key not in row:
                    continue  # the run was cut short or no baseline
                r = row[key]
                pool = f"{row['pool_tokens']:,}" if first else ""
                share = _share(row["pool_share"]) if first else ""
                first = False
                if r is None:
                    lines.append(f"{pool:>8} {share:>5} {key:>7}  FAILED (see issues)")
                    continue
                gain = _gain(row) if key == "on" else ""
                if key == "on" and row.get("kept_of_base") is not None:
                    gain += f", {100 * row['kept_of_base']:.0f}% of base"
                if key == "base" and row.get("base_gain_points") is not None:
                    gain = f"{row['base_gain_points']:+.1f} pt"
                expired = r.get("session_metrics", {}).get("expired", 0)
                if key == "on" and ttl:
                    gain += f"  [{expired} expired]"
                lines.append(
                    f"{pool:>8} {share:>5} {key:>7} {r['hit_rate']:6.3f} "
                    f"{r['session_hit_rate']:8.3f} {r['oneshot_hit_rate']:8.3f} "
                    f"{100 * r['kept_rate']:4.0f}% {_k(r['reused_tokens']):>8} "
                    f"{_k(r['recomputed_tokens']):>10} {_k(r['evicted_tokens']):>8} "
                    f"{r['ms_per_request']:6.2f}  {gain}".rstrip()
                )
            if row.get("window_gains"):
                lines.append(f"{'':>8} {'':>5} {'windows':>7}  hit off "
                             + " ".join(f"{x:.3f}" for x in row["off"]["window_hit_rates"])
                             + ", on " + " ".join(f"{x:.3f}" for x in row["on"]["window_hit_rates"])
                             + "; gain " + " ".join(_relative(g) for g in row["window_gains"]))
    lines.append("")
    if results.get("interrupted"):
        lines.append("INTERRUPTED: the rows above are the runs that finished")
    if results["issues"]:
        lines.append(f"ISSUES ({len(results['issues'])}):")
        lines.extend(f"  - {i}" for i in results["issues"])
    else:
        lines.append("issues: none (slot conservation, session state and "
                     "evict-all drain checked after every run)")
    return "\n".join(lines)


def format_mode_summary(all_results: list) -> str:
    """Several modes side by side: per mode and shape, the smallest and
    largest gain over the pool sizes, and the worst on-vs-off change relative
    to the off hit rate (negative: sessions on lost hits somewhere)."""
    shapes = list(dict.fromkeys(sh for r in all_results for sh in r["shapes"]))
    width = 30
    lines = ["== modes side by side: gain in points over all pool sizes "
             "(min .. max), worst (on - off) / off ==",
             f"{'mode':<14}" + "".join(f"{SHAPE_TITLES[sh]:>{width}}" for sh in shapes)]
    for r in all_results:
        cells = []
        for sh in shapes:
            rows = [row for row in r["shapes"].get(sh, []) if row.get("gain_points") is not None]
            if not rows:
                cells.append(f"{'-':>{width}}")
                continue
            pts = [row["gain_points"] for row in rows]
            rel = [row["gain"] for row in rows if row.get("gain") is not None]
            worst = _relative(min(rel) if rel else None)
            cells.append(f"{f'{min(pts):+.1f} .. {max(pts):+.1f} pt, {worst}':>{width}}")
        lines.append(f"{r.get('mode') or '-':<14}" + "".join(cells))

    def later_windows(rows):
        # After the first window: the learned protection's warm-up left out.
        later = [g for row in rows for g in (row.get("window_gains") or [])[1:]
                 if g is not None]
        return _relative(min(later)) if later else None

    def kept_of_base(rows):
        kept = [row["kept_of_base"] for row in rows if row.get("kept_of_base") is not None]
        return f"{100 * min(kept):.0f} .. {100 * max(kept):.0f}%" if kept else None

    for title, cell in (
            ("worst (on - off) / off in any window after the first "
             "(--windows; the first is the learned protection's warm-up)", later_windows),
            ("share of the baseline's gain kept (base: first request "
             "protected, no bound), min .. max over pool sizes", kept_of_base)):
        block = []
        for r in all_results:
            cells = [cell(r["shapes"].get(sh, [])) for sh in shapes]
            if any(c is not None for c in cells):
                block.append(f"{r.get('mode') or '-':<14}"
                             + "".join(f"{c or '-':>{width}}" for c in cells))
        if block:
            lines += ["", f"== {title} =="] + block
    return "\n".join(lines)


def write_plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.9),
                             sharey=True, squeeze=False)
    ideal = results["ideal"]["hit_rate"]
    for ax, shape in zip(axes[0], shapes):
        rows = results["shapes"][shape]
        for key, label, style in (("off", "session cache off", "o-"),
                                  ("on", "session cache on", "s-"),
                                  ("base", "on, first request protected, no bound", "^:")):
            pts = [(r["pool_tokens"] / 1000, r[key]["hit_rate"]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.axhline(ideal, color="gray", linestyle=":", label="infinite FULL cache")
        ax.set_title(SHAPE_TITLES[shape])
        ax.set_xlabel("pool size (k tokens)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("hit rate (reused / prompt tokens)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    s = results["trace"]
    mode = f"mode {results['mode']}: " if results.get("mode") else ""
    fig.suptitle(
        f"Agentic replay, {mode}{s['sessions']} sessions, {s['requests']} requests "
        f"({s['oneshot_requests']} one-shot)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def load_trace(args) -> Trace:
    """The trace as recorded or generated (no tagging/closing policy yet)."""
    trace = trace_from_args(args)
    if trace is not None:
        return trace
    try:
        return generate_trace(_generator_config(args))
    except ValueError as exc:
        raise TraceError(f"bad workload settings: {exc}") from None


def workload_runs(args, trace: Trace) -> list:
    """``(mode name or None, trace with the client policy applied, ttl)`` for
    every run of the benchmark: one per ``--mode``, else one from
    ``--tag``/``--close``/``--session-radix-cache-ttl``."""
    if not args.mode:
        return [(None, apply_policy(trace, args.tag, args.close), args.ttl)]
    return [(name, apply_policy(trace, MODES[name].tag, MODES[name].close),
             mode_ttl(MODES[name], args.ttl)) for name in args.mode]


def write_json(doc, path: str) -> None:
    """Save a benchmark result as JSON (the folder is created)."""
    # Whole file or nothing: a run cut short leaves the last complete save.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, path)


def _plot_path(out: str, mode: Optional[str]) -> str:
    if mode is None:
        return os.path.join(out, PLOT_PNG)
    stem, ext = os.path.splitext(PLOT_PNG)
    return os.path.join(out, f"{stem}_{mode}{ext}")


@contextlib.contextmanager
def _protection_published(args):
    """The protection options, on every ServerArgs the harness publishes (the
    session-on cache reads them at init, like a server). Restored on exit, so
    an in-process run (tests) leaves the harness as it found it."""
    from sglang_session_cache_bench.harness import session_server_args

    options = {}
    if args.max_protected_fraction is not None:
        options[FRACTION_FIELD] = normalize_fraction(args.max_protected_fraction)
    if args.protect_from_turn is not None:
        options[FROM_TURN_FIELD] = normalize_from_turn(args.protect_from_turn)
    with session_server_args(options):
        yield


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["live"]:  # the live-server mode (HTTP replay), its own CLI
        from sglang_session_cache_bench.live_bench import main as live_main

        return live_main(argv[1:])
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    try:
        trace = load_trace(args)
        runs = workload_runs(args, trace)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.save_trace:
        write_jsonl(trace, args.save_trace)
    s = trace.summary()
    _log(f"[agentic] trace: {s['requests']} requests ({s['session_requests']} session "
         f"turns, {s['oneshot_requests']} one-shot), {s['prompt_tokens']:,} prompt "
         f"tokens; loading SGLang ...")
    import sglang_session_cache

    # Import the harness (and with it SGLang's cache modules) up front, so the
    # load time is not charged to the first replay.
    import sglang_session_cache_bench.harness  # noqa: F401

    if not sglang_session_cache.activate():
        print("error: the session-cache patches are not active (wrong sglang "
              "version?); nothing to benchmark", file=sys.stderr)
        return 2
    _log(f"[agentic] SGLang loaded ({time.perf_counter() - t_start:.1f}s)")
    with _protection_published(args):
        return _run_modes(args, runs, t_start)


def _run_modes(args, runs, t_start: float) -> int:
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, RESULTS_JSON)
    # One mode: the results dict itself; several: one per mode under "modes".
    several = len(runs) > 1
    doc: dict = {"modes": {}, "complete": False} if several else {}

    def save(results: dict, mode: Optional[str]) -> None:
        if several:
            doc["modes"][mode] = results
        else:
            doc.clear()
            doc.update(results)
        write_json(doc, json_path)

    all_results = []
    for mode, mode_trace, ttl in runs:
        if mode is not None:
            _log(f"[agentic] mode {mode}: {MODES[mode].about}")
        results = run_benchmark(args, mode_trace, ttl,
                                on_cell=lambda r, m=mode: save(r, m))
        results["mode"] = mode
        results["total_seconds"] = time.perf_counter() - t_start
        save(results, mode)
        all_results.append(results)
        print(format_tables(results, legend=len(all_results) == 1)
              + ("\n" if several else ""), flush=True)
        if results.get("interrupted"):
            break
    interrupted = any(r.get("interrupted") for r in all_results)
    if several:
        print(format_mode_summary(all_results), flush=True)
    if several:
        doc["complete"] = not interrupted and len(all_results) == len(runs)
        write_json(doc, json_path)
    print(f"\nresults: {json_path}")
    if not args.no_plot:
        for results in all_results:
            png = _plot_path(args.out, results["mode"] if several else None)
            write_plot(results, png)
            print(f"plot:    {png}")
    _log(f"[agentic] done in {time.perf_counter() - t_start:.1f}s")
    if interrupted:
        return 130
    return 1 if any(r["issues"] for r in all_results) else 0


if __name__ == "__main__":
    sys.exit(main())
