"""The non-finite policy's count of skipped batches and its warning, without a host synchronisation in a step.

A normalization layer with running statistics never lets a non-finite training batch into them (``docs/design.md``,
"Non-finite batches"). Whether a batch was finite is a device value; reading it in the step would make the host wait
for the device. So each layer counts the batches it skipped in a device-side buffer, ``skipped_batches`` (0-dim
int64, non-persistent: the ``state_dict`` keys stay torch's), updated with tensor ops only, and the count becomes a
``RuntimeWarning`` later, at a point where a read costs nothing per step: when the layer leaves training mode
(``.eval()`` / ``.train(False)``) or when :func:`skipped_batches` reads a model's counts. Each skipped batch is
reported once.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from .._dispatch import count_into

__all__ = ["SkippedBatches", "skipped_batches"]


class SkippedBatches:
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

    def _report_skipped(self) -> int:
        """Read the count (one host read), warn about the batches not reported yet, return the count."""
        buf = self._buffers.get("skipped_batches")
        if buf is None or buf.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(buf):
            return 0
        count = int(buf.sum())  # a batched (ensembled) buffer: the members' total
        reported = getattr(self, "_reported_skips", 0)
        if count > reported:
            warnings.warn(
                f"{type(self).__name__}: {count - reported} training batch(es) with non-finite batch statistics "
                f"(NaN/inf in the input, or a variance that overflows) were skipped: the running statistics (and "
                f"num_batches_tracked) were left unchanged for them ({count} in all, see skipped_batches)",
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
        name: m._report_skipped()
        for name, m in model.named_modules()
        if isinstance(m, SkippedBatches) and m._buffers.get("skipped_batches") is not None
    }
