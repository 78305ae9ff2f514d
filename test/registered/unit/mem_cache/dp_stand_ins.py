"""Stand-in for SGLang's scheduler process in the DP-controller tests.

A real scheduler needs a model and a device; what the controller tests look
at is only where the real ``DataParallelController`` sends each message.  The
stand-in takes the scheduler's place in ``run_scheduler_process_func``: it
connects to its rank's input socket exactly like the scheduler (PULL, connect),
reports ready through the pipe, and forwards a summary of every message it
receives to the test's collector socket (address in ``COLLECTOR_ENV``).
"""

from __future__ import annotations

import os

COLLECTOR_ENV = "SGLANG_SESSION_CACHE_TEST_DP_COLLECTOR"
STAND_IN_MAX_TOKENS = 65536


def stand_in_scheduler_process(server_args, port_args, gpu_id, tp_rank, attn_cp_rank,
                               moe_dp_rank, moe_ep_rank, pp_rank, dp_rank, pipe_writer,
                               *display_ranks):
    import zmq

    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.utils.network import get_zmq_socket

    ctx = zmq.Context()
    recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, False)
    out = ctx.socket(zmq.PUSH)
    out.connect(os.environ[COLLECTOR_ENV])
    pipe_writer.send({
        "status": "ready",
        "max_total_num_tokens": STAND_IN_MAX_TOKENS,
        "max_req_input_len": STAND_IN_MAX_TOKENS,
    })
    parent = os.getppid()
    while os.getppid() == parent:  # the controller went away: stop
        if not recv.poll(200):
            continue
        msg = sock_recv(recv)
        out.send_pyobj({
            "dp_rank": dp_rank,
            "type": type(msg).__name__,
            "rid": getattr(msg, "rid", None),
            "session_id": getattr(msg, "session_id", None),
        })


def run_controller_forking_stand_ins(server_args, port_args, pipe_writer):
    """``run_data_parallel_controller_process`` with the stand-in schedulers
    forked from the controller (already imported) instead of spawned: the same
    controller code, a fraction of the start-up CPU on a shared test box."""
    import multiprocessing as mp

    from sglang.srt.managers.data_parallel_controller import (
        run_data_parallel_controller_process)

    mp.set_start_method("fork", force=True)
    run_data_parallel_controller_process(
        server_args, port_args, pipe_writer, stand_in_scheduler_process)
