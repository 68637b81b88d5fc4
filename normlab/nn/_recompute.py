"""What an activation-checkpoint recomputation of a BatchRenorm training forward needs: that forward's prior.

A BatchRenorm training output depends on the layer's state: r and d come from the running statistics before the
batch and from the limits at ``num_batches_tracked``, both of which the forward then advances. ``torch.utils
.checkpoint`` runs a region's forward again inside the backward pass (non-reentrant: in the unpack hook of a saved
tensor, possibly stopping early; reentrant: in ``CheckpointFunction.backward``), on tensors that are new objects
for every layer but the first. So the recomputation must be told which genuine forward it repeats, without a host
read, and must use that forward's prior and limits and update nothing.

What the recomputation does reproduce is the values of the layer's input (deterministic ops, RNG restored). Each
training forward inside a checkpointed region (grad disabled, a saved-tensor hook active, or inside a backward pass)
therefore keeps a record of its *fingerprint* (a fixed sample of 32 input values, in float64), its prior (the
running statistics it renormalized against) and its limits, in a per-layer table of 32 rows on the device. A
forward inside a backward pass (a recomputation) picks the record with its fingerprint, with tensor ops only
(compare, select with ``where``; no host read), and the layer computes the step with that prior and limits and
leaves the running statistics and the step counter alone. A genuine forward and its recomputation run the same ops
(the host flags become values): selective activation checkpointing replays a region op by op.

The same input twice: records with one fingerprint are numbered in the order a forward made them (``dup``), and
the k-th recomputation with that fingerprint in one *episode* (one recomputation of a region: one graph task, one
autograd node, one saved-tensor hook) takes the newest record numbered k; a record belongs to the genuine episode
that wrote it (one checkpoint region's forward). So a layer called several times on equal inputs in one region,
a second backward with ``retain_graph``, nested checkpoints (a region recomputed once for its parent and once for
itself) and an input fed again in a later step all find their own record. What stays ambiguous: one layer fed
equal values in two different *reentrant* regions before one backward (nothing tells those regions apart).

A recomputation that finds no record (more than 32 forwards of the layer between a forward and its backward,
nondeterministic ops, a training forward run inside a backward pass for another reason) renormalizes against the
current running statistics, updates nothing and is counted on the device; :func:`report_misses` turns the count
into a ``RuntimeWarning`` (``.eval()`` and :func:`normlab.nn.skipped_batches` call it).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._dispatch import channels_last_format

__all__ = ["Recorded", "checkpoint_region", "recorded_prior", "report_misses"]

CAPACITY = 32  # records per layer (rows of its table)
SAMPLES = 32  # input values in a fingerprint
_LIMITS = slice(SAMPLES, SAMPLES + 2)  # then one column each: the row's number, its duplicate number, its genuine
_SEQ, _DUP, _EPISODE, _USED = SAMPLES + 2, SAMPLES + 3, SAMPLES + 4, SAMPLES + 5  # episode, the replay that used it
_PRIOR = SAMPLES + 6  # then running_mean (C), running_var (C)

_TABLES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # running_mean buffer -> _Records (dies with the buffer)


def checkpoint_region() -> tuple | None:
    """None for a plain training forward (the common case: three C calls), else the key of the episode it belongs
    to: ``(graph task id, saved-tensor pack hook or None, autograd node sequence number or None)``. A forward is
    in a checkpointed region when grad is disabled (a reentrant checkpoint's forward), a saved-tensor hook is active
    (a non-reentrant checkpoint's forward or recomputation) or a backward pass runs (a recomputation). Never under
    torch.compile, torch.jit.trace, torch.func transforms or inference mode (no records there)."""
    if torch.compiler.is_compiling():
        return None
    gid = torch._C._current_graph_task_id()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if gid == -1 and hooks is None and torch.is_grad_enabled():
        return None
    if torch.jit.is_tracing() or torch._C._are_functorch_transforms_active() or torch.is_inference_mode_enabled():
        return None
    node = torch._C._current_autograd_node() if gid != -1 else None
    return gid, None if hooks is None else hooks[0], None if node is None else node._sequence_nr()


def _fingerprint(x: Tensor) -> Tensor:
    """``SAMPLES`` values of ``x`` evenly spaced in memory, as float64 (NaN/inf made finite so that a non-finite
    batch still matches its recomputation). No copy of ``x`` when it is dense (any memory format)."""
    x = x.detach()
    n = x.numel()
    dense = x.is_contiguous() or channels_last_format(x) is not None
    flat = x.as_strided((n,), (1,), x.storage_offset()) if dense else x.reshape(-1)
    sample = torch.nan_to_num(flat[:: max(n // SAMPLES, 1)][:SAMPLES].double(), 0.0, 1e300, -1e300)  # a copy
    if sample.numel() < SAMPLES:
        sample = torch.cat([sample, sample.new_zeros(SAMPLES - sample.numel())])
    return sample


def _tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference of two fingerprints of one input: 0 for a deterministic recomputation;
    32 units of the input dtype's rounding for nondeterministic ops (two different batches differ by O(1))."""
    return 32 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


class _Records:
    """One layer's record table: rows ``[fingerprint (SAMPLES) | rmax, dmax | seq, dup, episode, used | prior mean
    (C) | prior var (C)]`` in float64 on the buffers' device (``seq`` -1: an empty row), a device count of misses,
    and the host's bookkeeping (the next row, the current episodes)."""

    def __init__(self, running_mean: Tensor) -> None:
        c = running_mean.numel()
        self.table = torch.zeros(CAPACITY, _PRIOR + 2 * c, dtype=torch.float64, device=running_mean.device)
        self.table[:, _SEQ] = -1
        self.misses = torch.zeros((), dtype=torch.long, device=running_mean.device)
        self.reported = 0
        self.written = 0  # rows written so far (the next one: written % CAPACITY)
        self.genuine = self.replay = 0  # the current genuine / recomputation episode numbers
        self.last: tuple = ("none",)  # the key of the last episode, with the pack hook as a weak reference

    def episode(self, region: tuple) -> tuple[bool, int]:
        """``(recomputing, episode number)`` of a forward in ``region`` (see :func:`checkpoint_region`)."""
        gid, hook, node = region
        kind = "genuine" if gid == -1 else "replay"
        last_kind, last_gid, last_hook, last_node = self.last + (None,) * (4 - len(self.last))
        same = kind == last_kind and gid == last_gid and node == last_node
        same = same and (hook is None if last_hook is None else last_hook() is hook)
        if not same:
            if kind == "genuine":
                self.genuine += 1
            else:
                self.replay += 1
        self.last = (kind, gid, None if hook is None else weakref.ref(hook), node)
        return kind == "replay", self.replay if kind == "replay" else self.genuine


class Recorded:
    """One step's use of the records (what :func:`recorded_prior` found), written back by :meth:`write`."""

    def __init__(self, records: _Records, row: Tensor, hit: Tensor, slot: Tensor, replay: bool, episode: int):
        self.records, self.row, self.hit, self.slot = records, row, hit, slot
        self.replay, self.episode = replay, episode

    @torch.no_grad()
    def write(self) -> None:
        """Append the step's row (a genuine forward) or mark its record used (a recomputation that found one):
        the same ops either way, the choice is in the values."""
        records, table = self.records, self.records.table
        k = records.written % CAPACITY
        keep = self.hit | self.replay  # a recomputation appends nothing
        table[k] = torch.where(keep, table[k], self.row)
        used = table[:, _USED]
        mark = torch.arange(CAPACITY, device=table.device).eq(self.slot).logical_and_(self.hit)
        table[:, _USED] = torch.where(mark, float(self.episode), used)
        if not self.replay:
            records.written += 1


def _scalar(table: Tensor, value) -> Tensor:
    """``value`` (a number or a 0-dim tensor) as a float64 0-dim tensor on the table's device (a fill, no copy)."""
    if isinstance(value, Tensor):
        return value.to(torch.float64)
    return table.new_full((), float(value))


@torch.no_grad()
def recorded_prior(x: Tensor, running: tuple[Tensor, Tensor], limits: tuple, scheduled: bool, region: tuple):
    """``(prior, limits, recorded)`` of a training forward of a layer in a checkpointed ``region``: in a
    recomputation the prior (running mean and variance) and limits of the genuine forward it repeats, else
    ``running`` and ``limits`` themselves; ``recorded`` (a :class:`Recorded`) says whether it repeated one
    (``recorded.hit``, a 0-dim bool tensor: then nothing may be updated) and keeps the row to write. Limits from a
    schedule (``scheduled``) come back as tensors; constant limits stay numbers (the step's route depends on them)."""
    records = _TABLES.get(running[0])
    if records is None or records.table.shape[1] != _PRIOR + 2 * running[0].numel():
        records = _TABLES[running[0]] = _Records(running[0])
    replay, episode = records.episode(region)
    table = records.table
    fp = _fingerprint(x)
    scale = fp.abs().amax().mul_(_tolerance(x.dtype))
    match = (table[:, :SAMPLES] - fp).abs_().amax(1).le(scale).logical_and_(table[:, _SEQ].ge(0))
    seen = match.logical_and(table[:, _USED].eq(episode if replay else -2)).sum()  # used in this episode
    same = match.logical_and(table[:, _EPISODE].eq(records.genuine)).sum()  # written in this genuine episode
    candidates = match.logical_and_(table[:, _DUP].eq(seen)) & replay
    newest = torch.where(candidates, table[:, _SEQ], -1.0)
    slot = newest.argmax()
    hit = newest.amax().ge(0)
    row = table[slot]
    c = running[0].numel()
    mean = torch.where(hit, row[_PRIOR : _PRIOR + c].to(running[0].dtype), running[0])
    var = torch.where(hit, row[_PRIOR + c :].to(running[1].dtype), running[1])
    head = torch.stack([_scalar(table, v) for v in (*limits, records.written)] + [same.double()])
    chosen = torch.where(hit, row[_LIMITS], head[:2])
    if scheduled:
        limits = tuple(chosen.unbind())
    records.misses.add_(hit.logical_not() & replay)
    tail = torch.stack([_scalar(table, records.genuine), _scalar(table, -2.0)])
    new_row = torch.cat([fp, head, tail, mean.double(), var.double()])
    return (mean, var), limits, Recorded(records, new_row, hit, slot, replay, episode)


def report_misses(running_mean: Tensor | None, where: str) -> None:
    """Warn (one ``RuntimeWarning``, one host read) about the recomputations of the layer with this running mean that
    found no record since the last report."""
    records = None if running_mean is None else _TABLES.get(running_mean)
    if records is None:
        return
    count = int(records.misses)
    if count > records.reported:
        warnings.warn(
            f"{where}: {count - records.reported} activation-checkpoint recomputation(s) found no record of the "
            f"training forward they repeat (more than {CAPACITY} training forwards of the layer between a forward "
            "and its backward, nondeterministic ops in the checkpointed region, or a training forward run inside a "
            "backward pass): they renormalized against the running statistics of that moment and updated nothing",
            RuntimeWarning,
            stacklevel=4,
        )
    records.reported = count
