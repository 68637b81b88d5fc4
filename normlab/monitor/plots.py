"""PNG plots of a VarianceMonitor log (matplotlib, Agg backend): the PWS paper's Figures 1a, 1b, 2, 6, the
output variance per layer and a signal propagation plot. One line per layer, labelled axes and legends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

from normlab._files import atomic_savefig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["load_log", "render_monitor_plots"]


_PLOTTED = (
    "update_ratio_mean",
    "mean_update_std",
    "shift",
    "weight_var",
    "shift_scale_free",
    "input_mean_sq",
    "input_ratio",
    "output_var",
)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_record(obj: dict, where: str) -> None:
    """A layer record must have a string ``layer``, an integer ``step`` and numbers (or null) where plotted."""
    if not isinstance(obj["layer"], str) or not isinstance(obj["step"], int) or isinstance(obj["step"], bool):
        raise ValueError(
            f"load_log: {where}: expected a string 'layer' and an integer 'step', got "
            f"{obj['layer']!r} and {obj['step']!r}"
        )
    if not (obj.get("index") is None or _is_number(obj.get("index"))):
        raise ValueError(f"load_log: {where}: 'index' must be a number, got {obj.get('index')!r}")
    for key in _PLOTTED:
        if key in obj and not (obj[key] is None or _is_number(obj[key])):
            raise ValueError(f"load_log: {where}: {key!r} must be a number or null, got {obj[key]!r}")


def _check_spp(obj: dict, where: str) -> None:
    """A signal-propagation event: a list of entries with a name and the two averages."""
    entries = obj.get("entries", [])
    ok = isinstance(entries, list) and all(
        isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and _is_number(e.get("avg_sq_mean"))
        and _is_number(e.get("avg_var"))
        and (e.get("residual_var") is None or _is_number(e.get("residual_var")))
        for e in entries
    )
    if not ok:
        raise ValueError(
            f"load_log: {where}: 'entries' of an spp event must be objects with a name, avg_sq_mean and avg_var"
        )


def load_log(path: str | Path) -> tuple[list[dict], dict | None, dict | None]:
    """Read a monitor JSONL file -> (layer records, alarm dict or None, spp dict or None).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: a line that is not a JSON object, or a layer record with values of the wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_log: monitor log {path} does not exist or is not a file")
    records, alarm, spp = [], None, None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"load_log: {path}:{lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"load_log: {path}:{lineno} is not a JSON object (got {type(obj).__name__})")
            event = obj.get("event")
            if event == "alarm":
                alarm = obj
            elif event == "spp":
                _check_spp(obj, f"{path}:{lineno}")
                spp = obj
            elif "layer" in obj and "step" in obj:
                _check_record(obj, f"{path}:{lineno}")
                records.append(obj)
    return records, alarm, spp


def _series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """layer -> (steps, values) for layers that have ``key``, in forward order; None -> nan."""
    order: dict[str, int] = {}
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        if key not in r:
            continue
        name = r["layer"]
        order.setdefault(name, r.get("index", len(order)))
        steps, vals = out.setdefault(name, ([], []))
        steps.append(r["step"])
        v = r[key]
        vals.append(float("nan") if v is None else float(v))
    return {k: out[k] for k in sorted(out, key=lambda n: order[n])}


def _positive(values: list[float]) -> bool:
    """Any finite positive value (a log axis then masks the non-positive ones)."""
    return any(math.isfinite(v) and v > 0 for v in values)


def _panel(ax, records, key, ylabel, title, log=False, alarm=None, hline=None):
    series = _series(records, key)
    for name, (steps, vals) in series.items():
        ax.plot(steps, vals, label=name, linewidth=1.2)
    if log and any(_positive(v) for _, v in series.values()):
        ax.set_yscale("log", nonpositive="mask")
    if hline is not None:
        ax.axhline(hline[0], color="k", linestyle=":", linewidth=1, label=hline[1])
    if alarm is not None and alarm.get("step") is not None:
        ax.axvline(
            alarm["step"], color="r", linestyle="--", linewidth=1, label=f"collapse warning ({alarm.get('layer')})"
        )
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(title="layer", fontsize=7, title_fontsize=8, loc="best", ncol=2 if len(series) > 8 else 1)
    else:
        ax.text(0.5, 0.5, f"no '{key}' in log", ha="center", va="center", transform=ax.transAxes)
    return bool(series)


def _save(fig, path: Path) -> Path:
    """Save ``fig`` as ``path`` (atomically, replacing a link there instead of following it) and close it."""
    fig.tight_layout()
    try:
        atomic_savefig(fig, path, dpi=110)
    finally:
        plt.close(fig)
    return path


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
    vals = [e["avg_sq_mean"] for e in entries] + [e["avg_var"] for e in entries]
    if _positive(vals):
        ax.set_yscale("log", nonpositive="mask")
    ax.set_xticks(x)
    ax.set_xticklabels([e["name"] for e in entries], rotation=60, ha="right", fontsize=7)
    ax.set_xlabel(f"{spp.get('mode', 'layer')} (forward order)")
    ax.set_ylabel("value on N(0, 1) input")
    ax.set_title(f"Signal propagation plot, input {tuple(spp.get('input_shape', ()))}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def render_monitor_plots(jsonl_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Render PNGs from a monitor log into ``out_dir`` and return their paths:
    fig1a_update_ratio.png, fig1b_mean_update.png, fig2_weight_var.png, fig6_input_ratio.png, output_var.png,
    and spp.png when the log holds signal-propagation data."""
    records, alarm, spp = load_log(jsonl_path)
    if not records and spp is None:
        raise ValueError(f"render_monitor_plots: {jsonl_path} holds no monitor records")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if records:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _panel(
            ax,
            records,
            "update_ratio_mean",
            r"mean$_o$ Var[$W_o - \Delta W_o$] / Var[$W_o$]",
            "Fig. 1(a): update ratio per layer",
            hline=(1.0, "no change"),
        )
        paths.append(_save(fig, out / "fig1a_update_ratio.png"))

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        _panel(
            axes[0],
            records,
            "mean_update_std",
            r"std$_o$ of mean($\Delta W_o$)",
            "Fig. 1(b): spread of the per-filter mean update",
            log=True,
        )
        _panel(
            axes[1],
            records,
            "shift",
            r"Var$_o$[$n_l$ mean($W_o$)]",
            "Shift of the average per layer",
            log=True,
            alarm=alarm,
        )
        paths.append(_save(fig, out / "fig1b_mean_update.png"))

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        _panel(axes[0], records, "weight_var", r"mean$_o$ Var[$W_o$]", "Fig. 2(a): filter weight variance", log=True)
        _panel(
            axes[1],
            records,
            "shift_scale_free",
            r"Var$_o$[$n_l$ mean($W_o$)] / ($n_l$ Var[W])",
            "Scale-free shift (1 = random init, 0 = zero-mean filters)",
            log=False,
            alarm=alarm,
        )
        paths.append(_save(fig, out / "fig2_weight_var.png"))

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        _panel(axes[0], records, "input_mean_sq", r"E$^2$[$X_l$]", "Fig. 6(a): squared input mean", log=True)
        _panel(
            axes[1],
            records,
            "input_ratio",
            r"E$^2$[$X_l$] / E[$X_l^2$]",
            "Fig. 6(b): input ratio",
            hline=(1 / math.pi, r"1/$\pi$ (ReLU of a Gaussian)"),
        )
        paths.append(_save(fig, out / "fig6_input_ratio.png"))

        fig, ax = plt.subplots(figsize=(7, 4.5))
        _panel(ax, records, "output_var", r"Var[$Y_l$]", "Output variance per layer", log=True, alarm=alarm)
        paths.append(_save(fig, out / "output_var.png"))
    if spp is not None and spp.get("entries"):
        paths.append(_spp_figure(spp, out / "spp.png"))
    return paths
