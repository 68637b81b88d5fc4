"""Run independent jobs in this process or in spawned worker processes that never outlive their parent.

:func:`run_jobs` is the one place where the runner starts processes (grids of training runs, the capsule grid).
Each worker requests ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG`` on Linux) and also polls its parent
(everywhere); it ignores SIGINT, which the parent handles: on Ctrl-C, SIGTERM or a failed job the parent terminates
its workers before it re-raises, so a job interrupted half-way simply resumes the next time. A job that raises
either stops the run (the default) or, with ``on_error``, is reported and the other jobs go on; a worker that dies
always stops the run.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from normlab.runner.errors import RunError

__all__ = ["run_jobs", "default_workers"]

_PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    """Number of CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _die_with_parent(parent: int) -> None:
    """Exit when ``parent`` dies: PR_SET_PDEATHSIG (Linux), and a thread that polls the parent (everywhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    threading.Thread(target=watch, name="normlab-parent-watch", daemon=True).start()


def _init_worker(threads: int, parent: int | None = None) -> None:
    """Worker set-up: torch threads, death with the parent, SIGINT left to the parent (it stops the workers)."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        _die_with_parent(parent)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate the pool's worker processes and reap them."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
    pool.shutdown(wait=False, cancel_futures=True)


def _pool(
    jobs: Sequence[tuple[Callable, tuple]],
    workers: int,
    threads: int,
    on_done: Callable[[int, Any], None],
    on_error: Callable[[int, Exception], None] | None,
) -> None:
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(threads, os.getpid())
    ) as pool:
        futures = {pool.submit(fn, *args): i for i, (fn, args) in enumerate(jobs)}
        try:
            for f in as_completed(futures):
                try:
                    result = f.result()
                except BrokenProcessPool:  # a worker died: the pool cannot go on (a rerun resumes)
                    raise RunError(
                        "a worker process died (killed, or out of memory?); rerun the same command to resume"
                    ) from None
                except Exception as e:
                    if on_error is None:
                        raise
                    on_error(futures[f], e)
                    continue
                on_done(futures[f], result)
        except BaseException:
            _stop_workers(pool)
            raise


def _in_process(
    jobs: Sequence[tuple[Callable, tuple]],
    on_done: Callable[[int, Any], None],
    on_error: Callable[[int, Exception], None] | None,
) -> None:
    for i, (fn, args) in enumerate(jobs):
        try:
            result = fn(*args)
        except Exception as e:
            if on_error is None:
                raise
            on_error(i, e)
            continue
        on_done(i, result)


def run_jobs(
    jobs: Sequence[tuple[Callable, tuple]],
    *,
    workers: int,
    threads: int | None,
    on_done: Callable[[int, Any], None],
    on_error: Callable[[int, Exception], None] | None = None,
) -> int:
    """Run ``fn(*args)`` for every ``(fn, args)`` of ``jobs`` (in list order as workers free up) and call
    ``on_done(index, result)`` in the parent as each finishes. ``workers`` processes (capped by the number of jobs;
    1 runs them in this process, with ``threads`` torch threads if given) with ``threads`` torch threads each
    (default 1). ``fn`` must be importable (spawned workers). A job that raises an ``Exception`` stops the run, or,
    given ``on_error``, calls ``on_error(index, exception)`` and the others go on. Returns the number of workers
    used."""
    n = max(1, min(int(workers), len(jobs)))
    saved = torch.get_num_threads()
    try:
        if n == 1:
            if threads:
                torch.set_num_threads(int(threads))
            _in_process(jobs, on_done, on_error)
        else:
            _pool(jobs, n, int(threads or 1), on_done, on_error)
    finally:
        torch.set_num_threads(saved)
    return n
