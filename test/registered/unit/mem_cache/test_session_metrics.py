"""Session metrics on the real UnifiedRadixCache: the session_metrics()
snapshot (lifecycle counters, referenced tokens per component, soft-protection
breaches), the scheduler's log line and the Prometheus series."""

import os
import random
import sys
import types
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, checked_harness, prompt  # noqa: E402,F401
from cache_fixtures import make_full_cache, make_swa_cache  # noqa: E402

from sglang.srt.managers.scheduler_components.pool_stats_observer import (  # noqa: E402
    PoolStats,
    SchedulerPoolStatsObserver,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang_session_cache import session_metrics  # noqa: E402
from sglang_session_cache.session_metrics import (  # noqa: E402
    SessionCacheMetricsCollector,
    log_fragment,
)

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

def brute_force_referenced(h) -> dict:
    """Referenced device data per component from a walk over every node."""
    out = {}
    for ct in h.cache.session_ref_tracker.components:
        total = 0
        for n in h.tree_nodes():
            cd = n.component_data[ct]
            if cd.session_ref > 0 and cd.value is not None:
                total += len(cd.value)
        out[str(ct)] = total
    return out


# ---- snapshot -------------------------------------------------------------------------


def test_flag_off_reports_nothing():
    h = make_full_cache(enable_session=False)
    h.run_request(prompt(0), session_id="s")
    assert h.cache.session_metrics() == {"enabled": False}
    assert h.cache.session_metrics_collector is None
    assert log_fragment(h.cache.session_metrics()) is None


def test_snapshot_shape(h):
    snap = h.cache.session_metrics()
    names = [str(ct) for ct in h.cache.tree_components]
    assert snap["enabled"] is True
    assert snap["ttl_s"] is None
    assert snap["open_sessions"] == 0
    for key in ("opened", "closed", "expired", "registered", "stale_rejected",
                "late_finish_skipped"):
        assert snap[key] == 0
    for key in ("referenced_tokens", "referenced_evictions", "referenced_evicted_tokens"):
        assert list(snap[key]) == names
        assert set(snap[key].values()) == {0}


def test_lifecycle_counters(h):
    tracker = h.cache.session_ref_tracker
    h.run_request(prompt(0), session_id="a", n_decode=2)
    h.cache.open_radix_session("b")
    snap = h.cache.session_metrics()
    assert (snap["open_sessions"], snap["opened"], snap["registered"]) == (2, 2, 1)

    # stale: finishes after its generation was closed and reopened
    stale = h.new_req(prompt(0, 50), session_id="a")
    h.cache.ensure_session_generation(stale)
    h.prefill(stale)
    h.cache.release_radix_session("a")
    h.cache.open_radix_session("a")
    h.finish(stale)
    # late: finishes after its session was closed
    late = h.new_req(prompt(300), session_id="b")
    h.cache.ensure_session_generation(late)
    h.prefill(late)
    h.cache.release_radix_session("b")
    h.finish(late)

    snap = h.cache.session_metrics()
    assert snap["open_sessions"] == 1
    assert snap["opened"] == 3
    assert snap["closed"] == 2
    assert snap["stale_rejected"] == 1
    assert snap["late_finish_skipped"] == 1
    assert snap["registered"] == 1
    assert snap["expired"] == 0
    assert snap["open_sessions"] == len(tracker.open_sessions())


def test_referenced_tokens_per_component(h):
    a = h.run_request(prompt(0), session_id="a", n_decode=4)
    snap = h.cache.session_metrics()
    ref = snap["referenced_tokens"]
    assert ref == brute_force_referenced(h)
    cached = len(a.origin_input_ids) + len(a.output_ids) - 1  # last token has no KV
    assert ref["full"] == cached
    if h.has_swa:
        # the window tail plus page allowance, whole nodes, never more than FULL
        assert 0 < ref["swa"] <= ref["full"]
    if h.has_mamba:
        assert ref["mamba"] == 1  # one state, on the session leaf

    # A second session sharing the prefix: shared nodes count once.
    h.run_request(prompt(0, 48), session_id="b", n_decode=2)
    assert h.cache.session_metrics()["referenced_tokens"] == brute_force_referenced(h)

    # Close: nothing is referenced any more, but the KV stays cached.
    evictable = h.cache.full_evictable_size()
    h.cache.release_radix_session("a")
    h.cache.release_radix_session("b")
    snap = h.cache.session_metrics()
    assert set(snap["referenced_tokens"].values()) == {0}
    assert h.cache.full_evictable_size() == evictable


def test_referenced_tokens_match_brute_force_under_churn(h):
    rng = random.Random(7)
    tracker = h.cache.session_ref_tracker
    bases = [0, 2000, 4000]
    for step in range(40):
        sid = f"s{rng.randrange(5)}"
        base = rng.choice(bases)
        n = rng.randrange(8, 60)
        op = rng.random()
        if op < 0.6:
            h.run_request(prompt(base, n), session_id=sid, n_decode=rng.randrange(0, 4))
        elif op < 0.75:
            h.run_request(prompt(base + 7, n))
        elif op < 0.85:
            h.cache.release_radix_session(sid)
        else:
            h.evict(
                num_tokens=rng.randrange(1, 40),
                swa_num_tokens=rng.randrange(1, 40) if h.has_swa else 0,
                mamba_num=rng.randrange(0, 3) if h.has_mamba else 0,
            )
        snap = h.cache.session_metrics()
        assert snap["referenced_tokens"] == brute_force_referenced(h), step
        assert snap["open_sessions"] == len(tracker.open_sessions())
        h.cache.validate_session_state()
    h.check()


# ---- soft-protection breaches --------------------------------------------------------------


def test_unreferenced_eviction_is_not_a_breach(h):
    h.run_request(prompt(0), session_id="a", n_decode=2)
    h.run_request(prompt(500), n_decode=2)  # unreferenced, newer
    h.evict(num_tokens=8, swa_num_tokens=8 if h.has_swa else 0,
            mamba_num=1 if h.has_mamba else 0)
    snap = h.cache.session_metrics()
    assert set(snap["referenced_evictions"].values()) == {0}
    assert set(snap["referenced_evicted_tokens"].values()) == {0}


def test_evicting_referenced_data_counts_breaches(h):
    h.run_request(prompt(0), session_id="a", n_decode=3)
    before = h.cache.session_metrics()["referenced_tokens"]
    h.evict_all()
    snap = h.cache.session_metrics()
    for ct in h.cache.tree_components:
        name = str(ct)
        assert snap["referenced_evictions"][name] >= 1, name
        # Everything that was referenced went, and then some (Mamba/SWA
        # references follow their data up the tree before it goes too).
        assert snap["referenced_evicted_tokens"][name] >= before[name], name
    assert set(snap["referenced_tokens"].values()) == {0}
    h.cache.validate_session_state()


def test_breaches_are_per_component():
    # FULL+SWA: SWA pressure alone, with only referenced SWA data to take.
    h = make_swa_cache(enable_session=True, sliding_window_size=8)
    h.run_request(prompt(0, 64), session_id="a", n_decode=2)
    tracker = h.cache.session_ref_tracker
    assert h.cache.session_metrics()["referenced_tokens"]["swa"] > 0
    h.evict(swa_num_tokens=4)
    snap = h.cache.session_metrics()
    assert snap["referenced_evictions"]["swa"] >= 1
    assert snap["referenced_evictions"]["full"] == 0
    assert tracker.referenced_evictions[SWA] == snap["referenced_evictions"]["swa"]
    h.cache.validate_session_state()
    h.check()


def test_counters_survive_a_cache_reset():
    h = make_full_cache(enable_session=True)
    h.run_request(prompt(0), session_id="a")
    h.evict_all()
    h.cache.reset()
    snap = h.cache.session_metrics()
    assert snap["referenced_evictions"]["full"] == 1
    assert snap["opened"] == 1 and snap["open_sessions"] == 0


# ---- TTL in the metrics -----------------------------------------------------------------------


def test_metrics_reads_never_expire_and_expiries_are_counted():
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    tracker.set_ttl(5)
    h.run_request(prompt(0), session_id="a")
    assert h.cache.session_metrics()["referenced_tokens"]["full"] == 40
    # Reads neither read a clock nor mutate: only the shared clock expires.
    for _ in range(3):
        snap = h.cache.session_metrics()
        assert (snap["open_sessions"], snap["expired"]) == (1, 0)
        assert session_metrics.log_part(h.cache).startswith("session: open=1")
    assert tracker.open_sessions() == ["a"]
    h.cache.advance_session_clock(6.0)
    snap = h.cache.session_metrics()
    assert (snap["open_sessions"], snap["expired"], snap["closed"]) == (0, 1, 0)
    assert snap["referenced_tokens"]["full"] == 0
    assert snap["ttl_s"] == 5.0
    assert log_fragment(snap) == "session: open=0, expired=1, ref_tokens(full)=0, breaches=0"


# ---- the scheduler's log line ---------------------------------------------------------------------


def observer_for(h):
    return SchedulerPoolStatsObserver(
        tree_cache=h.cache,
        token_to_kv_pool_allocator=h.allocator,
        req_to_token_pool=h.req_to_token_pool,
        session_controller=None,
        hisparse_coordinator=None,
        is_hybrid_swa=h.has_swa,
        is_hybrid_ssm=h.has_mamba,
        enable_hisparse=False,
        full_tokens_per_layer=h.full_allocator.size,
        swa_tokens_per_layer=h.swa_allocator.size if h.has_swa else None,
        max_total_num_tokens=h.full_allocator.size,
        get_last_batch=lambda: None,
        get_running_batch=lambda: None,
    )


def test_log_line_gains_a_session_part(h):
    h.run_request(prompt(0), session_id="a", n_decode=2)
    stats = observer_for(h).get_pool_stats()
    snap = h.cache.session_metrics()
    expected = log_fragment(snap)
    names = "/".join(str(ct) for ct in h.cache.tree_components)
    assert expected.startswith(f"session: open=1, ref_tokens({names})=")
    assert expected.endswith("breaches=" + "/".join("0" for _ in names.split("/")))
    decode = stats.get_decode_usage_msg_parts()
    prefill = stats.get_prefill_usage_msg_parts()
    assert decode[-1] == expected and prefill[-1] == expected
    # SGLang's own parts are untouched and come first.
    assert decode[:-1] == PoolStats.get_decode_usage_msg_parts.__wrapped__(stats)
    assert prefill[:-1] == PoolStats.get_prefill_usage_msg_parts.__wrapped__(stats)


def test_log_line_unchanged_with_flag_off():
    h = make_full_cache(enable_session=False)
    h.run_request(prompt(0), session_id="a")
    stats = observer_for(h).get_pool_stats()
    assert stats._session_cache is None
    parts = stats.get_decode_usage_msg_parts()
    assert parts == PoolStats.get_decode_usage_msg_parts.__wrapped__(stats)
    assert not any("session" in p for p in parts)


def test_log_part_reuses_the_walk_briefly(monkeypatch):
    h = make_full_cache(enable_session=True)
    h.run_request(prompt(0), session_id="a")
    walks = []
    real = session_metrics.referenced_tokens
    monkeypatch.setattr(
        session_metrics, "referenced_tokens", lambda t: walks.append(1) or real(t)
    )
    for _ in range(5):
        assert "ref_tokens(full)=40" in session_metrics.log_part(h.cache)
    assert len(walks) == 1
    h.cache.session_metrics()  # the read API always walks
    assert len(walks) == 2


# ---- Prometheus ---------------------------------------------------------------------------------


class FakeMetric:
    registry: dict = {}

    def __init__(self, name, documentation, labelnames, **kwargs):
        self.name = name
        self.labelnames = list(labelnames)
        self.values: dict = {}
        self.kwargs = kwargs
        FakeMetric.registry[name] = self

    def labels(self, **labels):
        assert sorted(labels) == sorted(self.labelnames), (self.name, labels)
        key = tuple(sorted(labels.items()))
        metric = self

        class Child:
            def inc(self, v=1):
                assert v > 0
                metric.values[key] = metric.values.get(key, 0) + v

            def set(self, v):
                metric.values[key] = v

            def observe(self, v):
                metric.values.setdefault(key, []).append(v)

        return Child()

    def value(self, **labels):
        return self.values.get(tuple(sorted(labels.items())))


@pytest.fixture
def fake_prometheus(monkeypatch):
    """prometheus_client stand-in (not installed in the CPU test env); SGLang's
    own collectors import it the same way."""
    FakeMetric.registry = {}
    module = types.ModuleType("prometheus_client")
    module.Counter = module.Gauge = module.Histogram = module.Summary = FakeMetric
    monkeypatch.setitem(sys.modules, "prometheus_client", module)
    monkeypatch.setattr(SessionCacheMetricsCollector, "_shared", {})
    return FakeMetric.registry


def metrics_cache(h):
    """A cache built like kv_cache_builder does with --enable-metrics, over
    the harness pools."""
    h.cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=h.req_to_token_pool,
            token_to_kv_pool_allocator=h.allocator,
            page_size=h.page_size,
            eviction_policy="lru",
            enable_session_radix_cache=True,
            enable_metrics=True,
            tree_components=(FULL,),
        )
    )
    return h


def test_prometheus_series(fake_prometheus):
    h = metrics_cache(make_full_cache(enable_session=True, num_tokens=128))
    collector = h.cache.session_metrics_collector
    assert collector is not None
    # Same labels as the cache's own radix-cache metrics.
    assert collector.labels == h.cache.metrics_collector.labels == {
        "cache_type": "UnifiedRadixCache"
    }
    reg = fake_prometheus
    assert reg["sglang:session_radix_open_sessions"].kwargs == {
        "multiprocess_mode": "mostrecent"
    }
    assert reg["sglang:session_radix_referenced_tokens"].labelnames == [
        "cache_type", "component"
    ]

    h.run_request(prompt(0), session_id="a")
    h.run_request(prompt(500), session_id="b")
    stats = observer_for(h).get_pool_stats()
    stats.update_scheduler_stats(SimpleNamespace())  # the scheduler's publish point
    lab = {"cache_type": "UnifiedRadixCache"}
    assert reg["sglang:session_radix_open_sessions"].value(**lab) == 2
    assert reg["sglang:session_radix_referenced_tokens"].value(**lab, component="full") == 80
    assert reg["sglang:session_radix_sessions_opened_total"].value(**lab) == 2
    assert reg["sglang:session_radix_refs_registered_total"].value(**lab) == 2

    h.cache.release_radix_session("a")
    h.evict_all()  # takes "b"'s referenced KV: a breach
    # Within the 1 s reuse window of the referenced-token walk: a close and a
    # breach change what it depends on, so it is walked again.
    stats.update_scheduler_stats(SimpleNamespace())
    assert reg["sglang:session_radix_open_sessions"].value(**lab) == 1
    assert reg["sglang:session_radix_referenced_tokens"].value(**lab, component="full") == 0
    assert reg["sglang:session_radix_sessions_opened_total"].value(**lab) == 2  # no re-add
    assert reg["sglang:session_radix_sessions_closed_total"].value(**lab) == 1
    assert reg["sglang:session_radix_referenced_evictions_total"].value(
        **lab, component="full") == 1
    assert reg["sglang:session_radix_referenced_evicted_tokens_total"].value(
        **lab, component="full") == 40

    # Publishing again without changes adds nothing.
    stats.update_scheduler_stats(SimpleNamespace())
    assert reg["sglang:session_radix_sessions_closed_total"].value(**lab) == 1

    # An open session released to stay within the open-session bound.
    h.cache.session_ref_tracker.max_open_sessions = 1
    h.run_request(prompt(900), session_id="c")  # "b" makes room
    stats.update_scheduler_stats(SimpleNamespace())
    assert reg["sglang:session_radix_sessions_evicted_open_total"].value(**lab) == 1
    assert reg["sglang:session_radix_open_sessions"].value(**lab) == 1


def test_collectors_share_series_per_process(fake_prometheus):
    h1 = metrics_cache(make_full_cache(enable_session=True))
    h2 = metrics_cache(make_full_cache(enable_session=True))
    c1, c2 = h1.cache.session_metrics_collector, h2.cache.session_metrics_collector
    assert c1 is not c2 and c1.metrics is c2.metrics  # no duplicate registration


def test_no_collector_without_metrics(fake_prometheus):
    h = make_full_cache(enable_session=True)
    assert h.cache.session_metrics_collector is None
    h.run_request(prompt(0), session_id="a")
    observer_for(h).get_pool_stats().update_scheduler_stats(SimpleNamespace())
    assert fake_prometheus == {}


def test_the_log_line_never_mixes_old_referenced_tokens_with_new_sessions():
    # The referenced-token walk is reused for up to a second, but only while
    # nothing it depends on changed (closes, a flush).
    from sglang_session_cache.session_metrics import log_part

    h = SHAPES["full"](num_tokens=256)
    for i in range(3):
        h.run_request(prompt(1000 * (i + 1), 40), session_id=f"s{i}")
    assert "open=3, ref_tokens(full)=120" in log_part(h.cache)
    h.cache.release_radix_session("s0")
    assert "open=2, ref_tokens(full)=80" in log_part(h.cache)
    for i in (1, 2):
        h.cache.release_radix_session(f"s{i}")
    h.cache.reset()  # flush_cache
    assert "open=0, ref_tokens(full)=0" in log_part(h.cache)
