"""normlab.runner.grid.pool.run_jobs: results in the parent, failed jobs reported or raised, a dead worker: RunError."""

from __future__ import annotations

import os

import pytest

from normlab.runner.errors import RunError
from normlab.runner.grid.pool import run_jobs


def _double(x: int) -> int:
    return 2 * x


def _fail(x: int) -> int:
    raise ValueError(f"job {x} failed")


def _die(x: int) -> int:
    os._exit(3)  # what the kernel's OOM killer does to a worker, as far as the parent can tell


@pytest.mark.parametrize("workers", [1, 2])
def test_results_and_errors_reach_the_parent(workers):
    done, errors = {}, {}
    jobs = [(_double, (1,)), (_fail, (2,)), (_double, (3,))]
    n = run_jobs(
        jobs, workers=workers, threads=1, on_done=done.__setitem__, on_error=lambda i, e: errors.__setitem__(i, str(e))
    )
    assert n == workers and done == {0: 2, 2: 6} and errors == {1: "job 2 failed"}


def test_without_on_error_a_failed_job_stops_the_run():
    with pytest.raises(ValueError, match="job 2 failed"):
        run_jobs([(_fail, (2,))], workers=1, threads=1, on_done=lambda i, r: None)


def test_a_dead_worker_is_a_one_line_run_error():
    with pytest.raises(RunError, match="a worker process died"):
        run_jobs(
            [(_die, (0,)), (_double, (1,))], workers=2, threads=1, on_done=lambda i, r: None, on_error=lambda i, e: None
        )
