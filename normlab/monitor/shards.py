"""Sharded state in :class:`~normlab.monitor.CollapseGuard`'s snapshots: each rank keeps its own shards only.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) the model's ``state_dict()`` and its optimizer's hold DTensors
whose local tensor on a rank is that rank's shard (``Shard(0)``: a block of rows) or a replica (``Replicate``). A
snapshot never gathers them: it keeps each DTensor in **local form**, a plain dict ::

    {"dtensor": {"placements": "(Shard(dim=0),)", "shape": [5, 3]}, "local": <this rank's local tensor>}

(:func:`local_form`), so a snapshot holds this rank's bytes only, and one on disk or in the guard's ``state_dict``
is plain tensors and values (``torch.load(weights_only=True)``). A rollback puts each shard back as a DTensor of the
live parameter's mesh and placements (:func:`rebuild_model_state`, :func:`rebuild_optimizer_state`:
``DTensor.from_local`` without a check, so nothing communicates) and the model and the optimizer load it as usual.
Nothing in this module communicates.

Every rank must keep and drop the same snapshots, so a size bound (``SnapshotOptions.max_bytes``) is judged on the
same number everywhere: :func:`largest_rank_bytes`, the bytes of the rank that keeps the most, computed from the
DTensors' placements (each rank knows every rank's shard shape) without a collective.

:func:`check_sharding` refuses, in one line, the sharding the guard does not support.

Example:
    >>> state = {"w": torch.ones(2, 3), "step": 4}
    >>> local_form(state) == state, largest_rank_bytes(state)  # no DTensor: unchanged; 6 float32 values
    (True, 24)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from normlab.monitor.ranks import is_dtensor, uses_fsdp1

__all__ = [
    "map_tensors",
    "local_form",
    "is_local_shard",
    "rebuild_model_state",
    "rebuild_optimizer_state",
    "largest_rank_bytes",
    "check_sharding",
]

_LEAVES = (int, float, bool, str, bytes, type(None))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (dicts, lists and tuples walked; other values kept).

    Example:
        >>> map_tensors({"a": torch.ones(2), "b": [1, torch.zeros(1)]}, lambda t: t.shape)
        {'a': torch.Size([2]), 'b': [1, torch.Size([1])]}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if all(isinstance(v, _LEAVES) for v in obj):  # Python's generator state: 625 ints
            return list(obj) if isinstance(obj, list) else obj
        out = [map_tensors(v, fn) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _placements(t) -> str:
    return str(tuple(t.placements))


def local_form(state: Any) -> Any:
    """``state`` with every DTensor in local form (module docstring): a view of this rank's local tensor, no copy.

    Example:
        >>> local_form([torch.zeros(2)])            # plain tensors stay as they are
        [tensor([0., 0.])]
    """

    def one(t: torch.Tensor):
        if not is_dtensor(t):
            return t
        return {"dtensor": {"placements": _placements(t), "shape": list(t.shape)}, "local": t.to_local()}

    return map_tensors(state, one)


def is_local_shard(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor in local form (:func:`local_form`).

    Example:
        >>> is_local_shard({"dtensor": {"placements": "(Shard(dim=0),)", "shape": [4]}, "local": torch.zeros(2)})
        True
    """
    return isinstance(obj, dict) and set(obj) == {"dtensor", "local"} and isinstance(obj["local"], torch.Tensor)


def _from_local(shard: dict, like, where: str):
    """The DTensor of ``like``'s mesh and placements whose local tensor is ``shard``'s (no communication)."""
    from torch.distributed.tensor import DTensor

    meta, local = shard["dtensor"], shard["local"]
    if not is_dtensor(like):
        raise ValueError(
            f"{where} is a shard of a DTensor placed {meta['placements']}, the model's is a plain tensor now: restore "
            "a snapshot on the sharding it was taken on"
        )
    theirs = (_placements(like), list(like.shape), tuple(like.to_local().shape))
    if (meta["placements"], list(meta["shape"]), tuple(local.shape)) != theirs:
        raise ValueError(
            f"{where} is the shard {tuple(local.shape)} of a DTensor {tuple(meta['shape'])} placed "
            f"{meta['placements']}, the model's is the shard {theirs[2]} of {tuple(theirs[1])} placed {theirs[0]}: "
            "restore a snapshot on the sharding (and number of ranks) it was taken on"
        )
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _refuse_full(value, like, where: str) -> None:
    if is_dtensor(like) and isinstance(value, torch.Tensor) and not is_dtensor(value):
        raise ValueError(
            f"{where} is a whole tensor but the model's is a DTensor placed {_placements(like)}: the snapshot was "
            "taken before fully_shard; make the guard after sharding the model"
        )


def rebuild_model_state(state: dict, model: nn.Module, where: str = "CollapseGuard") -> dict:
    """A model ``state_dict`` in local form as the model loads it: each shard a DTensor of the live parameter's
    (or buffer's) mesh and placements; refused in one line when the sharding differs.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> rebuild_model_state(model.state_dict(), model).keys()   # no DTensor: as it was
        odict_keys(['weight', 'bias'])
    """
    if not any(is_local_shard(v) for v in state.values()) and not any(is_dtensor(p) for p in model.parameters()):
        return state
    live = model.state_dict()
    out = type(state)()
    for key, value in state.items():
        name = f"{where}: the snapshot's {key!r}"
        if is_local_shard(value):
            value = _from_local(value, live.get(key), name)
        else:
            _refuse_full(value, live.get(key), name)
        out[key] = value
    return out


def rebuild_optimizer_state(state: dict, optimizer: torch.optim.Optimizer, where: str = "CollapseGuard") -> dict:
    """An optimizer ``state_dict`` in local form as the optimizer loads it: each per-parameter shard (Adam's moments)
    a DTensor of its parameter's mesh and placements (the parameters in ``state_dict``'s order).

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        >>> rebuild_optimizer_state(opt.state_dict(), opt)["param_groups"][0]["params"]
        [0, 1]
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(is_dtensor(p) for p in params):
        return state
    per_param = {}
    for index, entries in state.get("state", {}).items():
        param = params[int(index)]
        rebuilt = {}
        for name, value in entries.items():
            at = f"{where}: the snapshot's optimizer state {name!r} of parameter {index}"
            if is_local_shard(value):
                value = _from_local(value, param, at)
            elif isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                _refuse_full(value, param, at)
            rebuilt[name] = value
        per_param[index] = rebuilt
    return {**state, "state": per_param}


def _rank_numels(t) -> dict[int, int]:
    """The number of elements of the DTensor ``t`` that each rank of its mesh holds (``torch.chunk``'s layout of
    each ``Shard`` mesh dim, as DTensor and FSDP2 lay shards out; a replica holds the whole)."""
    ranks = t.device_mesh.mesh
    out = {}
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        shape = list(t.shape)
        for mesh_dim, p in enumerate(t.placements):
            if p.is_shard():
                d, n = p.dim, ranks.shape[mesh_dim]
                chunk = math.ceil(shape[d] / n)
                shape[d] = max(0, min(chunk, shape[d] - coord[mesh_dim] * chunk))
        out[int(ranks[coord])] = math.prod(shape)
    return out


def largest_rank_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (live: DTensors, not local form) on the rank that holds the most: a
    DTensor counts each rank's shard, a plain tensor counts on every rank. The same number on every rank, without a
    collective.

    Example:
        >>> largest_rank_bytes({"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64)]})
        32
    """
    plain, per_rank = 0, {}

    def count(t: torch.Tensor) -> None:
        nonlocal plain
        if not is_dtensor(t):
            plain += t.numel() * t.element_size()
            return
        for rank, numel in _rank_numels(t).items():
            per_rank[rank] = per_rank.get(rank, 0) + numel * t.element_size()

    map_tensors(state, count)
    return plain + max(per_rank.values(), default=0)


def check_sharding(model: nn.Module, params, where: str = "CollapseGuard") -> None:
    """Refuse, in one line, the sharding ``where`` does not support: FSDP1 (``FullyShardedDataParallel``), and a
    DTensor parameter placed otherwise than ``Shard(d)`` or ``Replicate`` (``_StridedShard``: FSDP2 over tensor
    parallelism; ``Partial``) or on a mesh of only some of the ranks (pipeline stages). Supported: FSDP2's
    ``fully_shard`` (with or without ``shard_placement_fn``), HSDP's ``(Replicate, Shard(0))``, tensor parallelism's
    ``Shard`` placements on a mesh of every rank, DDP, and a model on one process.

    Example:
        >>> check_sharding(nn.Linear(2, 1), [])                 # one process: nothing to refuse
    """
    if uses_fsdp1(model):
        raise ValueError(
            f"{where}: FullyShardedDataParallel (FSDP1) is not supported (its state_dict gathers the whole model by "
            "default); shard with torch.distributed.fsdp.fully_shard (FSDP2), whose state is each rank's own shards"
        )
    from torch.distributed.tensor import Replicate, Shard

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for p in params:
        if not is_dtensor(p):
            continue
        bad = next((q for q in p.placements if type(q) not in (Shard, Replicate)), None)
        if bad is not None:
            raise ValueError(
                f"{where}: a parameter is a DTensor placed {_placements(p)}; {bad!r} is not supported (FSDP2 over "
                "tensor parallelism, or a partial value): each rank's shard must be a Shard(dim) block or a replica"
            )
        if p.device_mesh.size() != world:
            raise ValueError(
                f"{where}: a parameter is a DTensor on a mesh of {p.device_mesh.size()} of the {world} ranks; the "
                "guard decides on every rank together, so every DTensor's mesh must span them all (pipeline stages "
                "are not supported)"
            )
