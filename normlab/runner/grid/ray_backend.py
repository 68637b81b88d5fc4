"""Grid cells as Ray tasks: one command runs a grid on an embedded local Ray or on a Ray cluster.

:func:`run_on_ray` is what :func:`normlab.runner.grid.execute.run_cells` calls with ``backend="ray"``. Each cell is one
Ray task that declares its resources (``num_cpus`` = its torch threads, ``num_gpus`` = 1 on a CUDA device) and calls
its experiment's training function into ``OUT/runs/<cell id>``: the files of the process backend, in the same
place, so a grid half-run by one backend is finished by the other. Without an address normlab starts a local Ray
in this process (and stops it at the end), whose workers import from this process's import path (so a model or
data factory ``pkg.module:function`` found here is found there); with an address it joins that cluster (``ray start
--head`` prints it), whose nodes must import the factories themselves (an installed package, or Ray's
``runtime_env``). A Ray session this process already holds (``ray.init`` in a notebook or a test) is used as it is.

**Outputs: a shared filesystem.** Cells write their files from the node that runs them, the driver writes
``results.json``. A cluster of several machines therefore needs ``--out`` on a filesystem that every node mounts
at the same path (NFS, a cloud file store). The object store would carry a finished cell's files, but not the
checkpoint a cell writes after every epoch: resuming a half-trained cell after a lost worker, a lost node or a
Ctrl-C needs that checkpoint where the next attempt runs, and the other backend needs it on disk. The driver checks
that each finished cell's ``summary.json`` is visible to it and stops with a one-line error when it is not.

**Failures.** A worker that dies (killed, out of memory, its node lost) is retried by Ray (``max_retries``) and
the cell resumes from its last checkpoint. A cell that raises is not retried: the driver records it as failed with
its error and goes on with the other cells. Ctrl-C (or SIGTERM) cancels every unfinished cell, killing the workers
that run them, and stops the Ray that normlab started; finished cells stay on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from normlab.runner.errors import RunError, UsageError, error_line

__all__ = ["run_on_ray", "ray_session", "require_ray", "check_address", "check_device", "MAX_RETRIES"]

#: Ray reruns a cell whose worker died this many times (it resumes from its checkpoint).
MAX_RETRIES = 3
_OBJECT_STORE = 128 * 2**20  # an embedded Ray only carries cell summaries: keep its shared memory small
_POLL_S = 0.5  # the driver wakes this often, so that Ctrl-C is handled at once


def require_ray(local: bool = False):
    """The ``ray`` module, or a one-line :class:`~normlab.runner.errors.UsageError` naming the extra to install.

    ``local``: this process only starts a Ray of its own. Before Ray's first import, that Ray is then kept on the
    loopback: Ray's switch for a local-only Ray (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) makes its node address
    127.0.0.1 instead of the machine's network address (unless the user set the variable)."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise UsageError("--backend ray needs Ray: pip install 'normlab[ray]'") from None
    return ray


def _cell_task(train: Callable, config, out_dir: str, threads: int) -> tuple[dict[str, Any], str]:
    """The Ray task of one cell: the experiment's ``train(config, out_dir)`` with ``threads`` torch threads;
    returns (summary, host name)."""
    torch.set_num_threads(threads)
    return train(config, out_dir), socket.gethostname()


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[Any]:
    """The ``ray`` module, connected: to the session this process already holds (used as it is), else to the
    cluster at ``address``, else to a local Ray started here with ``num_cpus`` CPUs; the connection or local Ray
    made here ends with the block."""
    ray = require_ray(local=not address)
    if ray.is_initialized():
        yield ray
        return
    if address:
        kwargs: dict[str, Any] = {"address": address}
    else:
        # nothing else joins an embedded Ray: on the loopback (see require_ray), without a dashboard, and without
        # usage statistics unless the user asked for them (RAY_USAGE_STATS_ENABLED=1)
        kwargs = {
            "num_cpus": num_cpus,
            "include_dashboard": False,
            "object_store_memory": _OBJECT_STORE,
            "_node_ip_address": "127.0.0.1",
            # its workers import what this process imports (a model or data factory of the current directory)
            "runtime_env": {"env_vars": {"PYTHONPATH": _import_path()}},
        }
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(**kwargs, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        first = error_line(e)
        where = f"--address {address}: cannot connect to a Ray cluster" if address else "cannot start a local Ray"
        raise UsageError(f"{where} ({first})") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _import_path() -> str:
    """This process's import path (``sys.path``, the current directory for ``""``) as a ``PYTHONPATH``."""
    dirs = [os.getcwd() if not p else p for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in dirs if os.path.isdir(p)))


def check_address(address: str) -> None:
    """Refuse an ``--address`` that is not ``host:port`` (or ``auto``) or where nothing answers (TCP, 3 s), before
    anything is written: Ray itself keeps retrying a wrong address for minutes."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        raise UsageError(f"--address: expected host:port (as `ray start --head` prints it) or auto, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except OSError as e:
        raise UsageError(
            f"--address {address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
            f"start one with `ray start --head` or check the address"
        ) from None


def check_device(device: str) -> None:
    """Refuse ``cuda:N`` (N > 0) before anything is written: Ray gives each cell its own GPU, seen as cuda:0."""
    if device == "auto":
        return
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index not in (None, 0):
        raise UsageError(
            f"--device {device} with --backend ray: Ray gives each cell its own GPU, which the cell "
            f"sees as cuda:0; use --device cuda"
        )


def _gpus(device: str, cluster_gpus: float) -> int:
    """GPUs a cell on ``device`` asks for: 1 on cuda (auto: when the cluster has one), else 0."""
    if device == "auto":
        return int(cluster_gpus >= 1)
    check_device(device)
    return int(torch.device(device).type == "cuda")


def _check_resources(ray, jobs: Sequence, threads: int) -> dict[str, float]:
    """Refuse a grid the cluster cannot run at all (it would wait forever); returns the cluster's resources."""
    res = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    largest = max((r.get("CPU", 0) for r in nodes), default=res.get("CPU", 0))
    if largest < threads:  # a task runs on one node: no node could take a cell
        raise UsageError(
            f"--threads {threads}: the largest node of the Ray cluster has {largest:g} CPUs; each cell "
            f"asks for --threads CPUs on one node"
        )
    if any(_gpus(c.config.device, res.get("GPU", 0)) for _, c in jobs) and res.get("GPU", 0) < 1:
        raise UsageError("--device cuda with --backend ray: the Ray cluster has no GPU")
    return res


def _submit(task, grid, cell, threads: int, cluster_gpus: float):
    """Start ``cell`` as a run of the remote function ``task`` with its resources; returns its object ref."""
    return task.options(
        num_cpus=threads,
        num_gpus=_gpus(cell.config.device, cluster_gpus),
        max_retries=MAX_RETRIES,
        retry_exceptions=False,
        name=f"normlab:{cell.cell_id}",
    ).remote(grid.experiment.train, cell.config, str(grid.cell_dir(cell)), threads)


def _error_text(ray, e: BaseException) -> str:
    """One line: the cell's own exception (type and first line), or what Ray says happened to its worker."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return error_line(e, with_type=True)


def _check_visible(grid, cell, host: str) -> None:
    if not (grid.cell_dir(cell) / "summary.json").is_file():
        raise RunError(
            f"cell {cell.cell_id} finished on {host}, but {grid.cell_dir(cell) / 'summary.json'} is not "
            f"visible on {socket.gethostname()}: a Ray cluster of several machines needs --out on a "
            f"filesystem shared by every node, at the same path"
        )


def _collect(ray, refs: dict, done: Callable, failed: Callable) -> None:
    """Wait for every task of ``refs`` ({ref: (grid, cell)}); report each as done or failed as it ends."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
        for ref in ready:
            grid, cell = refs[ref]
            try:
                summary, host = ray.get(ref)
            except ray.exceptions.RayError as e:  # the cell raised, or its worker died MAX_RETRIES + 1 times
                failed(grid, cell, _error_text(ray, e))
                continue
            _check_visible(grid, cell, host)
            done(grid, cell, summary)


def _cancel(ray, refs: Sequence) -> None:
    """Cancel unfinished tasks, killing their workers, and wait a little for the kills to take effect."""
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
    with contextlib.suppress(Exception):
        ray.wait(list(refs), num_returns=len(refs), timeout=10)


def run_on_ray(
    jobs: Sequence[tuple[Any, Any]],
    *,
    threads: int,
    done: Callable,
    failed: Callable,
    address: str | None = None,
    num_cpus: int | None = None,
) -> float:
    """Run ``jobs`` ((grid run, cell) pairs, in submission order) as Ray tasks with ``threads`` CPUs each.

    Args:
        jobs: what :func:`~normlab.runner.grid.execute.run_cells` runs.
        threads: torch threads of a cell, its ``num_cpus``.
        done: ``done(grid, cell, summary)``, called in this process as each cell finishes.
        failed: ``failed(grid, cell, error_line)`` for a cell that raised (or whose worker kept dying).
        address: a Ray cluster (``host:port`` or ``auto``); None: a local Ray with ``num_cpus`` CPUs.
        num_cpus: see ``address`` (at least ``threads``).

    Returns:
        The CPUs of the Ray cluster used.

    Raises:
        UsageError: Ray missing, an unreachable address, a grid the cluster cannot run.
        RunError: a finished cell's files are not visible here (a cluster without a shared filesystem).
    """
    with ray_session(address, max(threads, num_cpus or 1)) as ray:
        res = _check_resources(ray, jobs, threads)
        task = ray.remote(_cell_task)
        refs = {_submit(task, g, c, threads, res.get("GPU", 0)): (g, c) for g, c in jobs}
        try:
            _collect(ray, refs, done, failed)
        except BaseException:
            _cancel(ray, list(refs))
            raise
        return res.get("CPU", 0)
