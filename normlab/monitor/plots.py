"""PNG plots of a VarianceMonitor log (matplotlib, Agg backend): the PWS paper's Figures 1a, 1b, 2, 6, the
output variance per layer and a signal propagation plot. One line per layer, labelled axes and legends; the log is
read by :func:`normlab.monitor.log.load_log` and drawn with :mod:`normlab.monitor.plotting`."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

from normlab.monitor.log import MonitorLog, load_log
from normlab.monitor.plotting import draw_series, layer_series, log_scale, mark_alarm, save_figure, spans_decades
from normlab.monitor.records import layer_keys

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["load_log", "render_monitor_plots"]  # load_log: normlab.monitor.log's, kept importable from here


def _panel(ax, records, key, ylabel, title, log=False, alarm=None, hline=None):
    series = layer_series(records, key)
    draw_series(ax, series)
    values = [v for _, vals in series.values() for v in vals]
    if log is True or (log == "decades" and spans_decades(values)):
        log_scale(ax, values)
    if hline is not None:
        ax.axhline(hline[0], color="k", linestyle=":", linewidth=1, label=hline[1])
    mark_alarm(ax, alarm, f"collapse warning ({alarm.get('layer')})" if alarm else None)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(title="layer", fontsize=7, title_fontsize=8, loc="best", ncol=2 if len(series) > 8 else 1)
    else:
        ax.text(0.5, 0.5, f"no '{key}' in log", ha="center", va="center", transform=ax.transAxes)
    return bool(series)


def _spp_figure(spp: dict, path: Path) -> Path:
    """The signal-propagation plot of ``spp`` (see :func:`~normlab.monitor.signal_propagation`) saved at ``path``."""
    entries = spp["entries"]
    x = list(range(len(entries)))
    fig, ax = plt.subplots(figsize=(max(7, 0.5 * len(entries)), 4.5))
    ax.plot(x, [e["avg_sq_mean"] for e in entries], "o-", label="average channel squared mean")
    ax.plot(x, [e["avg_var"] for e in entries], "s-", label="average channel variance")
    res = [(i, e["residual_var"]) for i, e in zip(x, entries) if e.get("residual_var") is not None]
    if res:
        ax.plot([i for i, _ in res], [v for _, v in res], "^-", label="residual-branch variance")
    log_scale(ax, [e["avg_sq_mean"] for e in entries] + [e["avg_var"] for e in entries])
    ax.set_xticks(x)
    ax.set_xticklabels([e["name"] for e in entries], rotation=60, ha="right", fontsize=7)
    ax.set_xlabel(f"{spp.get('mode', 'layer')} (forward order)")
    ax.set_ylabel("value on N(0, 1) input")
    ax.set_title(f"Signal propagation plot, input {tuple(spp.get('input_shape', ()))}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# The figures of render_monitor_plots: file name -> its panels (record key, y label, title, options of _panel; "log":
# True for a log y axis, "decades" for one where the values span a factor of 10 or more).
FIGURES = {
    "fig1a_update_ratio.png": [
        (
            "update_ratio_mean",
            r"mean$_o$ Var[$W_o - \Delta W_o$] / Var[$W_o$]",
            "Fig. 1(a): update ratio per layer",
            {"hline": (1.0, "no change"), "log": "decades"},
        )
    ],
    "fig1b_mean_update.png": [
        (
            "mean_update_std",
            r"std$_o$ of mean($\Delta W_o$)",
            "Fig. 1(b): spread of the per-filter mean update",
            {"log": True},
        ),
        ("shift", r"Var$_o$[$n_l$ mean($W_o$)]", "Shift of the average per layer", {"log": True, "alarm": True}),
    ],
    "fig2_weight_var.png": [
        ("weight_var", r"mean$_o$ Var[$W_o$]", "Fig. 2(a): filter weight variance", {"log": True}),
        (
            "shift_scale_free",
            r"Var$_o$[$n_l$ mean($W_o$)] / ($n_l$ Var[W])",
            "Scale-free shift (1 = random init, 0 = zero-mean filters)",
            {"alarm": True},
        ),
    ],
    "fig6_input_ratio.png": [
        ("input_mean_sq", r"E$^2$[$X_l$]", "Fig. 6(a): squared input mean", {"log": True}),
        (
            "input_ratio",
            r"E$^2$[$X_l$] / E[$X_l^2$]",
            "Fig. 6(b): input ratio",
            {"hline": (1 / math.pi, r"1/$\pi$ (ReLU of a Gaussian)")},
        ),
    ],
    "output_var.png": [("output_var", r"Var[$Y_l$]", "Output variance per layer", {"log": True, "alarm": True})],
}
layer_keys(*(panel[0] for panels in FIGURES.values() for panel in panels))  # the keys of normlab.monitor.records


def render_monitor_plots(log: str | Path | MonitorLog, out_dir: str | Path) -> list[Path]:
    """Render PNGs from a monitor log into ``out_dir`` and return their paths:
    fig1a_update_ratio.png, fig1b_mean_update.png, fig2_weight_var.png, fig6_input_ratio.png, output_var.png
    (``FIGURES``), and spp.png when the log holds signal-propagation data. ``log``: the JSONL file's path, or the
    :class:`~normlab.monitor.log.MonitorLog` that :func:`~normlab.monitor.log.load_log` read from it."""
    where = "the log" if isinstance(log, MonitorLog) else str(log)
    log = log if isinstance(log, MonitorLog) else load_log(log)
    records, alarm, spp = log.records, log.alarm, log.spp
    if not records and spp is None:
        raise ValueError(f"render_monitor_plots: {where} holds no monitor records")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, panels in FIGURES.items() if records else ():
        fig, axes = plt.subplots(1, len(panels), figsize=(7 if len(panels) == 1 else 12, 4.5), squeeze=False)
        for ax, (key, ylabel, title, opts) in zip(axes[0], panels):
            _panel(
                ax,
                records,
                key,
                ylabel,
                title,
                opts.get("log", False),
                alarm if opts.get("alarm") else None,
                opts.get("hline"),
            )
        paths.append(save_figure(fig, out / name))
    if spp is not None and spp.get("entries"):
        paths.append(_spp_figure(spp, out / "spp.png"))
    return paths
