"""PD disaggregation (issue 12 item 8): SGLang's prefill-side failure
handlers release the KV (-> cache_finished_req) before marking the request
aborted.  Driven through the real ``handle_inflight_transfer_failure`` /
``handle_bootstrap_failure`` on a real ``Scheduler`` and cache: no session
reference is registered, the session is no longer busy, the KV stays cached."""

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, arrive, make_scheduler, prompt  # noqa: E402


class FailingSender:
    """Stand-in for the transfer backend's sender (needs a NIC/GPU): it only
    reports the failure, as the real senders do."""

    def failure_exception(self):
        raise RuntimeError("transfer failed (stand-in)")

    def clear(self):
        pass


def prefill_scheduler(h):
    sched = make_scheduler(h.cache)
    sched.ps = SimpleNamespace(pp_rank=0, tp_rank=0, attn_cp_rank=0)
    sched.metrics_reporter = SimpleNamespace(enable_metrics=False)
    sched.output_streamer = SimpleNamespace(stream_output=lambda reqs, lp: None)
    sched.req_to_metadata_buffer_idx_allocator = SimpleNamespace(free=lambda idx: None)
    return sched


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("path", ["transfer", "bootstrap"])
def test_failed_prefill_registers_no_reference(shape, path):
    h = SHAPES[shape]()
    tracker = h.cache.session_ref_tracker
    tracker.set_ttl(10.0)
    sched = prefill_scheduler(h)
    req = arrive(h, prompt(0), "s")
    h.prefill(req, finishing=True)
    req.disagg_kv_sender = FailingSender()
    req.metadata_buffer_index = -1
    if path == "transfer":
        sched.handle_inflight_transfer_failure(req)
    else:
        sched.handle_bootstrap_failure(req)
    h.live_reqs.pop(req.rid)  # released by SGLang's handler
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert tracker.counters.registered == 0
    assert not tracker.session_leaves("s")
    assert tracker.idle.inflight("s") == 0  # not busy: the TTL runs again
    assert h.match_len(prompt(0)) > 0  # the KV stays cached (stock behaviour)
    h.cache.validate_session_state()
    h.check()


def test_successful_prefill_still_registers():
    h = SHAPES["full"]()
    req = arrive(h, prompt(0), "s")
    h.prefill(req, finishing=True)
    h.finish(req)
    assert h.cache.session_ref_tracker.counters.registered == 1


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bootstrap_failure_before_any_kv_ends_the_busy_time(shape):
    # Failed before KV was allocated: SGLang's handler releases nothing (no
    # cache_finished_req), yet the request is over.
    h = SHAPES[shape]()
    tracker = h.cache.session_ref_tracker
    tracker.set_ttl(10.0)
    sched = prefill_scheduler(h)
    req = arrive(h, prompt(0), "s")
    assert tracker.idle.inflight("s") == 1
    req.disagg_kv_sender = FailingSender()
    req.metadata_buffer_index = -1
    sched.handle_bootstrap_failure(req)
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert tracker.idle.inflight("s") == 0
    assert h.cache.advance_session_clock(1000.0) == 1
    h.cache.validate_session_state()
    h.check()
