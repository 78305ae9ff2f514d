"""Randomized differential test: the real session-aware UnifiedRadixCache
against an independent model (session_model.py) of which nodes each open
session protects, per component, checked after EVERY operation.

Operations: arrivals (new turns extending, re-rendering or branching a
session's conversation; identical prompts in different sessions; one-shot
requests), chunked prefill, decode, finish, abort, retract and re-admission,
concurrent requests of one session, explicit open / re-open, close, TTL
expiry (modelled as "session released"), and eviction under pressure.

SESSION_DIFF_SEED=<int> replays one seed; SESSION_DIFF_OPS=<n> sets the number
of operations per shape (default 10,000).  The seed is printed on failure.
"""

import os
import random
import sys
import time
import traceback

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import (  # noqa: E402
    make_full_cache,
    make_swa_cache,
    make_swa_mamba_cache,
)
from session_model import MAMBA, SessionModel  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import EvictLayer  # noqa: E402

SHAPES = {
    "full": lambda: make_full_cache(num_tokens=320, page_size=1, enable_session=True),
    "swa": lambda: make_swa_cache(
        num_tokens=320, swa_num_tokens=192, page_size=4, sliding_window_size=8,
        enable_session=True,
    ),
    "swa_mamba": lambda: make_swa_mamba_cache(
        num_tokens=320, swa_num_tokens=192, mamba_num_slots=24, page_size=1,
        sliding_window_size=8, enable_session=True,
    ),
}

SESSION_IDS = [f"s{i}" for i in range(6)]
SYSTEM = list(range(5000, 5012))
MAX_LIVE = 4
TTL = 40.0


class Driver:
    """Drives the real cache through the harness and tells the model what
    happened.  Tree events reach the model through instance-level wrappers of
    the cache's own node-deletion and component-eviction methods."""

    def __init__(self, shape: str, seed: int):
        self.rng = random.Random(seed)
        self.h = SHAPES[shape]()
        cache = self.h.cache
        self.tracker = cache.session_ref_tracker
        window = None
        if self.h.has_swa:
            window = self.h.sliding_window_size + self.h.page_size
        self.model = SessionModel(cache, cache.tree_components, window)
        # TTL on throughout; the shared clock only moves in op_expire.
        self.now = 0.0
        self.tracker.set_ttl(TTL)
        self._observe_tree_events()
        self.history = {}  # sid -> tokens of its last finished turn
        self.prompts = []  # recent prompts, reused by other sessions
        self.live = []  # admitted requests (prefilled, not finished)
        self.queued = []  # arrived or retracted, waiting for admission
        self.counts = {}
        self._fresh = iter(range(10_000, 10**9))

    def _observe_tree_events(self):
        # Every deleted node passes the tracker's deletion hook (whichever
        # path deletes it: a session cache evicts a device leaf through its
        # own ``_evict_device_leaf``, which calls SGLang's methods directly),
        # and every Mamba state freed passes the component's own eviction.
        model, tracker = self.model, self.tracker
        on_node_deleted = tracker.on_node_deleted

        def observed_on_node_deleted(node):
            model.node_deleted(node)
            return on_node_deleted(node)

        tracker.on_node_deleted = observed_on_node_deleted
        mamba = self.h.cache.components.get(MAMBA)
        if mamba is not None:
            evict = mamba.evict_component

            def observed_evict_component(node, target=EvictLayer.DEVICE):
                if target & EvictLayer.DEVICE:
                    model.mamba_evicted(node)
                return evict(node, target=target)

            mamba.evict_component = observed_evict_component

    # ---- operations ----

    def _tokens(self, n):
        return [next(self._fresh) for _ in range(n)]

    def _prompt(self, sid):
        rng = self.rng
        hist = self.history.get(sid)
        r = rng.random()
        if self.prompts and r < 0.15:
            return list(rng.choice(self.prompts))  # identical prompt elsewhere
        if hist and len(hist) < 48 and r < 0.6:
            return hist + self._tokens(rng.randint(2, 8))  # next turn
        if hist and r < 0.8:
            cut = rng.randint(len(SYSTEM), len(hist))  # re-rendered turn
            return hist[:cut] + self._tokens(rng.randint(2, 8))
        return SYSTEM + self._tokens(rng.randint(4, 16))  # new branch

    def op_arrive(self):
        if len(self.live) + len(self.queued) >= MAX_LIVE + 2:
            return self.op_admit()
        sid = self.rng.choice(SESSION_IDS) if self.rng.random() < 0.85 else None
        tokens = self._prompt(sid)
        self.prompts = (self.prompts + [tokens])[-8:]
        req = self.h.new_req(tokens, session_id=sid, max_new_tokens=64)
        # Scheduler._add_request_to_queue's hook.
        self.h.cache.ensure_session_generation(req)
        self.model.arrive(req, sid)
        self.queued.append(req)

    def op_admit(self):
        if not self.queued or len(self.live) >= MAX_LIVE:
            return self.op_finish()
        req = self.queued.pop(self.rng.randrange(len(self.queued)))
        if req.is_retracted:  # re-admission keeps its arrival stamp
            assert self.h.cache.ensure_session_generation(req) is not None or req.session_id is None
        page = self.h.page_size
        chunk = self.rng.choice([None, None, 4 * page, 8 * page])
        try:
            self.h.prefill(req, chunk_size=chunk)
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            self.queued.append(req)  # stays waiting, like in the scheduler
            return
        self.live.append(req)

    def op_decode(self):
        if not self.live:
            return self.op_arrive()
        req = self.rng.choice(self.live)
        try:
            self.h.decode(req, self.rng.randint(1, 3))
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            self.op_retract(req)

    def op_finish(self, abort=False):
        if not self.live:
            return self.op_arrive()
        req = self.live.pop(self.rng.randrange(len(self.live)))
        if abort:
            req.finished_reason = FINISH_ABORT("aborted by the test")
        else:
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        self.h.finish(req)
        self.model.finish(req, aborted=abort)
        sid = req.session_id
        if sid is not None and not abort:
            self.history[sid] = list(req.origin_input_ids) + list(req.output_ids)

    def op_abort(self):
        self.op_finish(abort=True)

    def op_retract(self, req=None):
        if req is None:
            if not self.live:
                return self.op_arrive()
            req = self.rng.choice(self.live)
        self.live.remove(req)
        # schedule_batch.release_req: free without insert, then reset.
        release_kv_cache(req, self.h.cache, is_insert=False)
        del self.h.live_reqs[req.rid]
        req.reset_for_retract()
        req.kv = None
        self.queued.append(req)

    def op_open(self):
        sid = self.rng.choice(SESSION_IDS)
        self.h.cache.open_radix_session(sid)
        self.model.explicit_open(sid)

    def op_close(self):
        sid = self.rng.choice(SESSION_IDS)
        self.h.cache.release_radix_session(sid)
        self.model.release(sid)

    def op_expire(self):
        """TTL expiry, modelled abstractly as "session released": the cache
        decides which sessions are due; the model releases exactly those."""
        before = set(self.tracker.open_sessions())
        self.h.cache.advance_session_clock(self.now)
        for sid in before - set(self.tracker.open_sessions()):
            self.model.release(sid)

    def op_evict(self):
        h, rng = self.h, self.rng
        h.evict(
            num_tokens=rng.randint(1, 48),
            swa_num_tokens=rng.randint(0, 32) if h.has_swa else 0,
            mamba_num=rng.randint(0, 3) if h.has_mamba else 0,
        )

    OPS = [
        ("arrive", 24), ("admit", 20), ("decode", 14), ("finish", 18), ("abort", 3),
        ("retract", 3), ("open", 2), ("close", 4), ("expire", 3), ("evict", 6),
    ]

    def step(self):
        self.now += 1.0
        names, weights = zip(*self.OPS)
        name = self.rng.choices(names, weights)[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        getattr(self, f"op_{name}")()
        return name

    def check(self):
        nodes = self.h.tree_nodes()
        self.h.cache.validate_session_state()
        self.model.check(nodes, self.tracker)


def _seeds(shape):
    env = os.environ.get("SESSION_DIFF_SEED")
    if env is not None:
        return [int(env)]
    return [20260 + sum(map(ord, shape))]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cache_matches_independent_model(shape):
    n_ops = int(os.environ.get("SESSION_DIFF_OPS", "10000"))
    for seed in _seeds(shape):
        d = Driver(shape, seed)
        t0, c0 = time.perf_counter(), time.process_time()
        i, name = 0, None
        try:
            for i in range(n_ops):
                name = d.step()
                d.check()
        except Exception:
            print(
                f"\nsession differential test FAILED: shape={shape} seed={seed} "
                f"op #{i} ({name}); replay with SESSION_DIFF_SEED={seed}\n"
                + traceback.format_exc()
            )
            raise
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0  # wall time on a shared box overstates the cost
        referenced = sum(len(v) for v in d.model.leaves[0].values())
        print(
            f"\n[{shape}] seed={seed}: {n_ops} ops in {elapsed:.1f}s wall, {cpu:.1f}s CPU, "
            f"ops {d.counts}, "
            f"sessions open {len(d.model.open)}, FULL leaves {referenced}, "
            f"registered {d.tracker.counters.registered}, "
            f"expired {d.tracker.counters.expired}, "
            f"stale {d.tracker.counters.stale_rejected}, "
            f"late {d.tracker.counters.late_finish_skipped}"
        )
        assert d.tracker.counters.registered > n_ops // 20
