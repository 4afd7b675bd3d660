"""Run a function on W real processes joined by a gloo process group, and collect what each returns.

Children are forked by multiprocessing's ``forkserver``: a fresh interpreter that has imported torch and
attnkit.distributed and computed nothing (none of torch's thread pools started), so each rank starts without
importing them again (seconds each) and no rank is a fork of a process that has run torch's thread pools (which
can hang; spawn, where there is no fork). Each rank runs on one thread so that four ranks share two cores without
thrashing. A rank that dies or hangs is reported as such, never waited for past ``deadline``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# What the fork server imports before it forks any rank: what every worker module imports first (a module of
# tests/ cannot be named here: the server does not have tests/ on its path).
PRELOAD = ["torch", "torch.distributed", "attnkit", "attnkit.distributed"]


@dataclass
class Outcome:
    """What one rank ended with: ``value`` when ``fn`` returned, ``error`` (type name, message) when it raised,
    neither when the process died or was still running at the deadline."""

    rank: int
    value: Any = None
    error: tuple[str, str] | None = None
    seconds: float = 0.0  # from the process group being ready to fn's end
    finished: bool = False


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, deadline: float = 120.0) -> list[Outcome]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; one :class:`Outcome` per rank."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of the session
    else:  # Windows: no fork, each rank imports torch itself
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes = [Outcome(rank=r) for r in range(world_size)]
    end = time.monotonic() + deadline
    pending = world_size
    while pending and time.monotonic() < end:
        try:
            got: Outcome = results.get(timeout=0.2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            continue
        outcomes[got.rank] = got
        pending -= 1
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()) if pending == 0 else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    return outcomes


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    start = time.monotonic()
    outcome = Outcome(rank=rank, finished=True)
    try:
        outcome.value = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        outcome.error = (type(e).__name__, f"{e}\n{traceback.format_exc()}")
    outcome.seconds = time.monotonic() - start
    results.put(outcome)
    results.close()
    results.join_thread()
    # A rank whose peers died cannot tear the group down cleanly; leave without waiting for it.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
