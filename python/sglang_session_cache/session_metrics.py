"""Session metrics for the session-aware ``UnifiedRadixCache``.

What is counted (all per cache):

* ``open_sessions``       sessions currently open (TTL-expired ones excluded);
* ``referenced_tokens``   per component, device data held under a session
                          reference: tokens for FULL and SWA, states for Mamba;
* ``referenced_evictions`` / ``referenced_evicted_tokens``
                          per component, soft-protection breaches: evictions
                          that removed referenced device data, and what they
                          freed (counted in the ``_evict_component_and_detach_lru``
                          hook and, for deleted leaves, in the session cache's
                          ``_evict_device_leaf``);
* ``protection_withdrawals`` / ``protection_withdrawn_refs`` / ``unearned_finishes``
                          the protection policy (``protection_policy.py``):
                          sessions withdrawn past the bound, leaf references
                          they dropped, finishes not referenced yet;
* ``first_turn_withdrawals`` / ``session_return_rate`` / ``protect_first_turn``
                          ``--session-radix-cache-protect-from-turn auto``:
                          sessions that lost first-request protection when the
                          learned return rate fell, that rate, and whether
                          first requests are protected now (1/0);
* ``effective_protected_fraction`` / ``protection_scale_grew`` /
  ``protection_scale_shrank``
                          the share of each pool references may hold now
                          (``--session-radix-cache-max-protected-fraction
                          auto``: 0.9 times the learned scale), and the signals
                          that grew or shrank that scale
                          (``protection_scale.py``);
* the lifecycle counters of ``SessionCounters``: ``opened``, ``closed``,
  ``expired`` (TTL), ``registered``, ``stale_rejected``, ``late_finish_skipped``.

Where they show up:

* ``cache.session_metrics()`` - a snapshot dict (read API, used by tests);
* the scheduler's periodic log lines (prefill and decode batch) gain a
  ``session: open=..., ref_tokens(full/swa/mamba)=..., breaches=...`` part;
* with ``--enable-metrics``, Prometheus gauges and counters
  (``sglang:session_radix_*``) with the radix cache's labels
  (``cache_type`` + ``--extra-metric-labels``), plus ``component`` where the
  value is per component.  They are published when the scheduler publishes its
  own stats (every decode log interval, and every 30 s while idle).

``referenced_tokens`` is computed on read by walking only the referenced nodes
(the union of the session leaves' covers; the FULL walk stops at the first
node already seen), so the eviction hot path pays nothing for it.  The log and
Prometheus paths reuse that walk for up to ``REFERENCED_TOKENS_MAX_AGE_S``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from sglang_session_cache.session_tracker import MAX_OPEN_SESSION_CHARS, MAX_OPEN_SESSIONS

#: Log / Prometheus reads reuse a referenced-token walk this long (seconds).
REFERENCED_TOKENS_MAX_AGE_S = 1.0

COUNTER_KEYS = (
    "opened",
    "closed",
    "expired",
    "registered",
    "stale_rejected",
    "late_finish_skipped",
    "evicted_open",
)


# ---- snapshot -------------------------------------------------------------------


def referenced_tokens(tracker) -> dict:
    """``{component name: device tokens (Mamba: states) under a reference}``."""
    return {str(ct): refs.referenced_tokens() for ct, refs in tracker.components.items()}


def _referenced_state(tracker) -> tuple:
    """What the referenced device data changes with: the components (a reset
    replaces them), what references cover (closes, expiries, withdrawals,
    registrations) and referenced data evicted (breaches).  KV loaded back
    into a referenced node changes none of these: it shows after max_age."""
    return (
        id(tracker.components),
        tuple(refs.ref_units for refs in tracker.components.values()),
        tuple(counts[1] for counts in tracker.breaches.values()),
    )


def _cached_referenced_tokens(cache, tracker, max_age: float) -> dict:
    if max_age <= 0:
        return referenced_tokens(tracker)
    now = time.monotonic()
    state = _referenced_state(tracker)
    cached = cache._session_ref_tokens_cache
    # Reused only while nothing it depends on changed, so the figure never
    # contradicts the rest of the same snapshot (open sessions after a close).
    if cached is not None and now - cached[0] < max_age and cached[1] == state:
        return cached[2]
    value = referenced_tokens(tracker)
    cache._session_ref_tokens_cache = (now, state, value)
    return value


def snapshot(cache, max_age: float = 0.0) -> dict:
    """The session metrics of ``cache`` (see the module docstring).  A read
    never changes session state (expiry happens only on the shared clock, the
    same on every rank).  ``max_age`` lets the referenced-token walk be reused
    for that many seconds."""
    tracker = getattr(cache, "session_ref_tracker", None)
    if tracker is None:
        return {"enabled": False}
    counters = tracker.counters
    out: dict[str, Any] = {
        "enabled": True,
        "ttl_s": tracker.ttl,
        "open_sessions": len(tracker.generations),
    }
    for key in COUNTER_KEYS:
        out[key] = getattr(counters, key)
    policy = tracker.policy
    out["protection_withdrawals"] = policy.withdrawals
    out["protection_withdrawn_refs"] = policy.withdrawn_refs
    out["unearned_finishes"] = policy.unearned_finishes
    out["max_protected_fraction"] = policy.max_protected_fraction
    out["protect_from_turn"] = policy.protect_from_turn
    out["first_turn_withdrawals"] = policy.first_turn_withdrawals
    out["effective_protected_fraction"] = policy.effective_fraction
    out["protection_scale_grew"] = policy.scale.grew
    out["protection_scale_shrank"] = policy.scale.shrank
    out["session_return_rate"] = policy.return_rate.rate
    out["protect_first_turn"] = int(policy.protects_first_turn)
    out["referenced_tokens"] = _cached_referenced_tokens(cache, tracker, max_age)
    out["referenced_evictions"] = {
        str(ct): n for ct, n in tracker.referenced_evictions.items()
    }
    out["referenced_evicted_tokens"] = {
        str(ct): n for ct, n in tracker.referenced_evicted_tokens.items()
    }
    return out


def log_fragment(snap: dict) -> Optional[str]:
    """Compact part for the scheduler's batch log line, e.g.
    ``session: open=3, expired=1, ref_tokens(full/swa)=1200/64, breaches=0/2``."""
    if not snap.get("enabled"):
        return None
    names = "/".join(snap["referenced_tokens"])
    ref = "/".join(str(v) for v in snap["referenced_tokens"].values())
    breaches = "/".join(
        str(snap["referenced_evictions"].get(name, 0))
        for name in snap["referenced_tokens"]
    )
    parts = [f"session: open={snap['open_sessions']}"]
    if snap["ttl_s"] is not None or snap["expired"]:
        parts.append(f"expired={snap['expired']}")
    parts.append(f"ref_tokens({names})={ref}")
    parts.append(f"breaches={breaches}")
    if snap.get("protection_withdrawals"):
        parts.append(f"withdrawn={snap['protection_withdrawals']}")
    return ", ".join(parts)


def log_part(cache) -> Optional[str]:
    """The log-line part for ``cache`` (referenced-token walk reused for up to
    ``REFERENCED_TOKENS_MAX_AGE_S``, since prefill batches log every batch)."""
    return log_fragment(snapshot(cache, max_age=REFERENCED_TOKENS_MAX_AGE_S))


# ---- Prometheus -------------------------------------------------------------------

_GAUGES = (
    ("open_sessions", "sglang:session_radix_open_sessions",
     "Sessions currently open on the session radix cache.", False),
    ("referenced_tokens", "sglang:session_radix_referenced_tokens",
     "Device tokens (Mamba: states) held under a session reference, per component.",
     True),
    ("session_return_rate", "sglang:session_radix_return_rate",
     "Learned share of recent sessions that sent a second request "
     "(--session-radix-cache-protect-from-turn auto).", False),
    ("protect_first_turn", "sglang:session_radix_protect_first_turn",
     "1 while a session's first request is protected, else 0.", False),
    ("effective_protected_fraction", "sglang:session_radix_effective_protected_fraction",
     "Share of each pool session references may protect now "
     "(max-protected-fraction auto: 0.9 times the learned scale).", False),
)
_COUNTERS = (
    ("opened", "sglang:session_radix_sessions_opened_total",
     "Sessions opened (explicitly or by their first request).", False),
    ("closed", "sglang:session_radix_sessions_closed_total",
     "Sessions closed through /close_session.", False),
    ("expired", "sglang:session_radix_sessions_expired_total",
     "Sessions released by --session-radix-cache-ttl.", False),
    ("registered", "sglang:session_radix_refs_registered_total",
     "Session references registered by finished requests.", False),
    ("stale_rejected", "sglang:session_radix_stale_rejected_total",
     "Finished requests of an older session generation (not referenced).", False),
    ("late_finish_skipped", "sglang:session_radix_late_finish_skipped_total",
     "Requests finished after their session was closed or expired.", False),
    ("evicted_open", "sglang:session_radix_sessions_evicted_open_total",
     "Open sessions released to stay within the open-session bound "
     f"({MAX_OPEN_SESSIONS:,} sessions / {MAX_OPEN_SESSION_CHARS:,} id characters).", False),
    ("protection_withdrawals", "sglang:session_radix_protection_withdrawals_total",
     "Sessions whose protection was withdrawn by "
     "--session-radix-cache-max-protected-fraction.", False),
    ("unearned_finishes", "sglang:session_radix_unearned_finishes_total",
     "Finished session requests not referenced because the session had not "
     "reached --session-radix-cache-protect-from-turn yet.", False),
    ("first_turn_withdrawals", "sglang:session_radix_first_turn_withdrawals_total",
     "Sessions protected on their first request alone whose protection was "
     "withdrawn when the learned return rate fell (protect-from-turn auto).", False),
    ("protection_scale_shrank", "sglang:session_radix_protection_scale_shrank_total",
     "Requests that missed unreferenced KV evicted while protection held other "
     "KV (each shrinks the learned protection scale).", False),
    ("protection_scale_grew", "sglang:session_radix_protection_scale_grew_total",
     "Returning sessions that missed their own unprotected KV (each grows the "
     "learned protection scale).", False),
    ("referenced_evictions", "sglang:session_radix_referenced_evictions_total",
     "Evictions that removed referenced device data (soft-protection breaches), "
     "per component.", True),
    ("referenced_evicted_tokens", "sglang:session_radix_referenced_evicted_tokens_total",
     "Device tokens (Mamba: states) freed by evictions of referenced data, "
     "per component.", True),
)


def _collector_base():
    from sglang.srt.observability.metrics_collector import _StatLoggerDIMixin

    return _StatLoggerDIMixin


class SessionCacheMetricsCollector(_collector_base()):
    """Prometheus gauges/counters for one cache.  The metric objects are
    created once per process and label set (Prometheus names are global);
    each collector keeps the last values it published, so the cumulative
    tracker counters become counter increments."""

    _shared: dict = {}

    def __init__(self, labels: dict):
        self.labels = dict(labels)
        key = (type(self), tuple(self.labels))
        metrics = SessionCacheMetricsCollector._shared.get(key)
        if metrics is None:
            metrics = self._make_metrics(tuple(self.labels))
            SessionCacheMetricsCollector._shared[key] = metrics
        self.metrics = metrics
        self._published: dict = {}

    def _make_metrics(self, labelnames: tuple) -> dict:
        # Imported here: prometheus_client must be imported after SGLang sets
        # PROMETHEUS_MULTIPROC_DIR, like SGLang's own collectors.
        if self._gauge_cls is None or self._counter_cls is None:
            from prometheus_client import Counter as _PromCounter
            from prometheus_client import Gauge as _PromGauge
        Gauge = self._gauge_cls or _PromGauge
        Counter = self._counter_cls or _PromCounter
        metrics = {}
        for key, name, doc, per_component in _GAUGES:
            names = list(labelnames) + (["component"] if per_component else [])
            metrics[key] = Gauge(
                name=name, documentation=doc, labelnames=names,
                multiprocess_mode="mostrecent",
            )
        for key, name, doc, per_component in _COUNTERS:
            names = list(labelnames) + (["component"] if per_component else [])
            metrics[key] = Counter(name=name, documentation=doc, labelnames=names)
        return metrics

    def _inc(self, key: str, value: int, **extra) -> None:
        pub_key = (key, tuple(extra.items()))
        delta = value - self._published.get(pub_key, 0)
        if delta > 0:
            self.metrics[key].labels(**self.labels, **extra).inc(delta)
        self._published[pub_key] = value

    def publish(self, snap: dict) -> None:
        if not snap.get("enabled"):
            return
        m = self.metrics
        m["open_sessions"].labels(**self.labels).set(snap["open_sessions"])
        m["session_return_rate"].labels(**self.labels).set(snap["session_return_rate"])
        m["protect_first_turn"].labels(**self.labels).set(snap["protect_first_turn"])
        m["effective_protected_fraction"].labels(**self.labels).set(
            snap["effective_protected_fraction"])
        for comp, n in snap["referenced_tokens"].items():
            m["referenced_tokens"].labels(**self.labels, component=comp).set(n)
        for key, _, _, per_component in _COUNTERS:
            if per_component:
                for comp, n in snap[key].items():
                    self._inc(key, n, component=comp)
            else:
                self._inc(key, snap[key])


def make_collector(cache) -> SessionCacheMetricsCollector:
    """A collector labelled like the cache's own radix-cache metrics."""
    labels = getattr(getattr(cache, "metrics_collector", None), "labels", None)
    if not labels:
        labels = {"cache_type": type(cache).__name__}
    return SessionCacheMetricsCollector(labels)


def publish(cache) -> None:
    """Push the cache's session metrics to its Prometheus collector, if any."""
    collector = getattr(cache, "session_metrics_collector", None)
    if collector is not None:
        collector.publish(snapshot(cache, max_age=REFERENCED_TOKENS_MAX_AGE_S))


__all__ = [
    "COUNTER_KEYS",
    "REFERENCED_TOKENS_MAX_AGE_S",
    "SessionCacheMetricsCollector",
    "log_fragment",
    "log_part",
    "make_collector",
    "publish",
    "referenced_tokens",
    "snapshot",
]
