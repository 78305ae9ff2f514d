"""Deliver the TTL's shared clock to every rank in scheduler order.

The rank that reads the tokenizer socket (PP stage 0, attention-TP/CP rank 0)
reads ``time.monotonic()`` once per poll and appends a ``SharedClockTick`` to
the polled batch before SGLang broadcasts it; TP/CP ranks get it through that
broadcast and later PP stages through the batch the previous stage forwards.
Each rank's ``process_input_requests`` takes the ticks out before SGLang sees
the batch and advances its cache's clock, so every rank expires the same
sessions at the same point of the same step.

Only with ``--enable-session-radix-cache``; otherwise both wrappers are one
attribute check in front of SGLang's code.  A tick goes with every batch that
carries requests and at least every ``TICK_INTERVAL_S`` otherwise (with
``--sleep-on-idle`` an idle scheduler waits up to a second for a message
between polls: ticks then come about a second apart).
"""

from __future__ import annotations

import logging
import time

from sglang_session_cache.patches._wrap import wrap_method

logger = logging.getLogger("sglang.srt.managers.scheduler")

#: Idle polls carry a tick at most this often (seconds of the source rank).
TICK_INTERVAL_S = 0.25
_last_tick = [float("-inf")]


def _ticks_enabled(server_args) -> bool:
    if not getattr(server_args, "enable_session_radix_cache", False):
        return False
    # EPD language-only schedulers hand the batch to the multimodal receiver,
    # which expects requests only: no ticks there (the TTL then never fires).
    return not getattr(server_args, "language_only", False)


def _wrap_broadcast(orig):
    from sglang_session_cache.session_idle import SharedClockTick

    def _broadcast_reqs_across_ranks(self, recv_reqs):
        if (
            recv_reqs is not None
            and self.ps.pp_rank == 0
            and _ticks_enabled(self.server_args)
        ):
            now = time.monotonic()
            if recv_reqs or now - _last_tick[0] >= TICK_INTERVAL_S:
                _last_tick[0] = now
                recv_reqs = list(recv_reqs)
                recv_reqs.append(SharedClockTick(now))
        return orig(self, recv_reqs)

    return _broadcast_reqs_across_ranks


def split_ticks(recv_reqs):
    """``(requests without ticks, tick values in order)``."""
    from sglang_session_cache.session_idle import SharedClockTick

    ticks = [r.t for r in recv_reqs if type(r) is SharedClockTick]
    if not ticks:
        return recv_reqs, ticks
    return [r for r in recv_reqs if type(r) is not SharedClockTick], ticks


def _wrap_process_input_requests(orig):
    from sglang_session_cache.patches.unified_cache import guarded

    def process_input_requests(self, recv_reqs):
        if not self.server_args.enable_session_radix_cache or not recv_reqs:
            return orig(self, recv_reqs)
        # A new list: PP forwards the original batch (ticks included) to the
        # next stage after this call.
        reqs, ticks = split_ticks(recv_reqs)
        advance = getattr(self.tree_cache, "advance_session_clock", None)
        if ticks and advance is not None:
            guarded(advance, max(ticks))
        return orig(self, reqs)

    return process_input_requests


def apply_request_receiver(module) -> None:
    wrap_method(module.SchedulerRequestReceiver, "_broadcast_reqs_across_ranks",
                _wrap_broadcast)


def apply_scheduler(module) -> None:
    wrap_method(module.Scheduler, "process_input_requests", _wrap_process_input_requests)
