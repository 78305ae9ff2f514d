"""Helpers shared by the session tests: session-enabled cache shapes, a
scheduler-style arrival, and a real Scheduler object holding just the state
its session methods read."""

from types import SimpleNamespace

import pytest

from cache_fixtures import make_full_cache, make_swa_cache, make_swa_mamba_cache

from sglang.srt.managers.schedule_batch import FINISH_LENGTH

SHAPES = {
    "full": lambda **kw: make_full_cache(enable_session=True, **kw),
    "swa": lambda **kw: make_swa_cache(enable_session=True, **kw),
    "swa_mamba": lambda **kw: make_swa_mamba_cache(enable_session=True, **kw),
}


def separate_leaf_indexes(h):
    """One leaf index per component (the tracker shares FULL's with SWA by
    default), so a test can reference a node in one component alone.  Called
    on an empty tree."""
    tracker = h.cache.session_ref_tracker
    tracker.share_leaf_index = False
    tracker.reset()
    return h


@pytest.fixture(name="h", params=list(SHAPES))
def checked_harness(request):
    """``h``: a session-enabled harness of each shape, whose session state
    and slot accounting are validated after the test (import it into a test
    module to use it)."""
    harness = SHAPES[request.param]()
    yield harness
    harness.cache.validate_session_state()
    harness.check()


def finish(h, req, n_decode=2):
    """Run an arrived request to its end (``n_decode=0``: it finishes at
    prefill, so its session leaf is the prompt's own node)."""
    h.prefill(req, finishing=n_decode == 0)
    if n_decode:
        h.decode(req, n_decode)
    done(h, req)
    return req


def done(h, req):
    # The scheduler sets the reason before release_kv_cache; the session
    # controller reads it (Req.finished()) when the next turn continues.
    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    h.finish(req)


def prompt(base, n=40):
    return list(range(base, base + n))


def arrive(h, tokens, sid):
    """What the scheduler does when a request arrives: stamp the generation."""
    req = h.new_req(tokens, session_id=sid)
    h.cache.ensure_session_generation(req)
    return req


def make_scheduler(cache, server_args=None):
    """A real ``Scheduler`` with just the state the session methods read.
    Without ``server_args`` it uses the published (harness) ones with the
    session flag on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.session.session_controller import SessionController

    if server_args is None:
        server_args = get_server_args()
        server_args.enable_session_radix_cache = True
    sched = Scheduler.__new__(Scheduler)
    sched.server_args = server_args
    sched.tree_cache = cache
    sched.session_controller = SessionController(cache)
    sched.ps = SimpleNamespace(pp_rank=0, tp_rank=0, attn_cp_rank=0)
    sched.enable_priority_scheduling = False
    sched.disaggregation_mode = DisaggregationMode.NULL
    sched.max_queued_requests = None
    sched.waiting_queue = []
    sched.enable_hicache_storage = False
    return sched


def turn(h, tokens, sid=None):
    """One finished request: arrival (with a session) or a plain request,
    prefill and finish."""
    req = arrive(h, tokens, sid) if sid else h.new_req(tokens)
    h.prefill(req, finishing=True)
    h.finish(req)
    return req
