"""Where :class:`~normlab.monitor.CollapseGuard` keeps its snapshots: host memory, disk, or a distributed checkpoint.

A snapshot is a nested dict of tensors and plain values (the model's and optimizer's ``state_dict``, the schedulers',
the GradScaler's, the monitor's, the random generators' and the failure tracker's state). A store keeps it under an
integer key and gives back an equal dict whose tensors live on the CPU (the guard loads them into the model and the
optimizer, which move them where they belong). Sharded state (FSDP2: DTensors) is kept as each rank's own shards and
given back in local form (:mod:`normlab.monitor.shards`); no store ever gathers a DTensor.

- :class:`HostStore` (``"host"``, the default): host memory. A tensor on a CUDA device is copied into pinned host
  buffers with ``non_blocking=True``: the copies are queued on the current stream behind the step that produced the
  values and ahead of the next one, so the host does not wait for them; a recorded CUDA event is waited on only when
  the snapshot is read back. The buffers of a dropped snapshot are reused by the next one (pinned memory is slow to
  allocate). Nothing stays on the accelerator.
- :class:`DiskStore` (``"disk"``): one ``torch.save`` file per snapshot (and rank), written atomically
  (``normlab._files.atomic_write``) and read back with ``torch.load(weights_only=True)``.
- :class:`DCPStore` (``"dcp"``): the model's and optimizer's tensors through ``torch.distributed.checkpoint``, one
  directory per snapshot. Under DDP every rank calls it at the same steps and one copy of the replicated state is
  written; the rest of the snapshot (rank-local: random generators, the monitor) stays in host memory.

Example:
    >>> store = HostStore()
    >>> store.put(0, {"w": torch.ones(2), "step": 3})
    >>> store.get(0), store.nbytes(0)
    ({'w': tensor([1., 1.]), 'step': 3}, 8)
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from normlab._files import atomic_write
from normlab.monitor.ranks import is_dtensor
from normlab.monitor.shards import local_form, map_tensors

__all__ = ["SnapshotStore", "HostStore", "DiskStore", "DCPStore", "make_store", "tensor_bytes", "rng_state"]


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, found.append)
    return found


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a nested state (dicts, lists, tuples).

    Example:
        >>> tensor_bytes({"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64), 1]})
        32
    """
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def cpu_copy(obj: Any) -> Any:
    """A copy of a nested state whose tensors are new CPU tensors (the optimizer then never aliases a snapshot)."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def rng_state() -> dict[str, Any]:
    """The random generators' state: torch's CPU generator, Python's, and CUDA's when CUDA is in use.

    Example:
        >>> sorted(rng_state())[:2]
        ['python', 'torch']
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_python_state(state["python"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(state):
    """Python's generator state with tuples again (a checkpoint read back may hold lists)."""
    version, internal, gauss = state
    return int(version), tuple(int(v) for v in internal), gauss


class SnapshotStore:
    """Keeps snapshots under integer keys. A store implements :meth:`put`, :meth:`get`, :meth:`drop` and
    :meth:`nbytes`; ``close()`` releases what it holds."""

    def put(self, key: int, state: dict) -> None:
        """Keep ``state`` (copied: later changes to its tensors do not reach the snapshot) under ``key``."""
        raise NotImplementedError

    def get(self, key: int) -> dict:
        """The state kept under ``key``, its tensors on the CPU; the caller must not change them in place."""
        raise NotImplementedError

    def drop(self, key: int) -> None:
        """Forget ``key`` (a key not held is ignored)."""
        raise NotImplementedError

    def nbytes(self, key: int) -> int:
        """The bytes the snapshot ``key`` takes where the store keeps it."""
        raise NotImplementedError

    def close(self) -> None:
        for key in list(getattr(self, "_held", ())):
            self.drop(key)


class HostStore(SnapshotStore):
    """Snapshots in host memory (module docstring).

    Args:
        pin: copy CUDA tensors into pinned memory, asynchronously; None (default): when CUDA is available.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._held: dict[int, tuple[dict, list, int]] = {}  # key -> (state, CUDA events of its copies, bytes)
        self._free: dict[tuple, list[torch.Tensor]] = {}  # buffers of dropped snapshots, by (shape, dtype)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        pool = self._free.get((tuple(t.shape), t.dtype))
        if pool:
            return pool.pop()
        pin = self.pin and t.device.type == "cuda"
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def put(self, key: int, state: dict) -> None:
        async_copies, size = [], [0]

        def copy(t: torch.Tensor) -> torch.Tensor:
            out = self._buffer(t)
            size[0] += out.numel() * out.element_size()
            non_blocking = out.is_pinned() and t.device.type == "cuda"
            out.copy_(t.detach(), non_blocking=non_blocking)
            if non_blocking:
                async_copies.append(t.device)
            return out

        kept = map_tensors(local_form(state), copy)  # a DTensor: its local shard only
        events = []
        for device in dict.fromkeys(async_copies):  # one event per device, on the stream that queued its copies
            events.append(torch.cuda.Event())
            events[-1].record(torch.cuda.current_stream(device))
        self._held[key] = (kept, events, size[0])

    def get(self, key: int) -> dict:
        state, events, _ = self._held[key]
        for event in events:
            event.synchronize()
        return state

    def drop(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        state, events, _ = held
        for event in events:  # a buffer is reused only once its copy has landed
            event.synchronize()
        for t in _tensors(state):
            self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def nbytes(self, key: int) -> int:
        return self._held[key][2]

    def close(self) -> None:
        super().close()
        self._free.clear()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DiskStore(SnapshotStore):
    """Snapshots as ``torch.save`` files in ``directory``, one per snapshot and rank, written atomically.

    Args:
        directory: where the files go (created if missing); ``snapshot-<key>-rank<rank>.pt``.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._held: dict[int, Path] = {}

    def _path(self, key: int) -> Path:
        return self.directory / f"snapshot-{key}-rank{_rank()}.pt"

    @torch.no_grad()
    def put(self, key: int, state: dict) -> None:
        live = local_form(map_tensors(state, lambda t: t.detach()))  # as they are now, no copy first; shards only
        self._held[key] = atomic_write(self._path(key), lambda f: torch.save(live, f))

    def get(self, key: int) -> dict:
        return torch.load(self._held[key], map_location="cpu", weights_only=True)

    def drop(self, key: int) -> None:
        path = self._held.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def nbytes(self, key: int) -> int:
        return self._held[key].stat().st_size


_DCP_PARTS = ("model", "optimizer")  # the parts of a snapshot written through torch.distributed.checkpoint


class DCPStore(SnapshotStore):
    """Snapshots whose model and optimizer tensors go through ``torch.distributed.checkpoint``, one directory per
    snapshot (``dcp-<key>``) in ``directory``; the other parts stay in host memory.

    On several ranks every rank must put and get the same keys at the same time (the guard does: its snapshots and
    rollbacks happen at the same steps on every rank); one copy of the replicated tensors is written, and each rank
    writes its own shards of a DTensor (FSDP2) and reads them back into its local shards (on the mesh's device, then
    copied to the CPU). Without a process group it writes and reads alone.

    Args:
        directory: where the snapshot directories go (created if missing).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._held: dict[int, tuple[Path, dict, dict]] = {}  # key -> (dir, the rest, tensor shapes)

    @torch.no_grad()
    def put(self, key: int, state: dict) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.directory / f"dcp-{key}"
        if _rank() == 0 and path.exists():
            shutil.rmtree(path)
        tensors = {part: state[part] for part in _DCP_PARTS}
        layout = map_tensors(tensors, _Slot.of)
        rest = cpu_copy({k: v for k, v in state.items() if k not in _DCP_PARTS})
        with _alone():
            dcp.save(map_tensors(tensors, lambda t: t.detach()), checkpoint_id=str(path), no_dist=not _distributed())
        self._held[key] = (path, rest, layout)

    def get(self, key: int) -> dict:
        import torch.distributed.checkpoint as dcp

        path, rest, layout = self._held[key]
        empty = _unmap_layout(layout)
        with _alone():
            dcp.load(empty, checkpoint_id=str(path), no_dist=not _distributed())
        return {**rest, **map_tensors(local_form(empty), lambda t: t.to("cpu"))}

    def drop(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None and _rank() == 0:
            shutil.rmtree(held[0], ignore_errors=True)

    def nbytes(self, key: int) -> int:
        path = self._held[key][0]
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _alone():
    """Without a process group DCP warns on every call that it saves in one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _Slot:
    """Where a tensor was in a snapshot's layout: its shape and dtype; for a DTensor also its local shape, mesh,
    placements and stride (the mesh object is held in memory, never written)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, dtensor: tuple | None = None) -> None:
        self.shape, self.dtype, self.dtensor = shape, dtype, dtensor

    @classmethod
    def of(cls, t: torch.Tensor) -> _Slot:
        if not is_dtensor(t):
            return cls(tuple(t.shape), t.dtype)
        return cls(tuple(t.shape), t.dtype, (tuple(t.to_local().shape), t.device_mesh, t.placements, t.stride()))

    def empty(self) -> torch.Tensor:
        """An empty tensor of this slot: on the CPU, or a DTensor of the slot's mesh (its local shard on the mesh's
        device) for DCP to read this rank's shards into."""
        if self.dtensor is None:
            return torch.empty(self.shape, dtype=self.dtype)
        from torch.distributed.tensor import DTensor

        local, mesh, placements, stride = self.dtensor
        data = torch.empty(local, dtype=self.dtype, device=mesh.device_type)
        return DTensor.from_local(data, mesh, placements, run_check=False, shape=self.shape, stride=stride)


def _unmap_layout(layout: Any) -> Any:
    """Empty tensors in the place of the :class:`_Slot` entries of a layout (:meth:`_Slot.empty`)."""
    if isinstance(layout, _Slot):
        return layout.empty()
    if isinstance(layout, dict):
        return {k: _unmap_layout(v) for k, v in layout.items()}
    if isinstance(layout, list | tuple):
        out = [_unmap_layout(v) for v in layout]
        return out if isinstance(layout, list) else tuple(out)
    return layout


def make_store(store: Any, directory: str | os.PathLike | None) -> SnapshotStore:
    """The store named by :class:`~normlab.monitor.SnapshotOptions` (``"host"``, ``"disk"``, ``"dcp"``, or a store
    object, returned as is).

    Example:
        >>> type(make_store("host", None)).__name__
        'HostStore'
    """
    if not isinstance(store, str):
        return store
    if store == "host":
        return HostStore()
    return DiskStore(directory) if store == "disk" else DCPStore(directory)
