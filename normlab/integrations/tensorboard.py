"""TensorBoard for the variance monitor: per-layer scalars grouped as the paper's figures, histograms, the alarm.

``mon.add_sink(MonitorBoard("runs/tb"))`` (or ``MonitorBoard(writer)`` for a ``SummaryWriter``) writes, on every
recorded step of the :class:`~normlab.monitor.VarianceMonitor` ``mon``:

========================  ==========================================================  ===============
tag                       value (one curve per layer; the layer's module name)         paper
========================  ==========================================================  ===============
``output_var/<layer>``    Var[Y_l] of the layer's output                                Fig. 1a (left)
``shift/<layer>``         the shift of the average Var_o[n mean(W_o)]                    Fig. 1b (right)
``shift_scale_free/..``   shift / (n Var[W]) (about 1 at random init, 0 for WS/PWS)
``update_ratio/<layer>``  Var[W_o - dW_o] / Var[W_o], mean over filters                 Fig. 1a
``input_ratio/<layer>``   E^2[X] / E[X^2] of the layer's input                          Fig. 6b
``mean_update/<layer>``   histogram of the per-filter mean updates mean(dW_o)            Fig. 1b
``alarm``, ``warning``    text: the monitor's events (rule, step, message)
========================  ==========================================================  ===============

TensorBoard shows each tag prefix as one section; a Custom Scalars layout (``normlab: the paper's figures``)
draws each quantity for every layer in one chart. :meth:`MonitorBoard.write_scalars` adds the run's own values
(``normlab train --tensorboard DIR`` writes ``run/train_loss``, ``run/test_acc``, ``run/lr``, ...). Steps are the
monitor's optimizer steps. The event files are written by TensorBoard's own writer (an append-only stream, not
through normlab's atomic writer); needs ``pip install 'normlab[tensorboard]'``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from normlab._checks import is_number
from normlab.monitor.records import LayerRecord, NormRecord, layer_keys

__all__ = ["MonitorBoard", "SCALARS", "summary_writer", "scalar_tags"]

#: The scalars written per layer, as monitor record key -> (tag section, chart title of the Custom Scalars
#: layout). A layer's scalar is tagged ``<section>/<layer>``.
SCALARS = {
    "output_var": ("output_var", "Var[Y] of each layer's output"),
    "shift": ("shift", "Fig. 1b: shift of the average, Var_o[n mean(W_o)]"),
    "shift_scale_free": ("shift_scale_free", "shift / (n Var[W])"),
    "update_ratio_mean": ("update_ratio", "Fig. 1a: update ratio Var[W - dW] / Var[W]"),
    "input_ratio": ("input_ratio", "Fig. 6b: input ratio E^2[X] / E[X^2]"),
}
layer_keys(*SCALARS)  # the keys of normlab.monitor.records
#: The title of the Custom Scalars layout that groups the charts of :data:`SCALARS`.
LAYOUT_TITLE = "normlab: the paper's figures"


def summary_writer(log_dir: str | os.PathLike, **kwargs):
    """``torch.utils.tensorboard.SummaryWriter(log_dir, **kwargs)``; a one-line ImportError without TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ModuleNotFoundError(
            "TensorBoard is not installed: pip install 'normlab[tensorboard]'", name="tensorboard"
        ) from None
    return SummaryWriter(str(log_dir), **kwargs)


def _layer(name: str) -> str:
    return name or "model"


def scalar_tags(record: LayerRecord | NormRecord | Mapping[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of the :data:`SCALARS` a monitor record (:mod:`normlab.monitor.records`) holds (finite values
    only)."""
    out = {}
    for key, (section, _) in SCALARS.items():
        value = record.get(key)
        if is_number(value, finite=True):
            out[f"{section}/{_layer(record['layer'])}"] = float(value)
    return out


class MonitorBoard:
    """Writes :class:`~normlab.monitor.VarianceMonitor` records to TensorBoard.

    Args:
        target: a log directory (a ``SummaryWriter`` is created there and closed by :meth:`close`) or a writer
            with ``add_scalar``/``add_histogram``/``add_text`` (``SummaryWriter``, tensorboardX), left open.
        **writer_kwargs: ``SummaryWriter`` arguments for a directory (e.g. ``purge_step`` when resuming).

    A sink of the monitor: ``mon.add_sink(MonitorBoard(log_dir))`` (the monitor's :meth:`close` closes it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as log_dir:
        ...     board = MonitorBoard(log_dir)
        ...     board.write_records([{"step": 0, "layer": "conv1", "output_var": 1.2, "shift": 0.01}])
        ...     board.close()
        >>> scalar_tags({"step": 0, "layer": "conv1", "output_var": 1.2, "shift": 0.01})   # the tags written
        {'output_var/conv1': 1.2, 'shift/conv1': 0.01}
    """

    def __init__(self, target: Any, **writer_kwargs) -> None:
        if isinstance(target, (str, os.PathLike)):
            self.writer, self.owned = summary_writer(target, **writer_kwargs), True
        elif all(hasattr(target, m) for m in ("add_scalar", "add_histogram", "add_text")):
            self.writer, self.owned = target, False
        else:
            raise TypeError(f"tensorboard must be a log directory or a SummaryWriter, got {type(target).__name__}")
        self._layout = False

    def _write_layout(self) -> None:
        if self._layout or not hasattr(self.writer, "add_custom_scalars"):
            return
        charts = {title: ["Multiline", [f"^{section}/"]] for section, title in SCALARS.values()}
        self.writer.add_custom_scalars({LAYOUT_TITLE: charts})
        self._layout = True

    def write_records(
        self, records: Iterable[LayerRecord | NormRecord], mean_updates: Mapping[str, Tensor] = ()
    ) -> None:
        """Scalars of ``records`` (one recorded step) and a histogram of each layer's per-filter mean updates."""
        self._write_layout()
        step = None
        for rec in records:
            step = rec["step"]
            for tag, value in scalar_tags(rec).items():
                self.writer.add_scalar(tag, value, step)
        for name, values in dict(mean_updates).items():
            if step is not None and values.numel() and bool(values.isfinite().all()):
                self.writer.add_histogram(f"mean_update/{_layer(name)}", values.detach().float().cpu(), step)

    def write_event(self, event) -> None:
        """A rule's :class:`~normlab.monitor.Event` as a text event at its step, under ``alarm`` or
        ``warning`` (its severity)."""
        self.writer.add_text(event.severity, str(event), event.step)

    def write_scalars(self, values: Mapping[str, float | None], step: int, section: str = "run") -> None:
        """``section/<key>`` for every finite value (the run's loss, accuracy, learning rate, ...)."""
        for key, value in values.items():
            if is_number(value, finite=True):
                self.writer.add_scalar(f"{section}/{key}", float(value), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this board created it."""
        self.writer.flush()
        if self.owned:
            self.writer.close()
