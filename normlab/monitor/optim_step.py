"""The one way the monitor and the guard see a training step: hooks on the optimizer's own ``step()``.

:class:`~normlab.monitor.VarianceMonitor` (``optimizer=opt``) and :class:`~normlab.monitor.CollapseGuard` attach to
the optimizer through :func:`step_hooks`: one :class:`StepHooks` per optimizer, holding torch's step pre- and
post-hooks, which call the monitor first and the guard after it. So the usual loop needs nothing else::

    mon = VarianceMonitor(model, optimizer=opt)
    guard = CollapseGuard(model, opt, mon)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        mon.observe_loss(loss)  # optional: the loss rules and the guard's failure tracker read it
        opt.step()              # records, checks the rules, and the guard watches

A step given a closure (``opt.step(closure)``: LBFGS, Lightning) is seen after the closure's first call (its
backward), and the closure's loss is the step's loss when none was observed. With a GradScaler,
:func:`~normlab.monitor.scaler_step` replaces ``scaler.step(opt); scaler.update()``: the monitor and the guard see
the step once the scaler has updated its scale, and a step the scaler skipped (inf/nan gradients: the optimizer's
``step()`` never ran) as a step without an update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "StepHooks",
    "step_hooks",
    "scaler_step",
    "learning_rates",
    "is_adaptive",
    "ADAPTIVE_STATE_KEYS",
]

# per-parameter state of the optimizers that divide each coordinate's step by a running scale of its own gradients:
# Adam/AdamW/NAdam/RAdam (exp_avg_sq), Adamax (exp_inf), RMSprop/Adadelta (square_avg), Adagrad (sum)
ADAPTIVE_STATE_KEYS = ("exp_avg_sq", "exp_inf", "square_avg", "sum")
_ADAPTIVE_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)
_ADAPTIVE_CLASSES += (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.SparseAdam)


def learning_rates(optimizer: torch.optim.Optimizer | None) -> tuple[float, ...]:
    """The learning rate of each parameter group (empty without an optimizer).

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> learning_rates(torch.optim.SGD(net.parameters(), lr=0.1))
        (0.1,)
    """
    return () if optimizer is None else tuple(float(g["lr"]) for g in optimizer.param_groups)


def is_adaptive(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer is adaptive: it scales each parameter's step by a running magnitude of that
    parameter's own gradients (Adam and its family, Adagrad, RMSprop), so its first steps move every weight by
    about the learning rate whatever the gradient's scale, unlike SGD.

    A torch.optim adaptive class, or (optimizers outside torch.optim: fused or 8-bit Adams) one of
    ``ADAPTIVE_STATE_KEYS`` in the per-parameter state, which the first step fills.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> is_adaptive(torch.optim.AdamW(net.parameters())), is_adaptive(torch.optim.SGD(net.parameters(), lr=0.1))
        (True, False)
    """
    if optimizer is None:
        return False
    if isinstance(optimizer, _ADAPTIVE_CLASSES):
        return True
    if type(optimizer).__module__.startswith("torch.optim."):  # torch.optim's own SGD, ASGD, ...: not adaptive
        return False
    return any(isinstance(st, dict) and any(k in st for k in ADAPTIVE_STATE_KEYS) for st in optimizer.state.values())


class StepHooks:
    """The hooks normlab puts on one optimizer's ``step()``, shared by what is attached to it (:func:`step_hooks`).

    Each listener gives a ``before()`` called once per step right before the update (after the backward) and an
    ``after(stepped, loss)`` called right after it (``stepped`` False: a GradScaler skipped the step); listeners of a
    lower ``order`` are called first (the monitor 0, the guard 1, so the guard sees the monitor's alarm of the step).

    Attributes:
        optimizer: the optimizer.
        steps: optimizer steps taken through the hooks (skipped ones not counted).
        loss: the loss observed for the coming step (:meth:`observe_loss`), or None.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> seen = []
        >>> handle = step_hooks(opt).add(0, lambda: seen.append("before"), lambda stepped, loss: seen.append(loss))
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> step_hooks(opt).observe_loss(0.5)
        >>> opt.step(); seen
        ['before', 0.5]
        >>> handle.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"step_hooks: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.steps = 0
        self.loss = None
        self._listeners: dict[int, tuple[int, Callable, Callable]] = {}
        self._next_id = 0
        self._handles: list = []
        self._deferred, self._stepped = False, False  # defer(): the step's ``after`` waits for finish()

    def add(self, order: int, before: Callable[[], None], after: Callable[[bool, object], None]):
        """Attach a listener; returns a handle whose ``remove()`` detaches it."""
        if not self._handles:
            opt = self.optimizer
            self._handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]
        key, self._next_id = self._next_id, self._next_id + 1
        self._listeners[key] = (order, before, after)
        return _Handle(self, key)

    def _remove(self, key: int) -> None:
        self._listeners.pop(key, None)
        if not self._listeners:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _ordered(self) -> list[tuple[int, Callable, Callable]]:
        return [v for _, v in sorted(self._listeners.items(), key=lambda kv: (kv[1][0], kv[0]))]

    def observe_loss(self, loss) -> None:
        """The training loss of the coming step (a tensor, kept on its device, or a number). Several calls before
        one step add up: pass each micro-batch's loss of a gradient accumulation as it enters backward."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        self.loss = loss if self.loss is None else self.loss + loss

    def _before(self) -> None:
        for _order, before, _after in self._ordered():
            before()

    def _pre(self, optimizer, args, kwargs):
        # args: (optimizer, *step's positional arguments), as torch's step wrapper passes them
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._before()
            return None
        called = [False]

        def seen_closure():
            out = closure()
            if not called[0]:
                called[0] = True
                if self.loss is None and isinstance(out, torch.Tensor | float):
                    self.observe_loss(out)
                self._before()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": seen_closure}
        return (args[0], seen_closure, *args[2:]), kwargs

    def _post(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self._deferred:
            self._stepped = True
        else:
            self._after(True)

    def defer(self) -> None:
        """Hold the coming step's ``after`` until :meth:`finish`: a GradScaler updates its scale after the optimizer's
        step, and the listeners (the guard's snapshot of the scaler) must see the updated one."""
        self._deferred, self._stepped = True, False

    def finish(self) -> bool:
        """End a deferred step: ``after`` for the step taken, or for a step not taken (the scaler skipped it);
        returns whether the optimizer stepped."""
        stepped, self._deferred, self._stepped = self._stepped, False, False
        self._after(stepped)
        return stepped

    def _after(self, stepped: bool) -> None:
        loss, self.loss = self.loss, None
        for _order, _before, after in self._ordered():
            after(stepped, loss)


class _Handle:
    def __init__(self, hooks: StepHooks, key: int) -> None:
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks._remove(self.key)


def step_hooks(optimizer: torch.optim.Optimizer) -> StepHooks:
    """The :class:`StepHooks` of ``optimizer`` (made on first use; one per optimizer, kept on it: it goes with the
    optimizer, and an optimizer's copy or pickle, which keeps only its defaults, state and groups, has none).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> step_hooks(opt) is step_hooks(opt)
        True
    """
    hooks = getattr(optimizer, _ATTRIBUTE, None)
    if hooks is None:
        hooks = StepHooks(optimizer)
        setattr(optimizer, _ATTRIBUTE, hooks)
    return hooks


_ATTRIBUTE = "_normlab_step_hooks"


def scaler_step(scaler, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer); scaler.update()`` for a ``torch.amp.GradScaler``, telling the monitor and the guard
    attached to ``optimizer`` when the scaler skipped the step (inf/nan gradients). No host read-back of its own:
    the scaler's ``step`` reads its inf flags already.

    Returns:
        True when the step was taken, False when the scaler skipped it.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> scaler.scale(net(torch.ones(1, 2)).sum() * float("inf")).backward()
        >>> scaler_step(scaler, opt)
        False
    """
    hooks = step_hooks(optimizer)
    hooks.defer()
    try:
        scaler.step(optimizer)
        scaler.update()
    except BaseException:
        hooks._deferred = False
        raise
    return hooks.finish()
