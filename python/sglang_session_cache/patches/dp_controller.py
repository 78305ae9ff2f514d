"""Session affinity in SGLang's ``DataParallelController``.

The controller runs in its own spawned process; the ``.pth`` hook patches its
module there like everywhere else.  ``init_dispatcher`` is wrapped: when the
session cache is on, ``dp_size > 1`` and affinity is not disabled, a
``SessionDPRouter`` is composed onto the controller; it replaces the
instance's ``dispatching`` (the configured method) with a front that sends
session requests to their bound rank and hands everything else to the
configured method, and it sees ``OpenSessionReqInput`` (a session's own
timeout) and ``CloseSessionReqInput`` before the controller broadcasts them to
the ranks.  Otherwise nothing changes.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Tuple

from sglang_session_cache.dp_affinity import SessionAffinity
from sglang_session_cache.patches._wrap import wrap_method

# The controller's own logger, so SGLang's logging config applies unchanged.
logger = logging.getLogger("sglang.srt.managers.data_parallel_controller")

#: At most one aggregated "session DP affinity" info line per this many seconds.
LOG_INTERVAL_S = 60.0
# The overload guard acts only on a rank at least this busy: this share of its
# KV token capacity (total_tokens, round_robin) or of --max-running-requests
# (total_requests; DEFAULT_BUSY_REQUESTS when unset).
BUSY_SHARE = 0.5
DEFAULT_BUSY_REQUESTS = 16
# Methods the front may sit on; follow_bootstrap_room (PD prefill) routes by
# bootstrap room, which the decode side relies on, so it is left alone.
_AFFINITY_METHODS = ("round_robin", "total_requests", "total_tokens")


def session_key(req) -> Optional[str]:
    """The session a generate request belongs to (``session_of(req)[0]``)."""
    return session_of(req)[0]


def session_of(req) -> Tuple[Optional[str], bool]:
    """``(session, classic)``: the top-level ``session_id`` of the session
    cache, else a classic session's ``session_params.id`` (``classic``: its
    turns build on state only the rank that served it holds, so its binding
    is kept, dp_affinity.py); ``(None, False)`` without a string id."""
    sid = getattr(req, "session_id", None)
    classic = False
    if sid is None:
        params = getattr(req, "session_params", None)
        sid = getattr(params, "id", None) if params is not None else None
        classic = sid is not None
    return (sid, classic) if isinstance(sid, str) else (None, False)


def affinity_wanted(server_args, method: str) -> bool:
    """``method``: the controller's resolved load balance method (lower case)."""
    return bool(
        getattr(server_args, "enable_session_radix_cache", False)
        and getattr(server_args, "dp_size", 1) > 1
        and not getattr(server_args, "disable_session_dp_affinity", False)
        and method in _AFFINITY_METHODS
    )


class SessionDPRouter:
    """Routes session requests of one controller; see the module doc."""

    def __init__(self, controller, fallback: Callable, clock: Callable[[], float] = time.monotonic):
        from sglang_session_cache.session_ttl import configured_ttl

        args = controller.server_args
        self.controller = controller
        self.fallback = fallback  # the configured method's dispatch
        self.clock = clock
        self.method = controller.load_balance_method.name.lower()
        self.by_tokens = self.method != "total_requests"
        self.affinity = SessionAffinity(
            overload_factor=args.session_dp_affinity_overload_factor,
            max_bindings=args.session_dp_affinity_max_sessions,
            ttl=configured_ttl(args),
            min_load=self._busy_floor(controller),
        )
        self.metrics = _make_metrics() if getattr(args, "enable_metrics", False) else None
        self._reported = self.affinity.counters.as_dict()  # last published
        self._logged = self.affinity.counters.as_dict()  # at the last log line
        self._last_log: Optional[float] = None
        self._failed = False

    def _busy_floor(self, controller) -> float:
        if self.by_tokens:
            return BUSY_SHARE * getattr(controller, "max_total_num_tokens", 0)
        cap = controller.server_args.max_running_requests or DEFAULT_BUSY_REQUESTS
        return BUSY_SHARE * cap

    # ---- dispatch -------------------------------------------------------------

    def dispatch(self, req) -> None:
        sid, classic = session_of(req)
        if sid is None:
            return self.fallback(req)
        if getattr(req, "routed_dp_rank", None) is not None:
            # An explicit routed_dp_rank wins (stock checks and sends it); the
            # binding follows, as the turn's KV lands there.
            self.fallback(req)
            try:
                now = self.clock()
                self.affinity.follow(sid, req.routed_dp_rank, now, keep=classic)
                self._report(now)
            except Exception:
                self._log_failure("routing")
            return
        try:
            rank = self._route(sid, req, classic)
        except Exception:
            # Never take the controller down: route like stock SGLang instead.
            self._log_failure("routing")
            return self.fallback(req)
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.controller.workers[rank], req)
        try:
            self._report(self.clock())
        except Exception:  # metrics/logging must not affect routing
            self._log_failure("metrics")

    def _route(self, sid: str, req, classic: bool = False) -> int:
        ctrl = self.controller
        if not ctrl.refresh_load_budget_on_dispatch:
            ctrl.refresh_load_budget()  # round_robin keeps no load view of its own
        budget = ctrl.dp_budget
        loads = budget.total_tokens if self.by_tokens else budget.total_requests
        # Ranks the load budget covers (elastic slots past --dp-size have no
        # entry there; stock's load-based methods never pick them either).
        active = [
            r for r in ctrl._active_workers
            if r < len(loads) and ctrl.status[r] and ctrl.workers[r] is not None
        ]
        tokens = len(req.input_ids) if req.input_ids is not None else 0
        now = self.clock()
        rank = self.affinity.route(
            sid, active, loads, now, cost=tokens if self.by_tokens else 1, keep=classic)
        # Same speculative increment as DPBudget.dispatch, until the next snapshot.
        budget.total_requests[rank] += 1
        budget.total_tokens[rank] += tokens
        return rank

    # ---- session open and end ----------------------------------------------------

    def on_open(self, msg) -> None:
        """``/open_session``: a top-level ``session_id`` session opened with
        a ``timeout`` expires by it on the ranks, so its binding does too."""
        try:
            sid, timeout = msg.session_id, msg.timeout
            if isinstance(sid, str) and timeout is not None and not msg.streaming:
                from sglang_session_cache.session_ttl import normalize_open_timeout

                self.affinity.open(sid, normalize_open_timeout(timeout))
        except Exception:
            # A bad timeout is the ranks' to reject; the binding keeps the TTL.
            logger.debug("open_session timeout not applied to the DP binding", exc_info=True)
        self.controller.send_control_message(msg)  # what the controller did before

    def on_close(self, msg) -> None:
        try:
            sid = msg.session_id
            if isinstance(sid, str):
                self.affinity.close(sid)
        except Exception:
            self._log_failure("close")
        self.controller.send_control_message(msg)  # what the controller did before

    # ---- metrics and log ----------------------------------------------------------

    def _report(self, now: float) -> None:
        counters = self.affinity.counters.as_dict()
        if self.metrics is not None:
            _publish(self.metrics, counters, self._reported, len(self.affinity))
            self._reported = counters
        if self._last_log is not None and now - self._last_log < LOG_INTERVAL_S:
            return
        delta = {k: counters[k] - self._logged[k] for k in counters}
        moved = delta["rebound_overload"] + delta["rebound_inactive"] + delta["rebound_explicit"]
        ended = delta["expired"] + delta["evicted"]
        if self._last_log is None or moved or ended:
            logger.info(
                "Session DP affinity: %d sessions bound; since last report: %d new, "
                "%d resumed on the rank of their expired binding, "
                "%d rebound (overloaded rank), %d rebound (inactive rank), "
                "%d rebound (explicit routed_dp_rank), "
                "%d closed, %d expired (TTL), %d dropped (cap).",
                len(self.affinity), delta["bound"], delta["resumed"], delta["rebound_overload"],
                delta["rebound_inactive"], delta["rebound_explicit"], delta["closed"],
                delta["expired"], delta["evicted"],
            )
            self._logged = counters
            self._last_log = now

    def _log_failure(self, what: str) -> None:
        if not self._failed:  # once: a broken path must not flood the log
            self._failed = True
            logger.exception("Session DP affinity %s failed; using the configured "
                             "load balance method", what)


# ---- Prometheus (controller process) ---------------------------------------------

_COUNTER_SERIES = (
    ("rebound_overload", "overload"),
    ("rebound_inactive", "inactive"),
    ("rebound_explicit", "explicit"),
)


def _make_metrics() -> Optional[dict]:
    try:
        # Imported here: after SGLang has set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Gauge
    except Exception:
        return None
    return {
        "rebinds": Counter(
            "sglang:session_dp_affinity_rebinds_total",
            "Sessions moved to another DP rank, by reason.",
            labelnames=["reason"],
        ),
        "ended": Counter(
            "sglang:session_dp_affinity_bindings_ended_total",
            "Session -> DP rank bindings ended, by reason.",
            labelnames=["reason"],
        ),
        "bound": Gauge(
            "sglang:session_dp_affinity_bindings",
            "Sessions currently bound to a DP rank.",
            multiprocess_mode="mostrecent",
        ),
    }


def _publish(metrics: dict, now: dict, before: dict, bound: int) -> None:
    for key, reason in _COUNTER_SERIES:
        if now[key] > before[key]:
            metrics["rebinds"].labels(reason=reason).inc(now[key] - before[key])
    for key in ("closed", "expired", "evicted"):
        if now[key] > before[key]:
            metrics["ended"].labels(reason=key).inc(now[key] - before[key])
    metrics["bound"].set(bound)


# ---- patch --------------------------------------------------------------------------


def _wrap_init_dispatcher(orig):
    def init_dispatcher(self):
        orig(self)
        if not affinity_wanted(self.server_args, self.load_balance_method.name.lower()):
            return
        from sglang.srt.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput
        from sglang.utils import TypeBasedDispatcher

        router = SessionDPRouter(self, fallback=self.dispatching)
        self.session_router = router
        self.dispatching = router.dispatch
        # Opens and closes are broadcast by the fallback; see them first.
        self._request_dispatcher += TypeBasedDispatcher(
            [(OpenSessionReqInput, router.on_open), (CloseSessionReqInput, router.on_close)])
        logger.info(
            "Session DP affinity on: session requests go to their bound DP rank "
            "(overload factor %s, at most %d bindings, TTL %s); others use %s.",
            router.affinity.overload_factor, router.affinity.max_bindings,
            router.affinity.ttl, router.method,
        )

    return init_dispatcher


def apply_dp_controller(module) -> None:
    cls = module.DataParallelController
    if "session_router" not in cls.__dict__:
        cls.session_router = None  # class default: no affinity
    wrap_method(cls, "init_dispatcher", _wrap_init_dispatcher)


def apply_server_args(module) -> None:
    from sglang_session_cache.dp_affinity_options import patch_server_args_class

    patch_server_args_class(module.ServerArgs)
