"""Non-finite values in a layer: the count of skipped batches and its warning, and a non-finite stored state named.

A normalization layer with running statistics never lets a non-finite training batch into them (``docs/design.md``,
"Non-finite batches"). Whether a batch was finite is a device value; reading it in the step would make the host wait
for the device. So each layer counts the batches it skipped in a device-side buffer, ``skipped_batches`` (0-dim
int64, non-persistent: the ``state_dict`` keys stay torch's), updated with tensor ops only, and the count becomes a
``RuntimeWarning`` later, at a point where a read costs nothing per step: when the layer leaves training mode
(``.eval()`` / ``.train(False)``) or when :func:`skipped_batches` reads a model's counts. Each skipped batch is
reported once.

A stored state can be non-finite too (a checkpoint saved after a run diverged): every output that reads it is then
NaN, whatever the input. :class:`FiniteState`, a base of every normlab layer with parameters or buffers, names such a
state where it comes in, at ``load_state_dict`` (one host read per layer there, none in a step), in one
``RuntimeWarning`` line: the layer's class, its name in the loaded model and each non-finite tensor. A sharded
parameter (a DTensor: FSDP2's ``fully_shard``) is checked on the rank's own shard, without a collective: the rank
that holds a non-finite value names it. When batches were
skipped because of the stored state, the skipped-batch warning says so instead of blaming the input.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from .._dispatch import count_into

__all__ = ["FiniteState", "SkippedBatches", "skipped_batches"]


class FiniteState:
    """Mixin of normlab's layers with a state: a loaded parameter or buffer with NaN/inf values is named at load.

    After ``load_state_dict`` has loaded this layer's own tensors, the floating-point ones it loaded (parameters and
    persistent buffers: running statistics, ``weight``, ``bias``, ``alpha``, ...) are checked with one host read, and
    non-finite ones are named in one ``RuntimeWarning``: ``BatchRenorm2d 'layer1.0.bn1': the loaded state is not
    finite: running_var (2 of 64 values NaN/inf) ...``. Loading goes on (a diverged checkpoint can still be
    inspected, or its running statistics reset); nothing is read back in a training or eval step.
    """

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._state_name = prefix[:-1]  # the layer's name in the model being loaded ("" for the root)
        bad = self._non_finite_state({name for name in self._floating_state() if prefix + name in state_dict})
        if bad:
            warnings.warn(
                f"{self._layer_name()}: the loaded state is not finite: {bad}; outputs computed from it are NaN, "
                f"inf or meaningless (load a finite state, or reset it: reset_running_stats() / reset_parameters())",
                RuntimeWarning,
                stacklevel=2,
            )

    def _floating_state(self) -> dict[str, Tensor]:
        """This layer's own floating-point parameters and persistent buffers (not its children's), by name."""
        own = [(n, p) for n, p in self._parameters.items() if p is not None]
        skip = self._non_persistent_buffers_set
        own += [(n, b) for n, b in self._buffers.items() if b is not None and n not in skip]
        return {n: t for n, t in own if t.is_floating_point() or t.is_complex()}

    def _non_finite_state(self, names=None) -> str:
        """``"running_var (2 of 64 values NaN/inf), ..."`` for the non-finite tensors among ``names`` (default: all
        of :meth:`_floating_state`), ``""`` if none: one host read per device. Meta and fake tensors (no values),
        compiled and transformed code are skipped."""
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return ""
        tensors = [
            (n, t)
            for n, t in self._floating_state().items()
            if (names is None or n in names) and t.device.type != "meta" and not is_fake(t)
        ]
        by_device: dict = {}
        for n, t in tensors:
            by_device.setdefault(t.device, []).append((n, t))
        parts = []
        with torch.no_grad():
            for group in by_device.values():
                local = [(n, _local_shard(t)) for n, t in group]
                counts = torch.stack([t.detach().isfinite().logical_not().sum() for _, t in local]).tolist()
                for (n, t), (_, own), k in zip(group, local, counts):
                    shard = " in this rank's shard" if own is not t else ""
                    parts += [f"{n} ({k} of {own.numel()} values NaN/inf{shard})"] if k else []
        return ", ".join(parts)

    def _layer_name(self, name: str | None = None) -> str:
        """``Class 'name'`` (the name given, else the one from the last load), or the class alone."""
        name = self.__dict__.get("_state_name") if name is None else name
        cls = _own_class(self).__name__
        return f"{cls} {name!r}" if name else cls


def _own_class(module: nn.Module) -> type:
    """The layer's own class, also under FSDP2, which swaps the class of a module it shards for ``FSDP<name>``."""
    cls = type(module)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            return next((c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)), cls)
    return cls


def _local_shard(t: Tensor) -> Tensor:
    """A DTensor's local tensor (under FSDP2 this rank's shard: read without a collective), any other tensor as is."""
    if not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class SkippedBatches(FiniteState):
    """Mixin of the layers with running statistics: the ``skipped_batches`` buffer and its deferred warning.

    Subclasses call :meth:`_init_skipped` in ``__init__`` and :meth:`_count_skipped` with the step's ``finite``
    flag (a 0-dim bool tensor) in every training step that would update the running statistics.
    """

    def _init_skipped(self, device=None) -> None:
        self.register_buffer("skipped_batches", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self._reported_skips = 0

    def _reset_skipped(self) -> None:
        """Zero the count (``reset_running_stats``; also after ``to_empty``, where the buffer holds garbage)."""
        buf = self.__dict__.get("_buffers", {}).get("skipped_batches")
        if buf is not None:
            buf.zero_()
            self._reported_skips = 0

    def _count_skipped(self, finite: Tensor) -> None:
        """``skipped_batches += not finite`` (tensor ops; under torch.func the write leaves the transforms)."""
        count_into(self.skipped_batches, ~finite)

    def train(self, mode: bool = True):
        """Set training mode (``nn.Module.train``); leaving it reports the batches skipped since the last report as
        one ``RuntimeWarning`` (one host read of ``skipped_batches``, see :func:`skipped_batches`)."""
        if not mode and self.training:
            self._report_skipped()
        return super().train(mode)

    def _report_skipped(self, name: str | None = None) -> int:
        """Read the count (one host read), warn about the batches not reported yet, return the count. The warning
        names the layer (``name``, or its name from the last load) and, when its stored running statistics are not
        finite (an update from them is never finite, whatever the input), names them instead of the input."""
        buf = self._buffers.get("skipped_batches")
        if buf is None or buf.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(buf):
            return 0
        count = int(buf.sum())  # a batched (ensembled) buffer: the members' total
        reported = getattr(self, "_reported_skips", 0)
        if count > reported:
            state = self._non_finite_state({"running_mean", "running_var"})
            if state:
                what = (
                    f"were skipped because the layer's stored state is not finite ({state}), not because of the "
                    f"input (reset it with reset_running_stats() or load a finite state)"
                )
            else:
                what = (
                    "with non-finite batch statistics (NaN/inf in the input, or a variance that overflows) were skipped"
                )
            warnings.warn(
                f"{self._layer_name(name)}: {count - reported} training batch(es) {what}: the running statistics "
                f"(and num_batches_tracked) were left unchanged for them ({count} in all, see skipped_batches)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._reported_skips = count
        return count


def skipped_batches(model: nn.Module) -> dict[str, int]:
    """Count of skipped non-finite training batches per normalization layer of ``model``, by module name.

    Every normlab layer with running statistics (BatchRenorm, SyncBatchRenorm, SwitchableNorm, InstanceNorm with
    ``track_running_stats``) skips a training batch whose statistics are not finite: its running statistics and
    ``num_batches_tracked`` stay unchanged, and the layer's ``skipped_batches`` buffer (on the device, no host
    synchronisation in the step) counts it. This function reads the counts (one host read per layer) and emits one
    ``RuntimeWarning`` per layer for the batches not reported before; ``model.eval()`` does the same.

    Args:
        model: any module; the layers without a ``skipped_batches`` count are left out.

    Returns:
        ``{name: count}`` for every layer that counts skipped batches (``""`` for ``model`` itself).

    Example:
        >>> from normlab.nn import BatchRenorm1d
        >>> layer = BatchRenorm1d(2)
        >>> _ = layer(torch.tensor([[1.0, float("nan")], [2.0, 0.0]]))   # no warning, no host read here
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     counts = skipped_batches(layer)
        >>> counts, len(caught)
        ({'': 1}, 1)
    """
    return {
        name: m._report_skipped(name)
        for name, m in model.named_modules()
        if isinstance(m, SkippedBatches) and m._buffers.get("skipped_batches") is not None
    }
