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
(the host flags become values; a recomputation writes its row into a spare row): selective activation checkpointing
replays a region op by op. The records hang on the layer's ``running_mean`` buffer (a weak key): ``.to()``,
``deepcopy`` and pickling start without them, and a ``torch.fx`` graph sharing the buffers shares them.

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

CAPACITY = 32  # records per layer
SAMPLES = 32  # input values in a fingerprint

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
    n = x.numel()
    if n >= SAMPLES and (x.is_contiguous() or channels_last_format(x) is not None):
        sample = x.as_strided((SAMPLES,), (n // SAMPLES,), x.storage_offset())
    else:  # a view with gaps, or fewer values than samples (repeated)
        sample = x.reshape(-1)[torch.arange(SAMPLES, device=x.device) % n]
    return torch.nan_to_num(sample.double(), 0.0, 1e300, -1e300)  # a copy, also of a float64 x


def _tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference of two fingerprints of one input: 0 for a deterministic recomputation;
    32 units of the input dtype's rounding for nondeterministic ops (two different batches differ by O(1))."""
    return 32 * torch.finfo(dtype).eps


class _Records:
    """One layer's records on the buffers' device: fingerprints (NaN: an empty row), priors (running mean and
    variance), limits, and per row its number, duplicate number, genuine episode and the replay episode that used it;
    one more row than ``CAPACITY`` takes a recomputation's writes (the same ops as a genuine forward's, discarded).
    Also a device count of misses and the host's bookkeeping (rows written, the current episodes)."""

    def __init__(self, running_mean: Tensor) -> None:
        c, device = running_mean.numel(), running_mean.device
        self.keys = torch.full((CAPACITY + 1, SAMPLES), float("nan"), dtype=torch.float64, device=device)
        self.priors = torch.zeros(CAPACITY + 1, 2, c, dtype=running_mean.dtype, device=device)
        self.limits = torch.zeros(CAPACITY + 1, 2, dtype=torch.float64, device=device)
        self.meta = torch.full((CAPACITY + 1, 4), -2.0, dtype=torch.float64, device=device)  # seq, dup, genuine, used
        self.rows = torch.arange(CAPACITY + 1, device=device)
        self.misses = torch.zeros((), dtype=torch.long, device=device)
        self.reported = 0
        self.written = 0  # rows written so far (the next one: written % CAPACITY)
        self.genuine = self.replay = 0  # the current genuine / recomputation episode numbers
        self.last: tuple = ("none", None, None, None)  # the last episode's key, the pack hook as a weak reference

    def episode(self, region: tuple) -> bool:
        """Whether a forward in ``region`` (see :func:`checkpoint_region`) is a recomputation; counts episodes."""
        gid, hook, node = region
        kind = "genuine" if gid == -1 else "replay"
        last_kind, last_gid, last_hook, last_node = self.last
        same = kind == last_kind and gid == last_gid and node == last_node
        if not same or (hook is not None if last_hook is None else last_hook() is not hook):
            if kind == "genuine":
                self.genuine += 1
            else:
                self.replay += 1
        self.last = (kind, gid, None if hook is None else weakref.ref(hook), node)
        return kind == "replay"


class Recorded:
    """One step's use of the records (what :func:`recorded_prior` found), written back by :meth:`write`."""

    def __init__(self, records: _Records, replay: bool, hit: Tensor, slot: Tensor, row: tuple):
        self.records, self.replay, self.hit, self.slot, self.row = records, replay, hit, slot, row

    @torch.no_grad()
    def write(self) -> None:
        """A genuine forward appends its row; a recomputation writes it into the spare row and marks the record it
        used: the same ops either way (selective checkpointing replays a region op by op)."""
        records = self.records
        k = CAPACITY if self.replay else records.written % CAPACITY
        fp, prior, limits, dup = self.row
        records.keys[k].copy_(fp)
        records.priors[k].copy_(prior)
        if limits is not None:
            records.limits[k].copy_(limits)
        seq, genuine = float(records.written), float(records.genuine)
        records.meta[k].copy_(
            torch.stack([dup.new_full((), seq), dup, dup.new_full((), genuine), dup.new_full((), -2.0)])
        )
        mark = records.rows.eq(self.slot).logical_and_(self.hit)
        records.meta[:, 3].masked_fill_(mark, float(records.replay))
        if not self.replay:
            records.written += 1


@torch.no_grad()
def recorded_prior(x: Tensor, running: tuple[Tensor, Tensor], limits: tuple, region: tuple):
    """``(prior, limits, recorded)`` of a training forward of a layer in a checkpointed ``region``: in a
    recomputation the prior (running mean and variance) and limits of the genuine forward it repeats, else
    ``running`` and ``limits`` themselves; ``recorded`` (a :class:`Recorded`) says whether it repeated one
    (``recorded.hit``, a 0-dim bool tensor: then nothing may be updated) and keeps the row to write. Limits that are
    tensors (a schedule's) come back as tensors; numbers (constant limits, the same in every forward, and the
    BatchNorm limits of a re-estimation) stay numbers: the step's route depends on them."""
    records = _TABLES.get(running[0])
    if records is None or records.priors.shape[2] != running[0].numel():
        records = _TABLES[running[0]] = _Records(running[0])
    replay = records.episode(region)
    fp = _fingerprint(x)
    scale = fp.abs().amax().mul_(_tolerance(x.dtype))
    match = (records.keys[:CAPACITY] - fp).abs_().amax(1).le(scale)  # NaN rows (empty) never match
    seq, dup, genuine, used = records.meta[:CAPACITY].unbind(1)
    seen = used.eq(records.replay if replay else -3).logical_and_(match).sum()  # used in this replay episode
    same = genuine.eq(records.genuine).logical_and_(match).sum()  # written in this genuine episode
    candidates = dup.eq(seen).logical_and_(match) & replay
    slot = torch.where(candidates, seq, -1.0).argmax().view(1)  # the newest candidate
    hit = candidates.any()
    prior = torch.where(hit, records.priors.index_select(0, slot)[0], torch.stack(running))
    records.misses.add_(hit.logical_not() & replay)
    kept = None
    if any(isinstance(v, Tensor) for v in limits):
        now = torch.stack([v.double() if isinstance(v, Tensor) else fp.new_full((), v) for v in limits])
        kept = torch.where(hit, records.limits.index_select(0, slot)[0], now)
        limits = tuple(kept.unbind())
    mean, var = prior.unbind()
    return (mean, var), limits, Recorded(records, replay, hit, slot, (fp, prior, kept, same.double()))


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
