"""What :class:`~normlab.monitor.CollapseGuard` gathers between two checks, and the one read that brings it home.

Each optimizer step leaves one entry: the step, its loss (a tensor kept on its device, or a number the loop already
read) and its non-finite-gradient flag (a 0-dim tensor computed on the device before the update; under FSDP2 over the
rank's own gradient shards). Nothing is read back until the guard checks: then ``StepLog.read`` stacks the entries
into one tensor and reads it in one transfer. On several ranks (DDP, FSDP2) the ranks exchange their entries and their
new monitor alarms in one ``all_gather`` of that tensor, on every rank at the same step (the guard's checks follow its
step counter, which the shared decisions keep equal), so every rank sees the same losses (the mean over the ranks;
non-finite if any rank's is), the same flags (any rank's) and the same earliest alarm, and decides the same. Each
rank keeps its own alarm's words; the others name the rank.

Example:
    >>> log = StepLog()
    >>> log.add(0, torch.tensor(2.3), torch.tensor(True))  # step 0: loss 2.3, every gradient finite
    >>> log.add(1, float("nan"), None)
    >>> seen = log.read(alarm=None)
    >>> seen.steps, [round(v, 2) for v in seen.losses[:1]], seen.bad_grads, seen.alarm
    ([0, 1], [2.3], [False, False], None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StepLog", "Seen", "world_size"]


def world_size() -> int:
    """The number of ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass
class Seen:
    """What a check found, the same on every rank.

    Attributes:
        steps: the steps since the last check, in order.
        losses: each step's loss (the ranks' mean; NaN if non-finite on a rank; None: no rank observed one).
        bad_grads: each step had a non-finite gradient (on some rank).
        alarm: ``(step, words)`` of the earliest new monitor alarm on any rank, or None.
    """

    steps: list[int]
    losses: list[float | None]
    bad_grads: list[bool]
    alarm: tuple[int, str] | None


class StepLog:
    """The entries of the steps since the last check (module docstring)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, object, object]] = []

    def add(self, step: int, loss, grads_finite) -> None:
        """Keep step ``step``'s loss (tensor, number or None) and finite-gradient flag (0-dim tensor, bool or None)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(()).clone()  # device-side copy: no read-back
        self.entries.append((step, loss, grads_finite))

    def clear(self) -> None:
        self.entries = []

    def _local(self, alarm_step: int | None) -> torch.Tensor:
        """This rank's entries as one float64 vector ``[loss, has_loss, bad_grad] * n + [alarm_step or -1]``,
        on the device of its tensors (read back by the caller in one transfer)."""
        device = next((x.device for e in self.entries for x in e[1:] if isinstance(x, torch.Tensor)), None)
        device = torch.device("cpu") if device is None else device
        parts = []
        for _step, loss, ok in self.entries:
            has = loss is not None
            value = loss if isinstance(loss, torch.Tensor) else float("nan" if loss is None else loss)
            bad = (~ok) if isinstance(ok, torch.Tensor) else (ok is not None and not ok)
            parts += [_scalar(value, device), _scalar(1.0 if has else 0.0, device), _scalar(bad, device)]
        parts.append(_scalar(-1.0 if alarm_step is None else float(alarm_step), device))
        return torch.stack(parts)

    def read(self, alarm: tuple[int, str] | None) -> Seen:
        """Read the entries (one transfer; under DDP one ``all_gather`` first) and forget them. ``alarm``: this
        rank's new monitor alarm as ``(step, words)``, or None."""
        vec = self._local(None if alarm is None else alarm[0])
        world = world_size()
        if world > 1:
            vec = vec.to(_collective_device())  # the same device on every rank, whatever its entries hold
            out = torch.empty(world * vec.numel(), dtype=vec.dtype, device=vec.device)
            dist.all_gather_single(out, vec)
            rows = out.reshape(world, -1).tolist()
        else:
            rows = [vec.tolist()]
        steps = [e[0] for e in self.entries]
        self.clear()
        return _combine(steps, rows, alarm)


def _collective_device() -> torch.device:
    """Where the check's ``all_gather`` runs: the CPU under a gloo backend (alone or beside another), else this
    rank's current accelerator (NCCL and its kin). Never chosen from the entries: a rank whose log holds only numbers
    must gather on the same device, with the same backend, as one whose log holds device tensors."""
    if "gloo" in str(dist.get_backend()) or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _scalar(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _combine(steps: list[int], rows: list[list[float]], alarm: tuple[int, str] | None) -> Seen:
    """The ranks' rows as one :class:`Seen`: mean losses, any bad flag, the earliest alarm."""
    losses, bad = [], []
    for i in range(len(steps)):
        values = [r[3 * i] for r in rows if r[3 * i + 1] > 0]
        if not values:
            losses.append(None)
        elif all(math.isfinite(v) for v in values):
            losses.append(math.fsum(values) / len(values))
        else:
            losses.append(math.nan)
        bad.append(any(r[3 * i + 2] > 0 for r in rows))
    alarms = [(int(r[-1]), rank) for rank, r in enumerate(rows) if r[-1] >= 0]
    first = None
    if alarms:
        step, rank = min(alarms)
        own = alarm is not None and alarm[0] == step
        first = (step, alarm[1] if own else f"collapse warning at step {step} on rank {rank}")
    return Seen(steps, losses, bad, first)
