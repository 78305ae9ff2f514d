"""Server-side wiring on the real SGLang classes: ServerArgs' compatibility
check, the cache-selection guard, and Scheduler.open_session / close_session /
_add_request_to_queue forwarding to the unified cache."""

import logging
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import make_full_cache, publish_server_args  # noqa: E402
from session_test_utils import make_scheduler  # noqa: E402

import sglang.srt.managers.schedule_batch as schedule_batch  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    CloseSessionReqInput,
    OpenSessionReqInput,
)
from sglang.srt.mem_cache import registry  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


@pytest.fixture
def server_args():
    args = publish_server_args()
    saved = (args.enable_session_radix_cache, args.radix_eviction_policy)
    args.enable_session_radix_cache = True
    args.radix_eviction_policy = "lru"
    yield args
    args.enable_session_radix_cache, args.radix_eviction_policy = saved


def test_priority_policy_no_longer_required(server_args):
    original = ServerArgs._handle_cache_compatibility.__wrapped__
    with pytest.raises(ValueError, match="requires --radix-eviction-policy priority"):
        original(server_args)
    server_args._handle_cache_compatibility()  # lifted
    assert server_args.enable_session_radix_cache is True


def test_other_cache_compatibility_rules_still_apply(server_args):
    saved = (server_args.enable_hierarchical_cache, server_args.disable_radix_cache)
    server_args.enable_hierarchical_cache = True
    server_args.disable_radix_cache = True
    try:
        with pytest.raises(ValueError, match="mutually exclusive"):
            server_args._handle_cache_compatibility()
    finally:
        server_args.enable_hierarchical_cache, server_args.disable_radix_cache = saved


def test_guard_fails_when_built_cache_is_not_unified(server_args, caplog):
    from sglang_session_cache.patches.server_wiring import _wrap_create_tree_cache

    # The module-level factory SGLang's kv_cache_builder imports is the guarded one.
    assert getattr(registry.create_tree_cache, "__sglang_session_cache_patched__", False)
    ctx = SimpleNamespace(server_args=server_args)

    # A cache without session tracking (what RadixCache/ChunkCache would be).
    plain = make_full_cache(enable_session=False).cache
    with pytest.raises(ValueError, match="needs the unified radix tree") as e:
        _wrap_create_tree_cache(lambda _ctx: plain)(ctx)
    assert "SGLANG_ENABLE_UNIFIED_RADIX_TREE=1" in str(e.value)

    unified = make_full_cache(enable_session=True).cache
    assert _wrap_create_tree_cache(lambda _ctx: unified)(ctx) is unified
    server_args.enable_session_radix_cache = False  # flag off: stock, whatever the cache
    assert _wrap_create_tree_cache(lambda _ctx: plain)(ctx) is plain


def test_open_and_close_session_forward_to_the_cache(server_args):
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    sched = make_scheduler(h.cache, server_args)

    out = sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="agent-42"))
    assert out.success
    assert "agent-42" in tracker.open_sessions()
    sched.open_session(
        OpenSessionReqInput(capacity_of_str_len=64, session_id="stream-1", streaming=True)
    )
    assert "stream-1" in tracker.streaming

    h.run_request(list(range(30)), session_id="agent-42")
    assert tracker.session_leaves("agent-42")
    sched.close_session(CloseSessionReqInput(session_id="agent-42"))
    assert "agent-42" not in tracker.open_sessions()
    assert not tracker.session_leaves("agent-42")
    assert h.match_len(list(range(30))) > 0  # KV stays reusable
    # Idempotent close through the scheduler too.
    sched.close_session(CloseSessionReqInput(session_id="agent-42"))


def test_bad_close_is_logged_not_raised(server_args, caplog):
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    h.run_request(list(range(20)), session_id="keep")
    with caplog.at_level(logging.WARNING):
        sched.close_session(CloseSessionReqInput(session_id=""))
    assert "close_session rejected" in caplog.text
    assert "session_id must be a non-empty string" in caplog.text
    assert h.cache.session_ref_tracker.session_leaves("keep")


def test_arriving_request_gets_its_generation(server_args):
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    req = h.new_req(list(range(10)), session_id="agent-7")
    sched._add_request_to_queue(req)
    assert sched.waiting_queue == [req]
    gen = req.session_ref_generation
    assert h.cache.session_ref_tracker.generations["agent-7"] == gen
    # A retracted request keeps the generation it arrived with.
    sched.waiting_queue.clear()
    sched._add_request_to_queue(req, is_retracted=True)
    assert req.session_ref_generation == gen

    plain = h.new_req(list(range(10)))
    sched._add_request_to_queue(plain)
    assert getattr(plain, "session_ref_generation", None) is None


def test_request_with_empty_session_id_is_aborted(server_args, monkeypatch):
    monkeypatch.setattr(schedule_batch, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    req = h.new_req(list(range(10)), session_id="  ")
    sched._add_request_to_queue(req)
    assert type(req.to_finish).__name__ == "FINISH_ABORT"
    assert "session_id must be a non-empty string" in req.to_finish.message
    assert h.cache.session_ref_tracker.open_sessions() == []


def test_flag_off_scheduler_leaves_requests_alone(server_args):
    server_args.enable_session_radix_cache = False
    h = make_full_cache(enable_session=False)
    sched = make_scheduler(h.cache, server_args)
    req = h.new_req(list(range(10)), session_id="s")
    sched._add_request_to_queue(req)
    assert getattr(req, "session_ref_generation", None) is None


def test_the_flag_help_describes_this_cache():
    import argparse

    from sglang_session_cache.patches.server_wiring import SESSION_FLAG_HELP

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if a.dest == "enable_session_radix_cache"]
    assert action.help == SESSION_FLAG_HELP
    assert "priority" not in parser.format_help().split("--enable-session-radix-cache")[1][:400]
