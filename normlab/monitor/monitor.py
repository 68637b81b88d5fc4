"""VarianceMonitor: records how variance travels through a network (docs/design.md section 2) and checks rules.

Attached to the optimizer, it needs nothing else in a training loop::

    mon = VarianceMonitor(model, every=10, optimizer=opt)
    ...
    loss.backward()
    mon.observe_loss(loss)           # optional: for the rules that read the loss
    opt.step()                       # records (every 10th step) and checks the rules
    if mon.should_stop: ...          # an alarm fired (mon.alarm: which rule, layer, step and quantity)

Steps are counted by the optimizer's ``step()`` (:mod:`normlab.monitor.optim_step`: its step hooks; with a GradScaler,
:func:`~normlab.monitor.scaler_step` also counts the steps the scaler skips); step s is a recording step when
``s % every == 0`` (step 0 = initial values). On
every recorded step the monitor builds a :class:`~normlab.monitor.StepContext` and checks its rules
(:mod:`normlab.monitor.rules`, default :func:`~normlab.monitor.DEFAULT_RULES`); rules with ``every_step`` are
checked on every step, and when one of them needs a record key between recordings (the countdown: ``output_var``) a
*light* step keeps only each conv/linear layer's output variance, read back once per step. The events the rules raise
are in ``mon.events`` (each rule's first), the first alarm in ``mon.alarm``; ``mon.history`` keeps every event ever
raised, those of steps a :class:`~normlab.monitor.CollapseGuard` rolled back marked ``rolled_back``.

Hooks are attached only while a recording or light step is pending (a light step hooks only the conv/linear layers)
and only read detached tensors under ``torch.no_grad``: outputs and gradients are never changed, and unmonitored
steps run with no hooks at all.

Per layer and recorded step the monitor keeps one dict in ``mon.records``: a
:class:`~normlab.monitor.records.LayerRecord` (conv / linear) or :class:`~normlab.monitor.records.NormRecord`; every
key is documented there (:mod:`normlab.monitor.records`). :meth:`VarianceMonitor.to_jsonl` writes them with the
events and spp data (:func:`normlab.monitor.log.write_monitor_log`); :func:`normlab.monitor.log.load_log` reads them
back.

``mon.add_sink(MonitorBoard(DIR or SummaryWriter))`` also writes every recorded step to TensorBoard
(:mod:`normlab.integrations.tensorboard`: per-layer scalars grouped as the paper's figures, per-filter mean-update
histograms, the events as text); ``mon.add_sink(callback)`` calls ``callback(event)`` for every event kept.

Supported wrappers: DistributedDataParallel / DataParallel (``.module`` is unwrapped), FSDP2 (``fully_shard``: its
weights are DTensors, each rank holding whole output filters) and ``torch.compile`` (``._orig_mod`` is unwrapped).
Under DDP and FSDP2 each rank measures its share of the batch and of the filters, and the ranks merge their
measurements in one all-reduce per recorded (and light) step (:mod:`normlab.monitor.ranks`): every record is that of
the whole model on the global batch, the same on every rank, so the rules raise the same events on every rank.
Compiled models: create the monitor BEFORE the first call of the compiled model. Compiled code does not see hooks
registered after it was compiled; the monitor then records only the weight-side quantities and warns once. With a
compiled model the hooks stay attached for the monitor's whole life (adding/removing them would force
recompiles); dynamo runs them with graph breaks, so a monitored compiled step is slower than an unmonitored one.
"""

from __future__ import annotations

import csv
import io
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from normlab._checks import check_number
from normlab._files import atomic_write
from normlab.monitor import stats
from normlab.monitor.hooks import (
    ActivationMoments,
    StepStats,
    activation_moments,
    grad_norm,
    grad_norm_tensor,
    read_back,
)
from normlab.monitor.layers import (
    check_sharding,
    filter_kernel,
    input_channels,
    is_compiled,
    layer_type,
    supported_layers,
    unwatched_layers,
    unwrap_model,
)
from normlab.monitor.log import write_monitor_log
from normlab.monitor.optim_step import is_adaptive, learning_rates, step_hooks
from normlab.monitor.options import RecordOptions, RecordSchedule, check_sink
from normlab.monitor.probes import Probe, ProbeSet
from normlab.monitor.ranks import Ranks, is_dtensor
from normlab.monitor.records import LayerRecord, NormRecord
from normlab.monitor.rules import DEFAULT_RULES, Event, Rule, StepContext, check_rules, context_from_records
from normlab.monitor.rules.regime import layer_learning_rates
from normlab.monitor.spp import signal_propagation

__all__ = ["VarianceMonitor"]


def _check_args(model, recording) -> RecordOptions:
    """Refuse a model that is no nn.Module and ``recording`` that is no RecordOptions, in one line."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"VarianceMonitor: model must be an nn.Module, got {type(model).__name__}")
    if recording is None:
        return RecordOptions()
    if not isinstance(recording, RecordOptions):
        raise TypeError(f"VarianceMonitor: recording must be None or a RecordOptions, got {type(recording).__name__}")
    return recording


def _keys(state) -> str:
    """A state's type and first keys, for an error message."""
    keys = sorted(map(str, state))[:8] if isinstance(state, Mapping) else []
    return f"{type(state).__name__} with keys {keys}"


def _check_rules(rules) -> list[Rule]:
    """The rules as a list: each with ``check``, ``state_dict`` and ``load_state_dict``, their names unique."""
    if isinstance(rules, Rule) or isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(f"VarianceMonitor: rules must be a list of Rule instances, got {type(rules).__name__}")
    out = list(rules)
    for rule in out:
        if isinstance(rule, type) or not all(callable(getattr(rule, m, None)) for m in ("check", "state_dict")):
            raise TypeError(f"VarianceMonitor: rules must be Rule instances (normlab.monitor.rules), got {rule!r}")
    names = [getattr(rule, "name", type(rule).__name__) for rule in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"VarianceMonitor: rule names must be unique (their state is kept by name): {twice} twice")
    return out


def _probe_set(model: nn.Module, probes, rules: Sequence[Rule]) -> ProbeSet | None:
    """The monitor's :class:`~normlab.monitor.probes.ProbeSet` from its ``probes`` argument, or None."""
    if probes is None:
        probes = any(getattr(r, "needs_probes", False) for r in rules)
    if probes is True:
        return ProbeSet(model)
    if probes is False:
        return None
    if isinstance(probes, Probe) or not isinstance(probes, Sequence):
        raise ValueError(
            f"VarianceMonitor: probes must be None, True, False or a list of Probe, got {type(probes).__name__}"
        )
    return ProbeSet(model, probes) if probes else None


def _warn_recurrent(unwatched: list[tuple[str, nn.Module]]) -> None:
    """Warn once, in one line naming them, when recurrent layers are among the modules no record reads."""
    recurrent = [f"'{name}' ({type(mod).__name__})" for name, mod in unwatched if isinstance(mod, nn.RNNBase)]
    if recurrent:
        warnings.warn(
            f"VarianceMonitor: recurrent layers are not watched: {', '.join(recurrent)}; the records and rules read "
            "only the conv/linear and normalization layers around them (mon.unwatched lists every module no "
            "record reads)",
            stacklevel=3,
        )


class VarianceMonitor:
    """Record variance-transmission statistics of every conv/linear (and norm) layer every ``every`` steps, and
    check rules on them.

    Args:
        model: any nn.Module (DDP/DataParallel and torch.compile wrappers are unwrapped).
        every: record on steps 0, every, 2*every, ... (int >= 1), or a :class:`~normlab.monitor.RecordSchedule`
            (e.g. ``RecordSchedule(every=10, dense_steps=200)``: also every step of the first 200). Default: 10.
        rules: the rules to check (:mod:`normlab.monitor.rules`), in the order their events are wanted; None (the
            default) for :func:`~normlab.monitor.DEFAULT_RULES` (the growth factors, the countdown), ``[]`` to
            record only. Rule names must be unique.
        probes: per-step scalars no layer record shows (:mod:`normlab.monitor.probes`: attention logits, residual
            stream, norm gains, output logits), measured on recorded steps only and passed to the rules as
            ``ctx.probes``: True for :func:`~normlab.monitor.probes.DEFAULT_PROBES`, a list of
            :class:`~normlab.monitor.probes.Probe` s, False for none; None (the default): the default probes when
            a rule reads them (``Rule.needs_probes``: the transformer rules), else none, so that the default
            rules pay nothing for them.
        optimizer: the optimizer the monitor follows: its own ``optimizer.step()`` is a monitor step (its step
            hooks record around the update: :mod:`normlab.monitor.optim_step`), so the usual loop
            ``loss.backward(); opt.step()`` needs nothing else; with a GradScaler, step through
            :func:`~normlab.monitor.scaler_step` so that a step the scaler skips is counted as a step without an
            update. Without an optimizer the monitor sees no training step (it can still compute
            :meth:`add_signal_propagation`).
        recording: which layers and forwards are recorded, a :class:`~normlab.monitor.RecordOptions`
            (``include_norm``, ``record_eval``); None for the defaults (conv/linear and normalization layers,
            training forwards only).

    Where the records and events go besides ``mon.records`` and ``mon.events``: :meth:`add_sink` (TensorBoard, a
    callback per event).

    Attributes:
        records: the per-layer records of the recorded steps.
        events: the :class:`~normlab.monitor.Event` s raised so far, in order (each rule's first);
            :attr:`alarm` is the first of severity ``"alarm"``, :attr:`warning` the first ``"warning"``.
        history: every event ever raised, in order: those of the steps a rollback threw away (a
            :class:`~normlab.monitor.CollapseGuard` restored the monitor's state from before them) stay here,
            marked ``rolled_back``, while :attr:`events` follows the run's current trajectory.
        schedule: the :class:`~normlab.monitor.RecordSchedule` (``every`` as given, or made from the int).
        recording: the :class:`~normlab.monitor.RecordOptions`.
        sinks: the sinks of :meth:`add_sink`, by handle id, in the order they were added.
        layers: ``(name, module, kind)`` of every watched layer (:func:`~normlab.monitor.supported_layers`).
        unwatched: ``(name, module)`` of every module with parameters of its own that no record reads
            (:func:`~normlab.monitor.unwatched_layers`: embeddings, recurrent layers, ...); the monitor warns
            once, naming them, when a recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) is among them.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mon = VarianceMonitor(model, every=1, optimizer=opt)
        >>> model(torch.randn(16, 4)).square().mean().backward()
        >>> opt.step()                       # records step 0 through the optimizer's hooks
        >>> mon.current_step, sorted({r["layer"] for r in mon.records}), [r.name for r in mon.rules]
        (1, ['0', '2'], ['factor', 'countdown'])
    """

    def __init__(
        self,
        model: nn.Module,
        every: int | RecordSchedule = 10,
        rules: Sequence[Rule] | None = None,
        *,
        probes: bool | Sequence[Probe] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        recording: RecordOptions | None = None,
    ) -> None:
        self.recording = _check_args(model, recording)
        self.schedule = RecordSchedule.of(every)
        self.model = unwrap_model(model)
        self.compiled = is_compiled(model)
        self.rules: list[Rule] = DEFAULT_RULES() if rules is None else _check_rules(rules)
        self.probes = _probe_set(self.model, probes, self.rules)
        self.sinks: OrderedDict[int, object] = OrderedDict()  # add_sink's, by handle id
        self._probe_cache: dict[str, float] = {}
        self.events: list[Event] = []
        self.history: list[Event] = []
        self._fired: set[str] = set()
        self._grad_norm: float | None = None
        self._loss = None  # this step's loss (a float or a tensor, read back only when a rule is checked)
        self.layers = supported_layers(self.model, include_norm=self.recording.include_norm)
        if not self.layers:
            raise ValueError(
                f"VarianceMonitor: model {type(self.model).__name__} has no supported layers "
                "(expected a module matched by normlab.monitor.layers.LINEAR_MAP_RULES - nn.Conv*d, "
                "nn.ConvTranspose*d, nn.Linear, transformers' Conv1D - or a normalization layer)"
            )
        self._record_eval = self.recording.record_eval  # read by every hook call
        self._params = [p for _name, mod, _kind in self.layers for p in mod.parameters()]  # the ranks, the device
        for name, mod, kind in self.layers:
            if kind != "norm":
                check_sharding(mod, f"VarianceMonitor: layer '{name}' ({type(mod).__name__})")
        self.ranks = Ranks.of(model, self._params)  # the ranks each record is merged over (normlab.monitor.ranks)
        self.unwatched = unwatched_layers(self.model, include_norm=self.recording.include_norm)  # after FSDP1's refusal
        _warn_recurrent(self.unwatched)
        self._sharded = any(is_dtensor(p) for p in self._params)
        self._step = 0
        self._mode: str | None = None  # the current step's hooks: "record", "light" or None (set by _sync_hooks)
        self.records: list[LayerRecord | NormRecord] = []
        self.spp: dict | None = None
        self.closed = False
        self._order: dict[str, int] = {}
        self._pending: dict[str, ActivationMoments] = {}  # this recorded forward's moments, per layer
        self._light: dict[str, tuple] = {}  # output moments of a light step, merged and read back in _after_step
        self._light_grad: Tensor | None = None
        self._scale_free: dict[str, float] = {}  # shift_scale_free of the last full record (the level rule reads it)
        self._handles: list = []
        self._hooked: str | None = None  # the layers hooked now: "all", "maps" (conv/linear) or None
        self._warned_compiled = False
        self._before: dict[str, Tensor] | None = None
        self.optimizer = None
        self._step_handle = None
        if optimizer is not None:
            self._attach(optimizer)
        self._sync_hooks()

    @property
    def every(self) -> int:
        """The recording interval after the schedule's dense start (``schedule.every``)."""
        return self.schedule.every

    def add_sink(self, sink) -> RemovableHandle:
        """Send what the monitor keeps somewhere else too: ``sink`` is a callable, called with every event kept in
        :attr:`events`, or an object with ``write_records(step_records, mean_updates)`` (called on every recorded
        step with its records and each conv/linear layer's per-filter mean updates) and/or ``write_event(event)``;
        its ``close()``, if any, is called by :meth:`close`.

        Returns a handle whose ``remove()`` detaches the sink (as torch's hooks).

        Example:
            >>> mon = VarianceMonitor(nn.Linear(2, 2), every=1)
            >>> handle = mon.add_sink(print)             # every event, as it is raised
            >>> handle.remove()
            >>> # TensorBoard: mon.add_sink(MonitorBoard("runs/tb")) (normlab.integrations.tensorboard)
        """
        check_sink(sink)
        handle = RemovableHandle(self.sinks)
        self.sinks[handle.id] = sink
        return handle

    def _to_sinks(self, method: str, *args) -> None:
        for sink in list(self.sinks.values()):
            write = getattr(sink, method, None)
            if callable(write):
                write(*args)
            elif method == "write_event" and callable(sink) and not hasattr(sink, "write_records"):
                sink(*args)

    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"VarianceMonitor: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self._step_handle = step_hooks(optimizer).add(0, self._before_step, self._after_step)

    def observe_loss(self, loss) -> None:
        """The training loss of the coming optimizer step (a tensor, read back only on a step where a rule that reads
        it is checked, or a number), for the loss rules (``ctx.loss``) and the guard attached to the same optimizer.
        Several calls before one step add up (gradient accumulation: each micro-batch's loss as it enters
        backward).

        Example:
            >>> model = nn.Linear(4, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> mon = VarianceMonitor(model, every=1, optimizer=opt)
            >>> loss = model(torch.randn(8, 4)).square().mean()
            >>> loss.backward(); mon.observe_loss(loss); opt.step()
            >>> mon.current_step
            1
        """
        if self.optimizer is None:
            raise RuntimeError(
                "VarianceMonitor.observe_loss: the monitor follows no optimizer; make it with "
                "VarianceMonitor(model, optimizer=opt)"
            )
        step_hooks(self.optimizer).observe_loss(loss)

    # ----------------------------------------------------------------- hooks
    @property
    def current_step(self) -> int:
        """The number of optimizer steps the monitor has seen; set it to resume at another step (the hooks follow)."""
        return self._step

    @current_step.setter
    def current_step(self, step: int) -> None:
        self._step = step
        self._sync_hooks()

    @property
    def is_recording(self) -> bool:
        """True when the current step (forward + ``step``) is recorded."""
        step = self.current_step
        return not self.closed and self.schedule.is_due(step)

    @property
    def is_light(self) -> bool:
        """True when the current step is not recorded but a rule checked on every step needs a record key of it
        (``Rule.light_keys``: the countdown's output variance): its forward keeps only
        each conv/linear layer's output variance, read back in one transfer."""
        return not self.closed and not self.is_recording and self._light_rules

    @property
    def _light_rules(self) -> bool:
        return any(r.every_step and "output_var" in r.light_keys for r in self.rules)

    def _checks_step(self) -> bool:
        """Rules are checked at the current step (a recording step, or a rule checked on every step)."""
        return not self.closed and (self.is_recording or any(r.every_step for r in self.rules))

    def _needs_grad_norm(self) -> bool:
        recording = self.is_recording
        return not self.closed and any(r.needs_grad_norm and (r.every_step or recording) for r in self.rules)

    @property
    def alarm(self) -> Event | None:
        """The first event of severity ``"alarm"`` (None while no rule raised one)."""
        return next((e for e in self.events if e.severity == "alarm"), None)

    @property
    def warning(self) -> Event | None:
        """The first event of severity ``"warning"`` (None while no rule raised one)."""
        return next((e for e in self.events if e.severity == "warning"), None)

    @property
    def should_stop(self) -> bool:
        """True once an alarm has fired (the training loop may stop and keep its last checkpoint)."""
        return self.alarm is not None

    def _sync_hooks(self) -> None:
        """Set this step's mode (what the forward hooks keep) and attach or remove the hooks to match it."""
        recording = self.is_recording
        self._mode = "record" if recording else ("light" if self.is_light else None)
        if self.probes is not None:  # probes run on recorded steps only: started before the forward
            if recording:
                self.probes.start()
            else:
                self.probes.stop()
        # which layers are hooked: all of them on a recording step (and always on a compiled model), the
        # conv/linear layers on a light step (the norm layers' hooks would keep nothing there), none otherwise
        if self.closed:
            want = None
        elif self.compiled or self._mode == "record":
            want = "all"
        else:
            want = "maps" if self._mode == "light" else None
        if want != self._hooked:
            self._remove_hooks()
            for name, mod, kind in self.layers:
                if want == "all" or (want == "maps" and kind != "norm"):
                    self._handles.append(mod.register_forward_hook(self._make_hook(name, mod, kind)))
            self._hooked = want

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._hooked = [], None

    def _make_hook(self, name: str, target: nn.Module, kind: str):
        def hook(module: nn.Module, args, output) -> None:
            # `module is not target`: a deepcopy of the model (EMA copy, signal_propagation) carries the hook too
            if module is not target or name in self._pending or name in self._light:
                return
            if not (module.training or self._record_eval):
                return
            mode = self._mode
            if mode == "record":
                with torch.no_grad():
                    self._pending[name] = activation_moments(module, kind, args, output)
            elif kind != "norm" and mode == "light":  # the countdown tests conv/linear outputs only
                if isinstance(output, Tensor) and output.numel() > 0:
                    with torch.no_grad():
                        self._light[name] = (output.numel(), *stats.output_moments(output))
            else:
                return
            if name not in self._order:
                self._order[name] = len(self._order)

        return hook

    # ------------------------------------------------------------------ step
    def _before_step(self) -> None:
        """Right before the optimizer's update (its step pre-hook, after the backward): on a recording step snapshot
        the effective kernels, and measure the gradient norm when a due rule reads it."""
        self._before = None
        if self._needs_grad_norm():
            if self.is_recording:
                self._grad_norm = grad_norm(self.model)
            else:
                norm = grad_norm_tensor(self.model)  # no gradient: 0.0, as grad_norm gives the full path
                self._light_grad = torch.zeros(()) if norm is None else norm
        if self.is_recording:
            self._before = {name: filter_kernel(m).clone() for name, m, kind in self.layers if kind != "norm"}

    def _after_step(self, stepped: bool, loss=None) -> None:
        """Right after the optimizer's update (its step post-hook), or for a step a GradScaler skipped (``stepped``
        False): on a recording step write the step's records (update ratios against the :meth:`_before_step`
        snapshot); then check the rules due at this step and advance the step counter. ``loss``: the step's observed
        loss."""
        self._loss = loss
        skipped = not stepped
        if self.is_recording:
            self._probe_cache = self.probes.stop() if self.probes is not None else {}
            before, self._before = self._before, None
            if before is None:  # no snapshot: weight statistics of the current kernels, no update ratios
                before, stepped = {n: filter_kernel(m).clone() for n, m, k in self.layers if k != "norm"}, False
            self._finalize(before, stepped, skipped)
        elif self._checks_step():
            self._light_check(skipped)
        self._loss, self._grad_norm, self._light_grad = None, None, None
        self.current_step += 1  # syncs the hooks

    def _indices(self) -> dict[str, int]:
        """Each layer's forward-order index; a layer not run in a recorded forward is ordered after those that ran."""
        out, next_index = {}, len(self._order)
        for name, _mod, _kind in self.layers:
            if name in self._order:
                out[name] = self._order[name]
            else:
                out[name], next_index = next_index, next_index + 1
        return out

    def _context(self, step_records: list[dict], recorded: bool, grad_norm: float | None, skipped: bool) -> StepContext:
        """The rules' view of this step: loss, gradient norm, learning rates, forward order and exemptions
        (:func:`~normlab.monitor.rules.context_from_records`)."""
        loss = self._loss if any(r.needs_loss and (r.every_step or recorded) for r in self.rules) else None
        if isinstance(loss, Tensor):
            loss = float(loss.detach())
        opt = self.optimizer
        return context_from_records(
            self.current_step,
            step_records,
            layer_order=tuple(sorted(self._order, key=self._order.get)),
            loss=None if loss is None else float(loss),
            grad_norm=grad_norm,
            lrs=learning_rates(opt),
            skipped=skipped,
            probes=self._probe_values(),
            recorded=recorded,
            layer_lrs=layer_learning_rates(self.layers, opt) if recorded and opt is not None else {},
            adaptive=is_adaptive(opt),
        )

    def _probe_values(self) -> dict[str, float]:
        """The probes' values of this step for ``ctx.probes`` (recorded steps; empty on the others)."""
        values, self._probe_cache = self._probe_cache, {}
        return values

    def _check(self, ctx: StepContext, step_records: list[dict]) -> None:
        """Check the rules due at this step; keep each rule's first event and send it to the sinks."""
        for event in check_rules(self.rules, ctx, step_records, self._fired):
            self.events.append(event)
            self.history.append(event)
            self._to_sinks("write_event", event)

    def _step_stats(self, recorded: bool) -> StepStats:
        """This step's :class:`~normlab.monitor.hooks.StepStats` over the model's ranks, with the loss when a rule due
        now reads it: on several ranks the rules read the mean of the ranks' losses, merged with the records."""
        if recorded and not self._sharded and self.ranks.size == 1:
            self._refuse_late_sharding()
        device = self._params[0].device if self._params else None
        step = StepStats(self.ranks, device)
        if self.ranks.size > 1 and any(r.needs_loss and (r.every_step or recorded) for r in self.rules):
            loss = self._loss.detach() if isinstance(self._loss, Tensor) else self._loss
            step.add_mean("loss", loss)
        return step

    def _refuse_late_sharding(self) -> None:
        """A model sharded (FSDP2) after the monitor was made would be recorded per rank: refuse it in one line."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        late = next((n for n, m, _k in self.layers if any(is_dtensor(p) for p in m.parameters())), None)
        if late is not None:
            raise RuntimeError(
                f"VarianceMonitor: layer '{late}' was sharded (its parameters became DTensors) after the monitor was "
                "made, so its records would not be merged over the ranks: create VarianceMonitor after fully_shard"
            )

    def _merged_loss(self, scalars: dict[str, float]) -> None:
        if "loss" in scalars:
            self._loss = scalars["loss"]

    @torch.no_grad()
    def _light_check(self, skipped: bool) -> None:
        """A step that records nothing: the rules checked on every step see its light records (each conv/linear
        layer's output variance, when one of them needs it; merged over the ranks) and its scalars; nothing is added
        to ``records``."""
        values, norm = self._light_merged() if self.ranks.size > 1 else self._light_local()
        self._light, self._light_grad = {}, None
        step_records = []
        if self._light_rules:
            indices = self._indices()
            for name, _mod, kind in self.layers:
                rec: dict = {"step": self.current_step, "layer": name, "index": indices[name], "kind": kind}
                if name in values:
                    rec["output_var"] = values[name]
                if name in self._scale_free:
                    rec["shift_scale_free"] = self._scale_free[name]
                step_records.append(rec)
            step_records.sort(key=lambda r: r["index"])
        self._check(self._context(step_records, False, norm, skipped), step_records)

    def _light_local(self) -> tuple[dict[str, float], float | None]:
        """One process: each measured layer's ``output_var`` (``M2 / count``) and the gradient norm, read back in one
        transfer: the values :class:`~normlab.monitor.hooks.StepStats` gives, without its merge and assembly."""
        light = self._light if self._light_rules else {}
        names = [name for name, _mod, kind in self.layers if kind != "norm" and name in light]
        values = [light[name][2] / light[name][0] for name in names]
        if self._light_grad is not None:  # measured on every rank alike (a rule due now reads it)
            values.append(self._light_grad)
        read = read_back(values)
        norm = read.pop() if self._light_grad is not None else None
        return dict(zip(names, read)), norm

    def _light_merged(self) -> tuple[dict[str, float], float | None]:
        """Several ranks: the light values merged over them in one collective (:class:`~normlab.monitor.hooks.
        StepStats`), with the loss when a rule due now reads it."""
        step = self._step_stats(recorded=False)
        for name, _mod, kind in self.layers:
            if kind != "norm" and self._light_rules:
                step.add_output(name, self._light.get(name))
        if self._light_grad is not None:
            step.add_mean("grad_norm", self._light_grad)
        values, _, scalars = step.finish()
        self._merged_loss(scalars)
        return {n: v["output_var"] for n, v in values.items() if "output_var" in v}, scalars.get("grad_norm")

    @torch.no_grad()
    def _finalize(self, before: dict[str, Tensor], stepped: bool, skipped: bool) -> None:
        """A recorded step: every watched layer's record, merged over the ranks in one collective and read back in one
        transfer (:class:`~normlab.monitor.hooks.StepStats`); then the rules."""
        step = self._step_stats(recorded=True)
        several = self.ranks.size > 1
        for name, mod, kind in self.layers:
            # on several ranks every rank sizes a layer's channel moments from the module (0: no per-channel keys)
            channels = (input_channels(mod, kind) or 0) if several else None
            step.add_activation(name, self._pending.get(name), channels)
            if kind != "norm":
                step.add_weights(name, before[name], filter_kernel(mod) if stepped else None)
        values, updates, scalars = step.finish()
        self._merged_loss(scalars)
        step_records = []
        indices = self._indices()
        for name, mod, kind in self.layers:
            rec: dict = {"step": self.current_step, "layer": name, "index": indices[name]}
            rec["type"] = layer_type(mod)
            rec["kind"] = kind
            rec.update(values[name])
            if kind != "norm":
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
        if self.sinks:
            self._to_sinks("write_records", step_records, updates)
        self._check(self._context(step_records, True, self._grad_norm, skipped), step_records)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """What decides future records and events, as plain Python types (safe for
        ``torch.load(weights_only=True)``): ``{"every", "dense", "current_step", "order", "rules", "events",
        "history"}`` (``rules``: each rule's ``state_dict`` by name). ``records`` are not included (export them with
        :meth:`to_jsonl`); the state is small and constant in the length of training."""
        return {
            "every": self.every,
            "dense": [self.schedule.dense_steps, self.schedule.dense_every],
            "current_step": self.current_step,
            "order": dict(self._order),
            "rules": {rule.name: rule.state_dict() for rule in self.rules},
            "events": [e.to_dict() for e in self.events],
            "history": [e.to_dict() for e in self.history],
            "fired": sorted(self._fired),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (e.g. when resuming training, or a rollback of the guard): step counter, forward
        order, each rule's state (a rule missing from the state starts fresh) and the events already raised (the sinks
        are not sent again for them). The history is never shortened: the events this monitor raised that the state
        does not hold (a rollback's) stay in :attr:`history`, marked ``rolled_back``.

        Raises ValueError when ``state`` is malformed, was made with another ``every``, names layers this model
        does not have, or a rule refuses its state."""
        if not isinstance(state, Mapping) or not {"every", "current_step", "rules"} <= set(state):
            raise ValueError(
                "VarianceMonitor.load_state_dict: expected a dict from VarianceMonitor.state_dict() with 'every', "
                f"'current_step' and 'rules', got {_keys(state)}"
            )
        saved = "every={}, dense_steps={}, dense_every={}".format(
            state["every"], *state.get("dense", [self.schedule.dense_steps, self.schedule.dense_every])
        )
        sc = self.schedule
        mine = f"every={sc.every}, dense_steps={sc.dense_steps}, dense_every={sc.dense_every}"
        if saved != mine:
            raise ValueError(
                f"VarianceMonitor.load_state_dict: state was recorded with {saved}, this monitor uses {mine}"
            )
        step = state["current_step"]
        check_number("VarianceMonitor.load_state_dict", "current_step", step, integer=True, low=0)
        names = {name for name, _, _ in self.layers}
        order = dict(state.get("order") or {})
        unknown = sorted(set(order) - names)
        if unknown:
            raise ValueError(
                f"VarianceMonitor.load_state_dict: state names layers this model does not have: {unknown[:5]}"
            )
        saved_rules = state["rules"]
        for rule in self.rules:
            if rule.name in saved_rules:
                rule.load_state_dict(saved_rules[rule.name])
            else:
                rule.reset()
        events = [Event.from_dict(e) for e in state.get("events", [])]
        self._keep_history([Event.from_dict(e) for e in state.get("history", [])], events)
        self.events = events
        self._fired = set(state.get("fired", [e.rule for e in self.events]))
        self._order = {str(k): int(v) for k, v in order.items()}
        self._pending, self._light, self._light_grad, self._grad_norm, self._loss = {}, {}, None, None, None
        self.current_step = step  # syncs the hooks

    def _keep_history(self, saved: list[Event], events: list[Event]) -> None:
        """The history after loading a state with ``saved`` history and ``events``: the longer of the saved one (a
        resume) and this monitor's own (a rollback to a state from before some of its events), with the events no
        longer in ``events`` marked rolled back."""
        if len(saved) > len(self.history):
            self.history = saved
        dropped = [e for e in self.events if e not in events]
        self.history = [replace(e, rolled_back=True) if e in dropped else e for e in self.history]

    # ---------------------------------------------------------------- extras
    def add_signal_propagation(self, input_shape: Sequence[int], **kwargs) -> dict:
        """Compute ``signal_propagation(model, input_shape, **kwargs)``, keep it in ``self.spp`` (exported by
        ``to_jsonl`` and plotted by ``normlab monitor``) and return it."""
        self.spp = signal_propagation(self.model, input_shape, **kwargs)
        return self.spp

    def to_jsonl(self, path: str | Path) -> Path:
        """Write the log: one JSON object per record (non-finite values as null), then one {"event": "rule", ...}
        per event and {"event": "spp", ...} if signal-propagation data was added
        (:func:`~normlab.monitor.log.write_monitor_log`; :func:`~normlab.monitor.log.load_log` reads it). The file is
        replaced atomically (a link at ``path`` is replaced, not followed)."""
        write_monitor_log(path, self.records, self.events, self.spp)
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
        self.closed, self._mode = True, None
        self._pending, self._light, self._light_grad = {}, {}, None
        self._remove_hooks()
        if self.probes is not None:
            self.probes.stop()
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None
        for sink in list(self.sinks.values()):
            if callable(getattr(sink, "close", None)):
                sink.close()

    def __enter__(self) -> VarianceMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"VarianceMonitor({type(self.model).__name__}, every={self.every}, layers={len(self.layers)}, "
            f"step={self.current_step}, records={len(self.records)}, events={len(self.events)})"
        )
