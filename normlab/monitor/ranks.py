"""Which ranks the monitor's statistics come from, and how each rank's share is merged in ONE collective.

On one process the monitor sees every output filter of a layer and the whole batch. Under data parallelism each rank
sees its own share of the batch: with DDP every rank holds a full copy of the weights, with FSDP2
(``torch.distributed.fsdp.fully_shard``) each rank holds only a shard of each weight, a DTensor placed ``Shard(0)``:
whole output filters (rows), a contiguous block of them per rank. :class:`Ranks` reads from the model which case it
is (:meth:`Ranks.of`), and :class:`Reduction` merges what every rank measured, as ``SyncBatchNorm`` merges its
statistics: count-weighted, in one ``all_reduce`` (a sum) per call of :meth:`Reduction.run`:

- per-filter values (a filter lives on exactly one rank) are written at their global rows, zeros elsewhere, and
  summed: every rank then holds the vector an unsharded model gives (:meth:`Reduction.rows`);
- count-weighted means (the per-channel moments of a layer's input) are summed as ``count * mean`` and ``count``
  (:meth:`Reduction.weighted`);
- ``(count, mean, M2)`` of a layer's output go into one slot per rank (a sum over slots that only their rank
  fills is an all-gather) and are merged by Chan et al.'s pairwise formula (:meth:`Reduction.moments`,
  :func:`~normlab.monitor.stats.merge_moments`), without the cancellation of ``E[Y^2] - E^2[Y]``.

A replicated weight (DDP's copies, a DTensor's ``Replicate`` mesh dims) is read from the first rank of its replicas
only, so nothing is counted twice. On one process :class:`Reduction` communicates nothing and returns every value
unchanged. Placements that split a filter across ranks (tensor parallelism's ``Shard(1)``, ``_StridedShard``, a
transposed convolution's or transformers' ``Conv1D``'s ``Shard(0)``, which splits input channels) are refused in
one line (:func:`check_filter_placements`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from normlab.monitor.stats import merge_moments

__all__ = [
    "Ranks",
    "Reduction",
    "is_dtensor",
    "uses_fsdp1",
    "check_filter_placements",
    "local_rows",
    "owned_square_sum",
]


def _dtensor_types():
    """``(DTensor, Shard, Replicate)``, or None where torch has no distributed package."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Shard, Replicate


def is_dtensor(t) -> bool:
    """True when ``t`` is a ``torch.distributed.tensor.DTensor`` (a parameter of an FSDP2 or tensor-parallel model)."""
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def _placements(t: Tensor) -> str:
    return f"{tuple(t.placements)} on a mesh of {t.device_mesh.size()} ranks"


def check_filter_placements(t: Tensor, where: str, rows_are_filters: bool = True) -> None:
    """Refuse, in one line, a DTensor weight whose output filters are not whole on each rank.

    Supported: every mesh dim ``Replicate`` or ``Shard(0)`` (FSDP2's ``fully_shard``; HSDP's ``(Replicate, Shard(0))``),
    ``Shard(0)`` only where the weight's rows are its output filters (``rows_are_filters``: conv, linear; not a
    transposed convolution's (C_in, C_out/groups, ...) nor transformers' ``Conv1D`` (in, out)). A plain tensor passes.

    Example:
        >>> check_filter_placements(torch.zeros(2, 3), "layer 'fc'")   # not a DTensor: nothing to check
    """
    types = _dtensor_types()
    if types is None or not isinstance(t, types[0]):
        return
    _, shard, replicate = types
    ok = all(
        type(p) is replicate or (rows_are_filters and type(p) is shard and p.dim == 0 and t.dim() >= 1)
        for p in t.placements
    )
    if not ok:
        allowed = "Shard(0) (FSDP2's fully_shard) and Replicate" if rows_are_filters else "Replicate only"
        raise ValueError(
            f"{where}: the weight is a DTensor placed {_placements(t)}, which splits output filters across ranks "
            f"(tensor parallelism): the monitor supports {allowed} on a watched weight, whole filters on each rank"
        )


def _owned_rows(t: Tensor) -> tuple[int, int] | None:
    """The global rows [lo, hi) of a ``Shard(0)``/``Replicate`` DTensor that this rank contributes, or None when it
    holds a replica that another rank (coordinate 0 of that mesh dim) contributes. Shards follow ``torch.chunk``:
    ceil(rows / ranks) rows each, the last ones shorter or empty (DTensor's and FSDP2's layout)."""
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    lo, hi = 0, t.shape[0]
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate():
            if coord[mesh_dim] != 0:
                return None
            continue
        chunk = math.ceil((hi - lo) / mesh.size(mesh_dim))
        lo, hi = min(lo + coord[mesh_dim] * chunk, hi), min(lo + (coord[mesh_dim] + 1) * chunk, hi)
    return lo, hi


@dataclass(frozen=True)
class Ranks:
    """The ranks a monitor merges its statistics over (:meth:`of` reads them from the model).

    Attributes:
        group: the process group (a DDP wrapper's, or the default group for DTensor parameters); None for this
            process alone.
        rank: this process's rank in ``group``.
        size: the number of ranks in ``group`` (1: nothing to merge).

    Example:
        >>> Ranks.of(nn.Linear(2, 2))          # no DDP wrapper, no DTensor parameter: this process alone
        Ranks(group=None, rank=0, size=1)
    """

    group: object | None = None
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, model: nn.Module, params: list[Tensor] | None = None) -> Ranks:
        """The ranks of ``model`` (before unwrapping): a DDP wrapper's process group; the default (world) group when
        a parameter in ``params`` (default: all of the model's) is a DTensor (FSDP2) - its mesh must span every rank;
        else this process alone (also for a model that each rank trains on its own).

        Raises ValueError for FSDP1 (``FullyShardedDataParallel``: it flattens the weights it shards; use
        ``fully_shard``), a DTensor mesh of only some ranks (pipeline stages) and a DDP wrapper around DTensor
        parameters.
        """
        ddp = _find_ddp(model)
        _refuse_fsdp1(model)
        params = list(model.parameters()) if params is None else params
        dtensors = [p for p in params if is_dtensor(p)]
        if dtensors and ddp is not None:
            raise ValueError("VarianceMonitor: a DDP wrapper around DTensor parameters is not supported")
        if dtensors:
            world = dist.get_world_size()
            small = next((p for p in dtensors if p.device_mesh.size() != world), None)
            if small is not None:
                raise ValueError(
                    f"VarianceMonitor: a parameter is a DTensor on a mesh of {small.device_mesh.size()} of the "
                    f"{world} ranks; the monitor merges over every rank, so every watched DTensor's mesh must span "
                    "them all (pipeline stages are not supported)"
                )
            group = dist.group.WORLD
        elif ddp is not None:
            group = ddp.process_group
        else:
            return cls()
        size = dist.get_world_size(group)
        return cls(group, dist.get_rank(group), size) if size > 1 else cls()


def _find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DDP wrapper in ``model``'s chain of wrappers (DDP, DataParallel, torch.compile), or None."""
    for _ in range(16):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        inner = model.module if isinstance(model, nn.DataParallel) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def uses_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` holds a ``FullyShardedDataParallel`` (FSDP1) module, which flattens the weights it shards.

    Example:
        >>> uses_fsdp1(nn.Linear(2, 2))
        False
    """
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _refuse_fsdp1(model: nn.Module) -> None:
    if uses_fsdp1(model):
        raise ValueError(
            "VarianceMonitor: FullyShardedDataParallel (FSDP1) flattens the weights it shards, so the monitor cannot "
            "read their filters; shard with torch.distributed.fsdp.fully_shard (FSDP2)"
        )


def local_rows(kernel: Tensor, ranks: Ranks) -> tuple[Tensor, int]:
    """The rows (output filters) of ``kernel`` that this rank contributes, as a plain tensor, and the global index
    of the first. A DTensor gives its local shard (none on a replica another rank contributes); a plain tensor on
    several ranks is a replica (DDP) that the first rank contributes; on one process, every row.

    Example:
        >>> rows, offset = local_rows(torch.ones(4, 3), Ranks())
        >>> tuple(rows.shape), offset
        ((4, 3), 0)
    """
    if is_dtensor(kernel):
        check_filter_placements(kernel, "local_rows")
        local = kernel.to_local()
        span = _owned_rows(kernel)
        if span is None:
            return local[:0], 0
        if local.shape[0] != span[1] - span[0]:
            raise ValueError(
                f"local_rows: the DTensor placed {_placements(kernel)} holds {local.shape[0]} rows on this rank, "
                f"expected {span[1] - span[0]} (torch.chunk's layout): an uneven sharding the monitor cannot place"
            )
        return local, span[0]
    if ranks.size > 1 and ranks.rank != 0:
        return kernel[:0], 0
    return kernel, 0


def owned_square_sum(t: Tensor) -> Tensor:
    """The sum of ``t^2`` over the entries of the DTensor ``t`` that this rank contributes: its local entries (any
    ``Shard``), none on a replica that another rank (coordinate 0 of a ``Replicate`` mesh dim) contributes. Summed
    over the ranks, it is the squared norm of the whole tensor, each entry counted once."""
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"owned_square_sum: a DTensor placed {_placements(t)} (Partial) has no local entries")
    coord = t.device_mesh.get_coordinate()
    local = t.to_local().detach().float()
    owned = all(not p.is_replicate() or coord[i] == 0 for i, p in enumerate(t.placements))
    return local.square().sum() if owned else local.new_zeros(())


class Reduction:
    """Each rank's values of one step, merged across :class:`Ranks` in ONE ``all_reduce`` (a sum) by :meth:`run`.

    Register values with :meth:`moments`, :meth:`weighted` and :meth:`rows` (each returns a handle), call
    :meth:`run` once, then read the merged values with :meth:`get`. Every rank must register the same parts in the
    same order with the same sizes (a part a rank lacks is passed as None: it counts as zero there). On one process
    nothing is communicated and :meth:`get` returns each part as it was given (counts as Python ints).

    Args:
        ranks: the ranks to merge over.
        device: where the reduction buffer lives when no part is a tensor on this rank.

    Example:
        >>> red = Reduction(Ranks())
        >>> h = red.weighted((4, torch.tensor([1.0, 2.0])), size=2)
        >>> red.run()
        >>> red.get(h)
        (tensor([1., 2.]), 4)
    """

    def __init__(self, ranks: Ranks, device: torch.device | str | None = None) -> None:
        self.ranks = ranks
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._parts: list[tuple[str, object, int]] = []  # (kind, payload, size)
        self._out: list = []

    def moments(self, part: tuple[int, Tensor, Tensor] | None) -> int:
        """``(count, mean, M2)`` of one quantity on this rank (None: no entries here); :meth:`get` gives the merged
        ``(count, mean, M2)`` (:func:`~normlab.monitor.stats.merge_moments`)."""
        self._parts.append(("moments", part, 3))
        return len(self._parts) - 1

    def weighted(self, part: tuple[int, Tensor] | None, size: int) -> int:
        """``(count, values)``: ``size`` means over ``count`` entries each on this rank (None, or values of another
        size: none here); :meth:`get` gives ``(sum_r count_r values_r / sum_r count_r, sum_r count_r)``."""
        if part is not None and self.ranks.size > 1 and part[1].numel() != size:
            part = None
        self._parts.append(("weighted", part, size + 1))
        return len(self._parts) - 1

    def rows(self, values: Tensor, offset: int, total: int) -> int:
        """Per-row values of rows ``[offset, offset + len(values))`` of ``total``, each row on exactly one rank;
        :meth:`get` gives the (total,) vector of every rank's rows."""
        self._parts.append(("rows", (values, offset), total))
        return len(self._parts) - 1

    def run(self) -> None:
        """Merge the registered parts: one ``all_reduce`` on several ranks, nothing on one."""
        if self.ranks.size == 1 or not self._parts:
            self._out = [self._single(kind, payload) for kind, payload, _ in self._parts]
            return
        slots = sum(size for kind, _, size in self._parts if kind == "moments")
        rest = sum(size for kind, _, size in self._parts if kind != "moments")
        buf = torch.zeros(self.ranks.size * slots + rest, dtype=torch.float64, device=self._buffer_device())
        self._fill(buf, slots)
        dist.all_reduce(buf, group=self.ranks.group)
        self._out = self._split(buf, slots)

    def get(self, handle: int):
        """The merged value of a part (see :meth:`moments`, :meth:`weighted`, :meth:`rows`)."""
        return self._out[handle]

    @staticmethod
    def _single(kind: str, payload):
        if kind == "rows":
            return payload[0]
        if payload is None:
            return (0, None, None) if kind == "moments" else (None, 0)
        return payload if kind == "moments" else (payload[1], payload[0])

    def _buffer_device(self) -> torch.device:
        for kind, payload, _ in self._parts:
            if payload is not None:
                return (payload[0] if kind == "rows" else payload[1]).device
        return self.device

    def _fill(self, buf: Tensor, slots: int) -> None:
        """This rank's parts into the buffer: moments in its own slot, the others at their fixed offsets."""
        own, at = self.ranks.rank * slots, self.ranks.size * slots
        for kind, payload, size in self._parts:
            if kind == "moments":
                if payload is not None:
                    count, mean, m2 = payload
                    buf[own] = count
                    buf[own + 1 : own + 3] = torch.stack([mean, m2])
                own += 3
                continue
            if kind == "weighted" and payload is not None:
                count, values = payload
                buf[at : at + size - 1] = values.reshape(-1).to(buf.dtype) * count
                buf[at + size - 1] = count
            elif kind == "rows":
                values, offset = payload
                buf[at + offset : at + offset + values.numel()] = values
            at += size

    def _split(self, buf: Tensor, slots: int) -> list:
        """The merged parts from the reduced buffer (the moments of every part merged at once)."""
        gathered = buf[: self.ranks.size * slots].reshape(self.ranks.size, -1, 3)
        count, mean, m2 = merge_moments(gathered[..., 0], gathered[..., 1], gathered[..., 2])
        out, moment, at = [], 0, self.ranks.size * slots
        for kind, _, size in self._parts:
            if kind == "moments":
                out.append((count[moment], mean[moment], m2[moment]))
                moment += 1
                continue
            chunk = buf[at : at + size]
            out.append((chunk[:-1] / chunk[-1], chunk[-1]) if kind == "weighted" else chunk)
            at += size
        return out
