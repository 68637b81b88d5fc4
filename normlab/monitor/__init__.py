"""Variance-transmission monitor (docs/design.md section 2): hooks, pure statistics, SPPs, rules that warn of a
collapse (:mod:`normlab.monitor.rules`), the failure taxonomy (:mod:`normlab.monitor.collapse`), rescue
(:class:`CollapseGuard`), plots::

    from normlab.monitor import VarianceMonitor
    with VarianceMonitor(model, every=10, optimizer=optimizer) as mon:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            mon.observe_loss(loss)          # optional: for the rules that read the loss
            optimizer.step()                # records every 10th step, checks the rules
            if mon.warning is not None: ... # e.g. the unstable regime: mon.warning.layer / .step / .message
            if mon.should_stop:             # an alarm: mon.alarm.rule / .layer / .step / .quantity
                break
        mon.to_jsonl("monitor.jsonl")       # then: normlab monitor monitor.jsonl --out plots/
"""

from normlab.monitor import stats
from normlab.monitor.collapse import CollapseCriteria, CollapseLabel, Failure, label_collapse
from normlab.monitor.guard import CollapseGuard, DismissedAlarm, Rescue, RunCollapsed
from normlab.monitor.layers import (
    LINEAR_MAP_RULES,
    effective_weight,
    filter_kernel,
    supported_layers,
    unwatched_layers,
    unwrap_model,
)
from normlab.monitor.log import load_log, write_monitor_log
from normlab.monitor.monitor import VarianceMonitor
from normlab.monitor.optim_step import scaler_step
from normlab.monitor.options import RecordOptions, RecordSchedule, RescueOptions, SnapshotOptions
from normlab.monitor.rules import DEFAULT_RULES, Event, Rule, StepContext, replay
from normlab.monitor.spp import signal_propagation


def render_monitor_plots(jsonl_path, out_dir):
    """Render the paper's Figures 1a, 1b, 2, 6, output variance and SPP from a monitor JSONL log -> PNG paths.

    Imported lazily so that importing the monitor does not import matplotlib.

    Args:
        jsonl_path: a log written by :meth:`VarianceMonitor.to_jsonl` (or by ``normlab train --monitor-every``).
        out_dir: where the PNG files go (created if needed).

    Example:
        >>> import tempfile, pathlib, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mon = VarianceMonitor(model, every=1, optimizer=opt)
        >>> for _ in range(3):
        ...     opt.zero_grad(); model(torch.randn(16, 4)).square().mean().backward(); opt.step()
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> pngs = render_monitor_plots(mon.to_jsonl(d / "monitor.jsonl"), d)
        >>> all(pathlib.Path(p).suffix == ".png" for p in pngs) and len(pngs) > 0
        True
    """
    from normlab.monitor.plots import render_monitor_plots as _render

    return _render(jsonl_path, out_dir)


__all__ = [
    "VarianceMonitor",
    "RecordSchedule",
    "RecordOptions",
    "Rule",
    "Event",
    "StepContext",
    "DEFAULT_RULES",
    "replay",
    "label_collapse",
    "CollapseLabel",
    "CollapseCriteria",
    "Failure",
    "scaler_step",
    "CollapseGuard",
    "SnapshotOptions",
    "RescueOptions",
    "DismissedAlarm",
    "Rescue",
    "RunCollapsed",
    "signal_propagation",
    "render_monitor_plots",
    "load_log",
    "write_monitor_log",
    "effective_weight",
    "filter_kernel",
    "LINEAR_MAP_RULES",
    "supported_layers",
    "unwatched_layers",
    "unwrap_model",
    "stats",
]
