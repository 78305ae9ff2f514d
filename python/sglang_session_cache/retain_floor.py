"""SWA retain floor for hybrid SWA + Mamba caches (pure helpers, no SGLang
imports, so they can be unit-tested and reused by the replay).

The problem
-----------
A hybrid SWA + Mamba model can only resume from a position where a Mamba
state was checkpointed. With the extra-buffer strategy that position is
``req.mamba_last_track_seqlen``: it advances every ``--mamba-track-interval``
tokens, and ``cache_finished_req`` inserts the request's tokens only up to it.
The SWA component accepts a match at that node only if the last
``sliding_window_size`` tokens below it still hold SWA KV.

Decode-side SWA eviction (``free_swa_out_of_window_slots``) frees slots
relative to the *tail* of the sequence::

    frontier = page_floor(pre_len - max(sliding_window_size, page_size))

so once the tail has run more than a window past the checkpoint, the window
under the checkpoint is gone, the inserted leaf is an SWA tombstone, and the
next turn of the conversation cannot reuse anything it decoded.

The floor
---------
``retain_floor = max(0, checkpoint - sliding_window_size)``. Eviction on the
radix path clamps its threshold to ``min(threshold, retain_floor)``, keeping
the window under the checkpoint alive until the next checkpoint moves the
floor forward. The cost is bounded: at most ``track_interval + page_size``
extra SWA slots per running request.

The seam
--------
``free_swa_out_of_window_slots`` uses ``pre_len`` for nothing but the radix
threshold ``pre_len - M`` (``M = max(sliding_window_size, page_size)``), so
calling it with ``pre_len' = min(pre_len, retain_floor + M)`` gives::

    pre_len' - M = min(pre_len - M, retain_floor) = min(threshold, retain_floor)

i.e. exactly the clamped threshold, in integers, with every other step of the
original (the protected-prefix floor, ``max`` with the current frontier, page
flooring, the frees) unchanged. Hence the frontier still only moves forward
and stays page aligned.

The tree-side checkpoint (prefill region)
-----------------------------------------
``cache_unfinished_req`` (the end of every prefill) inserts the prompt up to
the Mamba checkpoint the prefill tracked, re-matches it and then
``MambaComponent.cleanup_after_caching_req`` sets
``req.mamba_last_track_seqlen = None``; the next request-side checkpoint only
appears when decode crosses a multiple of ``--mamba-track-interval``. Until
then the request field says "no checkpoint", although the request's deepest
resumable Mamba state is right there in the tree: the re-match only stops at a
node that holds a Mamba value (and a full window of SWA KV below it), and sets
``req.last_node`` to that node and ``req.cache_protected_len`` to its depth.
(``len(req.prefix_indices)`` is *not* that depth: after the re-match it also
covers the request's uncached tail ``[cache_protected_len, fill_len)``.)

So the floor is taken over both checkpoints::

    retain_floor = max(request checkpoint, tree checkpoint) - sliding_window_size

where the tree checkpoint is ``req.cache_protected_len`` when ``req.last_node``
holds a device Mamba value and the Mamba component tracks checkpoints (extra
buffer), ``None`` otherwise. Without the extra buffer ``cache_finished_req``
inserts the whole sequence with the live state at its tail, which
tail-relative eviction already keeps matchable, and a tree floor there would
never be overtaken by a request checkpoint (it would pin every decoded SWA
slot for the request's life), so that mode keeps ``None``.

``free_swa_out_of_window_slots`` never frees below ``cache_protected_len``
(its own ``evict_floor``): the window under the tree checkpoint is owned and
locked by the tree and already out of decode-side eviction's reach. What the
tree checkpoint changes is the first decode steps: the floor is no longer
``None`` there, so the request keeps ``[cache_protected_len, tail)`` until its
first decode checkpoint moves the floor forward, exactly as it keeps
``[checkpoint - window, tail)`` between any two later checkpoints. The extra
retention stays within ``track_interval + max(page_size, mamba chunk)`` per
request.
"""

from __future__ import annotations

from typing import Optional


def clamp_pre_len(
    pre_len: int,
    retain_floor: Optional[int],
    *,
    sliding_window_size: int,
    page_size: int,
    is_chunk_cache: bool = False,
) -> int:
    """The ``pre_len`` to hand the original ``free_swa_out_of_window_slots`` so
    that its radix-path eviction threshold becomes ``min(threshold, retain_floor)``.

    Returns ``pre_len`` unchanged when there is no floor or on the chunk-cache
    path (which keeps no tree and so has nothing to match later)."""
    if retain_floor is None or is_chunk_cache:
        return pre_len
    return min(pre_len, retain_floor + max(sliding_window_size, page_size))


def retain_floor_from_checkpoint(
    checkpoint: Optional[int], sliding_window_size: int
) -> Optional[int]:
    """``checkpoint - sliding_window_size`` clamped at 0; ``None`` without a
    checkpoint."""
    if checkpoint is None:
        return None
    return max(0, checkpoint - sliding_window_size)


def retain_floor_from_checkpoints(
    request_checkpoint: Optional[int],
    tree_checkpoint: Optional[int],
    sliding_window_size: int,
) -> Optional[int]:
    """The floor for the deeper of the request-side checkpoint
    (``req.mamba_last_track_seqlen``) and the tree-side one (the depth of the
    request's Mamba-holding ``last_node``), minus the window, clamped at 0;
    ``None`` when neither exists. With ``tree_checkpoint=None`` this is
    :func:`retain_floor_from_checkpoint` (the request-only floor)."""
    known = [c for c in (request_checkpoint, tree_checkpoint) if c is not None]
    return retain_floor_from_checkpoint(max(known, default=None), sliding_window_size)
