"""VarianceMonitor: records how variance travels through a network (docs/design.md section 2).

Two lines in a training loop::

    mon = VarianceMonitor(model, every=10)
    ...
    loss.backward()
    mon.step(optimizer)          # instead of optimizer.step()
    if mon.should_stop: ...      # collapse early warning (mon.alarm says which layer, step and quantity)

Steps are counted by ``mon.step``; step s is a recording step when ``s % every == 0`` (step 0 = initial values).
Between recording steps the countdown alarm still sees every step (``countdown_every=1``): a light step keeps only
each conv/linear layer's output variance (and the gradient norm if the countdown reads it), read back once per step.
Hooks are attached only while a recording or light step is pending and only read detached tensors under
``torch.no_grad``: outputs and gradients are never changed, and unmonitored steps run with no hooks at all.

Per layer and recorded step the monitor keeps one dict in ``mon.records``: a
:class:`~normlab.monitor.records.LayerRecord` (conv / linear) or :class:`~normlab.monitor.records.NormRecord`; every
key is documented there (:mod:`normlab.monitor.records`). :meth:`VarianceMonitor.to_jsonl` writes them with the
alarm and spp events (:func:`normlab.monitor.log.write_monitor_log`); :func:`normlab.monitor.log.load_log` reads them
back.

Loops that step the optimizer themselves (a GradScaler, Lightning) call ``mon.before_update()`` right before the
optimizer step and ``mon.after_update()`` right after it: together they are ``mon.step(optimizer)``.
``VarianceMonitor(..., tensorboard=DIR or SummaryWriter)`` also writes every recorded step to TensorBoard
(:mod:`normlab.integrations.tensorboard`: per-layer scalars grouped as the paper's figures, per-filter mean-update
histograms, the alarm as text).

Supported wrappers: DistributedDataParallel / DataParallel (``.module`` is unwrapped; hooks sit on the local
replica, so each rank records its own shard of the batch) and ``torch.compile`` (``._orig_mod`` is unwrapped).
Compiled models: create the monitor BEFORE the first call of the compiled model. Compiled code does not see hooks
registered after it was compiled; the monitor then records only the weight-side quantities and warns once. With a
compiled model the hooks stay attached for the monitor's whole life (adding/removing them would force
recompiles); dynamo runs them with graph breaks, so a monitored compiled step is slower than an unmonitored one.
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from normlab._files import atomic_write
from normlab.monitor import stats
from normlab.monitor.alarm import CollapseAlarm, CollapseDetector, CountdownDetector
from normlab.monitor.hooks import (
    activation_stats,
    grad_norm,
    grad_norm_tensor,
    param_versions,
    read_light,
    weight_stats,
)
from normlab.monitor.layers import filter_kernel, is_compiled, supported_layers, unwrap_model
from normlab.monitor.log import write_monitor_log
from normlab.monitor.records import LayerRecord, NormRecord, layer_keys
from normlab.monitor.regime import RegimeDetector, RegimeWarning, exempt_layers, layer_learning_rates
from normlab.monitor.spp import signal_propagation

__all__ = [
    "VarianceMonitor",
    "DEFAULT_EXPLODE_FACTOR",
    "DEFAULT_MIN_INITIAL",
    "DEFAULT_IMPLODE_FACTOR",
    "DEFAULT_WATCH",
    "DEFAULT_COUNTDOWN",
    "DEFAULT_RISK",
]

# Default growth factors of the collapse warning (see VarianceMonitor, CollapseDetector).
DEFAULT_WATCH = ("output_var", "shift")
DEFAULT_EXPLODE_FACTOR = {"output_var": 1e3, "shift": 100.0}
DEFAULT_MIN_INITIAL = {"output_var": 1.0, "shift": 1e-6}
DEFAULT_IMPLODE_FACTOR = {"input_sq": 1e4}
layer_keys(*DEFAULT_WATCH, *DEFAULT_EXPLODE_FACTOR, *DEFAULT_MIN_INITIAL, *DEFAULT_IMPLODE_FACTOR)  # record keys
# Countdown alarm and regime warning (CountdownDetector, RegimeDetector): calibrated in docs/monitor.md.
DEFAULT_COUNTDOWN = {"growth": 1.0, "level": None, "grad_ratio": None}
DEFAULT_RISK = {"window": 2, "pws_factor": None, "min_ratio": 10.0}  # docs/monitor.md, round 3


def _make(cls, arg, defaults: Mapping):
    """The detector ``cls`` from a monitor argument: True (defaults), False/None (off) or a mapping of overrides."""
    if arg is None or arg is False:
        return None
    if arg is True:
        return cls(**defaults)
    if not isinstance(arg, Mapping):
        raise TypeError(
            f"VarianceMonitor: {cls.__name__} argument must be True, False or a dict of its arguments, "
            f"got {type(arg).__name__}"
        )
    return cls(**{**defaults, **arg})


def _check_args(model, every, dense_steps, dense_every, countdown_every) -> None:
    """Refuse a model that is no nn.Module and a recording interval that is no int in range, in one line."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"VarianceMonitor: model must be an nn.Module, got {type(model).__name__}")
    for name, value, low in (("every", every, 1), ("dense_steps", dense_steps, 0), ("dense_every", dense_every, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"VarianceMonitor: {name} must be an int >= {low}, got {value!r}")
    if countdown_every is not None and (
        isinstance(countdown_every, bool) or not isinstance(countdown_every, int) or countdown_every < 1
    ):
        raise ValueError(f"VarianceMonitor: countdown_every must be None or an int >= 1, got {countdown_every!r}")


class VarianceMonitor:
    """Record variance-transmission statistics of every conv/linear (and norm) layer every ``every`` steps.

    Args:
        model: any nn.Module (DDP/DataParallel and torch.compile wrappers are unwrapped).
        every: record on steps 0, every, 2*every, ... (int >= 1).
        dense_steps: also record every ``dense_every`` steps during the first ``dense_steps`` steps (the first
            steps of a run are where a collapse at a high learning rate begins). Default: 0 (off).
        dense_every: the recording interval during the first ``dense_steps`` steps (int >= 1). Default: 1.
        explode_factor: collapse warning when a layer's output variance or shift exceeds this factor times its
            baseline (or any watched quantity becomes non-finite); a float, or a mapping {quantity: factor}.
            Default ``DEFAULT_EXPLODE_FACTOR`` = {"output_var": 1e3, "shift": 100}: the classifier's logit variance
            grows ~100-200x in healthy training (the net becomes confident), so 100x on output_var is no warning.
        implode_factor: a mapping {quantity: factor}; also warn when a quantity of the output layer (the
            classifier) falls below its baseline divided by the factor. Default ``DEFAULT_IMPLODE_FACTOR`` =
            {"input_sq": 1e4}: the second moment of the classifier's input falling 10,000x is a net whose last ReLUs
            died (a collapse with a finite loss); on MNIST-1D pilots it flagged 3 of 3 such runs with no alarm on 21
            healthy ones (healthy minimum 1.5e-3 of the baseline). The output variance of hidden layers is no such
            sign: it falls 10-200x in the first steps of healthy unnormalized runs.
        watch: record keys checked by the collapse warning.
        min_initial: floor for baselines in the growth test, a float or {quantity: floor} (see CollapseDetector).
            Default ``DEFAULT_MIN_INITIAL`` = {"output_var": 1.0, "shift": 1e-6}: output variance is compared with
            at least unit variance (the scale He init preserves). A layer whose signal starts tiny is then flagged
            only above factor x 1 in absolute terms (the PWS plain net starts at Var[Y] 0.9 shrinking to 0.035 with
            depth and grows ~1000x in healthy training). The shift of PWS/WS kernels is 0: floor 1e-6.
        baseline_records: the baseline of each (layer, quantity) is the maximum of its first
            ``baseline_records`` recorded finite values (recorded steps 0, every, ..., (baseline_records-1)*every);
            no growth alarm before that (non-finite values are flagged at once). See CollapseDetector.
        watch_output_layer: also apply the growth test to the output layer (the last conv/linear layer in forward
            order, i.e. the classifier). Off by default: in healthy training its logit variance and the spread of
            its filter means (per-class offsets) grow 100-2000x as the net becomes confident (measured on the plain
            net with PWS convs and on cnn1d with BN/PWS); it is still flagged when non-finite.
        on_alarm: optional callable(alarm) called once, when the first alarm fires.
        include_norm: also monitor normalization layers (output variance, input ratio).
        record_eval: also record forwards of modules in eval mode (default: training forwards only, so an
            evaluation pass inside a recording step does not replace the training statistics).
        tensorboard: a log directory or a ``SummaryWriter``: every recorded step is also written there
            (:class:`normlab.integrations.tensorboard.MonitorBoard`, kept in ``mon.tensorboard``; a directory's
            writer is closed by :meth:`close`). Needs ``pip install 'normlab[tensorboard]'``.
        optimizer: attach to this optimizer: its own ``optimizer.step()`` then records (step hooks call
            :meth:`before_update` and :meth:`after_update`), so the usual loop ``loss.backward(); opt.step()``
            needs nothing else, and ``mon.step(opt)`` is the same single step. A step that a GradScaler skips
            (inf gradients) is not taken, so it is not counted. Without it, call ``mon.step(opt)`` (which takes the
            optimizer step itself) or ``before_update``/``after_update``. ``opt.step(); mon.step(opt)`` (either
            way) raises RuntimeError instead of applying the same gradients twice.
        countdown: the countdown alarm (:class:`~normlab.monitor.CountdownDetector`: output-variance growth
            rate and level in the hidden layers, optionally the gradient norm over its running median, non-finite
            values): True for ``DEFAULT_COUNTDOWN``, a dict overriding some of its arguments, False for off. Its
            alarm and the factor rules' share ``mon.alarm`` (the first to fire). Thresholds: docs/monitor.md.
        risk: the regime warning ``mon.risk`` (:class:`~normlab.monitor.RegimeDetector`: shift term above
            ``min_ratio`` (default 10) times the variance term for ``window`` (default 2) steps in a layer not
            normalized downstream, or, when enabled, the variance term of a standardized conv growing): True for
            ``DEFAULT_RISK``, a dict of overrides, False for off.
        factor_rules: keep the growth/implosion factor rules (``explode_factor``, ``implode_factor``). A layer whose
            output feeds a normalization layer gets no shift growth test (the normalization removes the per-channel
            offsets before the next layer: the SwitchableNorm U-Net's 116x shift was no collapse); the countdown
            skips such layers entirely.
        countdown_every: feed the countdown alarm every ``countdown_every`` steps (int >= 1), not only on the
            recorded steps. Default 1: every step, as the countdown's thresholds were calibrated (docs/monitor.md).
            A step that is not a recording step is then a *light* step: the forward hooks keep only each conv/linear
            layer's output variance (``output_var``, the same function as the full record), ``step`` the gradient
            norm when the countdown's ``grad_ratio`` is on, and both are read back to the host in one transfer and
            passed to the countdown alone. Light steps add nothing to ``records`` (the log keeps only full records); the
            level rule reads each layer's ``shift_scale_free`` from its last full record. The factor rules and the
            regime warning read full records only. Measured cost: benchmarks/RESULTS.md ("Monitor overhead").
            None: the countdown reads the full records only (every ``every`` steps).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mon = VarianceMonitor(model, every=1, optimizer=opt)
        >>> model(torch.randn(16, 4)).square().mean().backward()
        >>> opt.step()                       # records step 0 through the optimizer's hooks
        >>> mon.current_step, sorted({r["layer"] for r in mon.records})
        (1, ['0', '2'])
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 10,
        dense_steps: int = 0,
        dense_every: int = 1,
        explode_factor: float | Mapping[str, float] | None = None,
        implode_factor: Mapping[str, float] | None = None,
        watch: Sequence[str] = DEFAULT_WATCH,
        min_initial: float | Mapping[str, float] | None = None,
        baseline_records: int = 1,
        watch_output_layer: bool = False,
        on_alarm: Callable[[CollapseAlarm], None] | None = None,
        include_norm: bool = True,
        record_eval: bool = False,
        tensorboard: str | os.PathLike | object | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        countdown: Mapping | bool = True,
        risk: Mapping | bool = True,
        factor_rules: bool = True,
        countdown_every: int | None = 1,
    ) -> None:
        _check_args(model, every, dense_steps, dense_every, countdown_every)
        self.model = unwrap_model(model)
        self.compiled = is_compiled(model)
        self.every, self.dense_steps, self.dense_every = every, dense_steps, dense_every
        self.countdown_every = countdown_every
        self.include_norm = include_norm
        self.watch_output_layer = watch_output_layer
        self.record_eval = record_eval
        self.on_alarm = on_alarm
        self.detector = CollapseDetector(
            explode_factor=dict(DEFAULT_EXPLODE_FACTOR) if explode_factor is None else explode_factor,
            watch=watch,
            min_initial=dict(DEFAULT_MIN_INITIAL) if min_initial is None else min_initial,
            baseline_records=baseline_records,
            implode_factor=dict(DEFAULT_IMPLODE_FACTOR) if implode_factor is None else implode_factor,
        )
        self.factor_rules = factor_rules
        self.countdown = _make(CountdownDetector, countdown, DEFAULT_COUNTDOWN)
        self.regime = _make(RegimeDetector, risk, DEFAULT_RISK)
        self.risk: RegimeWarning | None = None
        self._grad_norm: float | None = None
        self.layers = supported_layers(self.model, include_norm=include_norm)
        if not self.layers:
            raise ValueError(
                f"VarianceMonitor: model {type(self.model).__name__} has no supported layers "
                "(expected a module matched by normlab.monitor.layers.LINEAR_MAP_RULES - nn.Conv*d, "
                "nn.ConvTranspose*d, nn.Linear, transformers' Conv1D - or a normalization layer)"
            )
        self.current_step = 0
        self.records: list[LayerRecord | NormRecord] = []
        self.alarm: CollapseAlarm | None = None
        self.spp: dict | None = None
        self.closed = False
        self._order: dict[str, int] = {}
        self._pending: dict[str, dict] = {}
        self._light: dict[str, Tensor] = {}  # output_var tensors of a light step, read back once in after_update
        self._light_grad: Tensor | None = None
        self._scale_free: dict[str, float] = {}  # shift_scale_free of the last full record (the level rule reads it)
        # against a second optimizer step on the same gradients (see _refuse_second_step)
        self._versions: dict[str, tuple[int, ...]] = {}  # parameter versions at this step's recorded forward
        self._versions_step = -1
        self._stepped_grad: tuple[Tensor, int] | None = None  # a gradient and its version at the last step
        self._handles: list = []
        self._warned_compiled = False
        self._before: dict[str, Tensor] | None = None
        self.tensorboard = None
        if tensorboard is not None:
            from normlab.integrations.tensorboard import MonitorBoard

            self.tensorboard = MonitorBoard(tensorboard)
        self.optimizer = None
        self._lr_optimizer = None  # where the regime warning reads the learning rate (attached or last stepped)
        self._optimizer_handles: list = []
        if optimizer is not None:
            self._attach(optimizer)
        self._sync_hooks()

    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"VarianceMonitor: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = self._lr_optimizer = optimizer
        self._optimizer_handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.before_update()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_attached_step()),
        ]

    # ----------------------------------------------------------------- hooks
    @property
    def is_recording(self) -> bool:
        """True when the current step (forward + ``step``) is recorded."""
        step = self.current_step
        dense = step < self.dense_steps and step % self.dense_every == 0
        return not self.closed and (dense or step % self.every == 0)

    @property
    def is_light(self) -> bool:
        """True when the current step is not recorded but feeds the countdown alarm (``countdown_every``): its
        forward keeps only each conv/linear layer's output variance (and ``step`` the gradient norm when the countdown's
        ``grad_ratio`` is on), read back in one transfer."""
        every = self.countdown_every
        return (
            self.countdown is not None
            and every is not None
            and not self.is_recording
            and not self.closed
            and self.current_step % every == 0
        )

    @property
    def should_stop(self) -> bool:
        """True once the collapse warning has fired (the training loop may stop and keep its last checkpoint)."""
        return self.alarm is not None

    def _sync_hooks(self) -> None:
        want = not self.closed and (self.compiled or self.is_recording or self.is_light)
        if want and not self._handles:
            for name, mod, kind in self.layers:
                self._handles.append(mod.register_forward_hook(self._make_hook(name, mod, kind)))
        elif not want and self._handles:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, name: str, target: nn.Module, kind: str):
        def hook(module: nn.Module, args, output) -> None:
            # `module is not target`: a deepcopy of the model (EMA copy, signal_propagation) carries the hook too
            if module is not target or name in self._pending or name in self._light:
                return
            if not (module.training or self.record_eval):
                return
            if self.is_recording:
                with torch.no_grad():
                    self._pending[name] = activation_stats(module, kind, args, output)
                if self._versions_step != self.current_step:
                    self._versions, self._versions_step = {}, self.current_step
                self._versions[name] = param_versions(module)
            elif kind != "norm" and self.is_light:  # the countdown tests conv/linear outputs only
                if isinstance(output, Tensor) and output.numel() > 0:
                    with torch.no_grad():
                        self._light[name] = stats.output_variance(output)
            else:
                return
            if name not in self._order:
                self._order[name] = len(self._order)

        return hook

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer | None = None, closure=None):
        """Perform ``optimizer.step(closure)`` (if given) and advance the step counter.

        On a recording step, also snapshots the effective kernels before and after the optimizer step, writes
        this step's records and runs the collapse check. Returns what ``optimizer.step`` returned. For the optimizer
        the monitor is attached to (``optimizer=``), this is exactly ``optimizer.step(closure)``: its hooks record.
        """
        if optimizer is not None and closure is None and not self.closed:
            self._refuse_second_step()
        if optimizer is not None and optimizer is self.optimizer and not self.closed:
            return optimizer.step(closure)
        self.before_update(optimizer)
        result = optimizer.step(closure) if optimizer is not None else None
        self._stepped_grad = self._grad_mark() if optimizer is not None else None
        self.after_update(stepped=optimizer is not None)
        return result

    def _after_attached_step(self) -> None:
        self._stepped_grad = self._grad_mark()
        self.after_update(stepped=True)

    def _grad_mark(self) -> tuple[Tensor, int] | None:
        """The first monitored parameter's gradient and its version counter (None: no gradient yet).

        A backward either makes a new gradient tensor (after ``zero_grad()``) or accumulates into the old one in
        place (a new version), so an unchanged mark means no backward ran since it was taken."""
        for _name, mod, _kind in self.layers:
            for p in mod.parameters():
                if p.grad is not None:
                    return p.grad, p.grad._version
        return None

    def _refuse_second_step(self) -> None:
        """Raise when ``step(optimizer)`` would apply gradients that an optimizer step already used.

        Two signs, both cheap: a monitored layer's parameters changed in place since this step's recorded forward
        (the loop called ``optimizer.step()`` before ``mon.step(optimizer)``), or no backward ran since the last
        step this monitor saw (``opt.step()`` of an attached optimizer, or ``mon.step(opt)`` twice)."""
        changed = None
        if self._versions_step == self.current_step:
            changed = next(
                (n for n, m, _k in self.layers if self._versions.get(n, ()) not in ((), param_versions(m))), None
            )
        mark, last = self._grad_mark(), self._stepped_grad
        if changed is None and not (
            mark is not None and last is not None and mark[0] is last[0] and mark[1] == last[1]
        ):
            return
        why = (
            f"the parameters of layer '{changed}' changed since this step's forward"
            if changed
            else ("no backward ran since the last optimizer step")
        )
        raise RuntimeError(
            f"VarianceMonitor.step: {why}, so optimizer.step() was already called for these gradients and "
            f"step(optimizer) would apply them a second time (it takes the optimizer step itself): call either "
            f"opt.step() or mon.step(opt), not both; attached with VarianceMonitor(model, optimizer=opt), call only "
            f"opt.step()"
        )

    def before_update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call right before an optimizer step that the training loop takes itself (``scaler.step(opt)``, Lightning):
        on a recording step it snapshots the effective kernels. :meth:`after_update` completes the step. Given the
        ``optimizer`` about to step, the regime warning reads its learning rate (``mon.risk.suggested_lr``)."""
        if optimizer is not None:
            self._lr_optimizer = optimizer
        self._before = None
        if self.countdown is not None and self.countdown.grad_ratio is not None:
            if self.is_recording:
                self._grad_norm = grad_norm(self.model)
            elif self.is_light:
                norm = grad_norm_tensor(self.model)  # no gradient: 0.0, as grad_norm gives the full path
                self._light_grad = torch.zeros(()) if norm is None else norm
        if self.is_recording:
            self._before = {name: filter_kernel(m).clone() for name, m, kind in self.layers if kind != "norm"}

    def after_update(self, stepped: bool = True) -> None:
        """Call right after that optimizer step (``stepped=False``: no step was taken): on a recording step it writes
        the step's records (update ratios against the :meth:`before_update` snapshot) and runs the collapse check;
        then it advances the step counter."""
        if self.is_recording:
            before, self._before = self._before, None
            if before is None:  # no snapshot: weight statistics of the current kernels, no update ratios
                before, stepped = {n: filter_kernel(m).clone() for n, m, k in self.layers if k != "norm"}, False
            self._finalize(before, stepped)
        elif self.is_light:
            self._light_check()
        self.current_step += 1
        self._sync_hooks()

    def _indices(self) -> dict[str, int]:
        """Each layer's forward-order index; a layer not run in a recorded forward is ordered after those that ran."""
        out, next_index = {}, len(self._order)
        for name, _mod, _kind in self.layers:
            if name in self._order:
                out[name] = self._order[name]
            else:
                out[name], next_index = next_index, next_index + 1
        return out

    def _exempt(self, step_records: list[dict]) -> tuple[set, set]:
        """``(output_layer, renormalized)``: the output layer (the last conv/linear in forward order among those that
        ran) and the layers whose output is renormalized before the next layer, as sets of names."""
        ran = [r for r in step_records if r["kind"] != "norm" and r["layer"] in self._order]
        output_layer = {max(ran, key=lambda r: r["index"])["layer"]} if ran else set()
        return output_layer, exempt_layers(step_records) - output_layer

    @torch.no_grad()
    def _light_check(self) -> None:
        """The light step: this step's output variances (and gradient norm) in one read-back, fed to the countdown
        alone; nothing is added to ``records``."""
        values, norm = read_light(self._light, self._light_grad)
        self._light, self._light_grad = {}, None
        indices = self._indices()
        step_records = []
        for name, _mod, kind in self.layers:
            rec: dict = {"step": self.current_step, "layer": name, "index": indices[name], "kind": kind}
            if name in values:
                rec["output_var"] = values[name]
            if name in self._scale_free:
                rec["shift_scale_free"] = self._scale_free[name]
            step_records.append(rec)
        step_records.sort(key=lambda r: r["index"])
        output_layer, renormalized = self._exempt(step_records)
        alarm = self.countdown.check(
            self.current_step, step_records, exempt=renormalized | output_layer, grad_norm=norm
        )
        if alarm is not None and self.alarm is None:
            self._raise(alarm)

    def _raise(self, alarm: CollapseAlarm) -> None:
        """Keep the first alarm, write it to TensorBoard and call ``on_alarm``."""
        self.alarm = alarm
        if self.tensorboard is not None:
            self.tensorboard.write_alarm(alarm)
        if self.on_alarm is not None:
            self.on_alarm(alarm)

    @torch.no_grad()
    def _finalize(self, before: dict[str, Tensor], stepped: bool) -> None:
        step_records, updates = [], {}
        indices = self._indices()
        for name, mod, kind in self.layers:
            rec: dict = {"step": self.current_step, "layer": name, "index": indices[name]}
            rec["type"] = type(mod).__name__
            rec["kind"] = kind
            rec.update(self._pending.get(name, {}))
            if kind != "norm":
                after = filter_kernel(mod) if stepped else None
                if after is not None:  # per-filter mean updates: in the record's summary and TensorBoard's histograms
                    updates[name] = stats.filter_mean_update(before[name], after)
                rec.update(weight_stats(before[name], after, updates.get(name)))
                rec.update(stats.variance_terms(rec))
                if rec.get("shift_scale_free") is not None:
                    self._scale_free[name] = rec["shift_scale_free"]
            step_records.append(rec)
        if self.compiled and not self._pending and not self._warned_compiled:
            self._warned_compiled = True
            warnings.warn(
                "VarianceMonitor: no forward hook fired during recording step "
                f"{self.current_step} of a torch.compile'd model; compiled code ignores hooks registered after "
                "its first call: create the monitor before calling the compiled model. Only weight-side "
                "statistics are recorded.",
                stacklevel=3,
            )
        self._pending = {}
        step_records.sort(key=lambda r: r["index"])
        self.records.extend(step_records)
        output_layer, renormalized = self._exempt(step_records)
        exempt = set() if self.watch_output_layer else set(output_layer)
        alarm = self._check(step_records, exempt, output_layer, renormalized)
        if self.tensorboard is not None:
            self.tensorboard.write_records(step_records, updates)
        if alarm is not None and self.alarm is None:
            self._raise(alarm)

    def _check(
        self, step_records: list[dict], exempt: set, output_layer: set, renormalized: set
    ) -> CollapseAlarm | None:
        """Run the regime test (sets ``self.risk`` once) and the alarm rules; the alarm of this step or None."""
        step = self.current_step
        alarm = None
        if self.factor_rules:
            alarm = self.detector.check(
                step, step_records, exempt, shrink_layers=output_layer, shift_exempt=renormalized
            )
        if self.regime is not None:
            opt = self._lr_optimizer if self.risk is None else None
            lrs = None if opt is None else layer_learning_rates(self.layers, opt)
            risk = self.regime.check(step, step_records, lrs)
            if risk is not None and self.risk is None:
                self.risk = risk
        if self.countdown is not None:
            grad_norm, self._grad_norm = self._grad_norm, None
            late = self.countdown.check(step, step_records, exempt=renormalized | output_layer, grad_norm=grad_norm)
            alarm = alarm or late
        return alarm

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """What decides future records and alarms, as plain Python types (safe for ``torch.load(weights_only=True)``):
        ``{"every", "dense", "current_step", "order", "detector", "alarm"}``. ``records`` are not included (export
        them with :meth:`to_jsonl`); the state is small and constant in the length of training."""
        return {
            "every": self.every,
            "dense": [self.dense_steps, self.dense_every],
            "current_step": self.current_step,
            "order": dict(self._order),
            "detector": self.detector.state_dict(),
            "alarm": None if self.alarm is None else self.alarm.to_dict(),
            "countdown": None if self.countdown is None else self.countdown.state_dict(),
            "regime": None if self.regime is None else self.regime.state_dict(),
            "risk": None if self.risk is None else self.risk.to_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (e.g. when resuming training): step counter, forward order, collapse baselines
        and an alarm that already fired (``on_alarm`` is not called again for it).

        Raises ValueError when ``state`` is malformed, was made with another ``every``, or names layers this model
        does not have."""
        if not isinstance(state, Mapping) or not {"every", "current_step", "detector"} <= set(state):
            raise ValueError(
                "VarianceMonitor.load_state_dict: expected a dict from VarianceMonitor.state_dict() with 'every', "
                f"'current_step' and 'detector', got {type(state).__name__}"
            )
        saved = "every={}, dense_steps={}, dense_every={}".format(
            state["every"], *state.get("dense", [self.dense_steps, self.dense_every])
        )
        mine = f"every={self.every}, dense_steps={self.dense_steps}, dense_every={self.dense_every}"
        if saved != mine:
            raise ValueError(
                f"VarianceMonitor.load_state_dict: state was recorded with {saved}, this monitor uses {mine}"
            )
        step = state["current_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"VarianceMonitor.load_state_dict: current_step must be an int >= 0, got {step!r}")
        names = {name for name, _, _ in self.layers}
        order = dict(state.get("order") or {})
        unknown = sorted((set(order) | {row[0] for row in state["detector"].get("baselines", [])}) - names)
        if unknown:
            raise ValueError(
                f"VarianceMonitor.load_state_dict: state names layers this model does not have: {unknown[:5]}"
            )
        self.detector.load_state_dict(state["detector"])
        for name in ("countdown", "regime"):
            det = getattr(self, name)
            if det is not None and state.get(name) is not None:
                det.load_state_dict(state[name])
        risk = state.get("risk")
        self.risk = None if risk is None else RegimeWarning(**risk)
        alarm = state.get("alarm")
        self.alarm = None if alarm is None else CollapseAlarm.from_dict(alarm)
        self._order = {str(k): int(v) for k, v in order.items()}
        self._pending, self._light, self._light_grad = {}, {}, None
        self.current_step = step
        self._sync_hooks()

    # ---------------------------------------------------------------- extras
    def add_signal_propagation(self, input_shape: Sequence[int], **kwargs) -> dict:
        """Compute ``signal_propagation(model, input_shape, **kwargs)``, keep it in ``self.spp`` (exported by
        ``to_jsonl`` and plotted by ``normlab monitor``) and return it."""
        self.spp = signal_propagation(self.model, input_shape, **kwargs)
        return self.spp

    def to_jsonl(self, path: str | Path) -> Path:
        """Write the log: one JSON object per record (non-finite values as null), then {"event": "alarm", ...} if an
        alarm fired and {"event": "spp", ...} if signal-propagation data was added
        (:func:`~normlab.monitor.log.write_monitor_log`; :func:`~normlab.monitor.log.load_log` reads it). The file is
        replaced atomically (a link at ``path`` is replaced, not followed)."""
        write_monitor_log(path, self.records, self.alarm, self.spp)
        return Path(path)

    def to_csv(self, path: str | Path) -> Path:
        """Write the records as CSV, one row per layer and step; an empty cell means "not applicable" and
        non-finite values are written as nan/inf. The file is replaced atomically (a link is not followed)."""
        columns: list[str] = []
        for rec in self.records:
            for k in rec:
                if k not in columns:
                    columns.append(k)
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(self.records)
        return atomic_write(path, lambda f: f.write(buf.getvalue().encode("utf-8")))

    def close(self) -> None:
        """Remove every hook. Later ``step`` calls still step the optimizer but record nothing."""
        self.closed = True
        self._pending, self._light, self._light_grad, self._stepped_grad = {}, {}, None, None
        self._remove_hooks()
        for h in self._optimizer_handles:
            h.remove()
        self._optimizer_handles = []
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> VarianceMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"VarianceMonitor({type(self.model).__name__}, every={self.every}, layers={len(self.layers)}, "
            f"step={self.current_step}, records={len(self.records)}, alarm={self.alarm})"
        )
