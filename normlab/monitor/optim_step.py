"""One optimizer step, as the trainer, the Lightning callback and :class:`~normlab.monitor.CollapseGuard` take it:
through a GradScaler or not, with the monitor recording around it, and whether the scaler skipped it."""

from __future__ import annotations

import torch

__all__ = ["optimizer_step", "scaler_skipped", "learning_rates", "is_adaptive", "ADAPTIVE_STATE_KEYS"]

# per-parameter state of the optimizers that divide each coordinate's step by a running scale of its own gradients:
# Adam/AdamW/NAdam/RAdam (exp_avg_sq), Adamax (exp_inf), RMSprop/Adadelta (square_avg), Adagrad (sum)
ADAPTIVE_STATE_KEYS = ("exp_avg_sq", "exp_inf", "square_avg", "sum")
_ADAPTIVE_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)
_ADAPTIVE_CLASSES += (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.SparseAdam)


def scaler_skipped(scale_before: float | None, scale_after: float | None) -> bool:
    """Whether a GradScaler skipped the step between two reads of its scale: it lowers its scale exactly when it
    finds inf/nan gradients and skips the optimizer step. Unknown scales (None: no scaler) mean no skip.

    Example:
        >>> scaler_skipped(65536.0, 32768.0), scaler_skipped(65536.0, 65536.0), scaler_skipped(None, None)
        (True, False, False)
    """
    return scale_before is not None and scale_after is not None and scale_after < scale_before


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


def optimizer_step(optimizer: torch.optim.Optimizer, monitor=None, scaler=None, loss=None) -> bool:
    """Take one optimizer step: ``scaler.step(optimizer); scaler.update()`` with a GradScaler, else
    ``optimizer.step()``; with a :class:`~normlab.monitor.VarianceMonitor` it records around the step
    (``monitor.step(optimizer, loss=loss)``, or ``before_update``/``after_update`` around the scaler's step, told
    whether the scaler skipped it).

    Args:
        optimizer: the optimizer.
        monitor: a VarianceMonitor, or None.
        scaler: a ``torch.amp.GradScaler`` (the loss was scaled by it), or None.
        loss: the step's training loss for the monitor's rules (a float or a tensor), or None.

    Returns:
        True when the step was taken, False when the scaler skipped it.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> optimizer_step(opt)
        True
    """
    if scaler is None:
        if monitor is not None:
            monitor.step(optimizer) if loss is None else monitor.step(optimizer, loss=loss)
        else:
            optimizer.step()
        return True
    if monitor is not None:
        monitor.before_update(optimizer)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    skipped = scaler_skipped(scale, scaler.get_scale())
    if monitor is not None:
        monitor.after_update(stepped=not skipped) if loss is None else monitor.after_update(not skipped, loss=loss)
    return not skipped
