"""What defines a training run: :class:`TrainConfig`, the one source of the runner's defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from normlab.nn import CONV_KINDS, NORM_NAMES, comparison_names, resolve_comparison
from normlab.runner.data.datasets import DATASET_CLASSES, DATASET_DIMS, DATASETS, INPUT_SHAPES
from normlab.runner.errors import FieldError, UsageError
from normlab.runner.io import from_fields, json_line, to_jsonable
from normlab.runner.models import MODEL_DIMS, MODELS, build_model

__all__ = ["TrainConfig", "RESUME_FREE", "BRN_SCHEDULES", "resolve_device", "resolve_name"]

BRN_SCHEDULES = ("run", "paper")
# Fields that may differ between a run and its resumption: they do not change the results.
RESUME_FREE = ("num_workers", "data_dir", "device")
MAX_THREADS = 1024


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: cuda if available, else cpu; otherwise the named device, which must exist here."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device must be a torch device such as cpu, cuda, cuda:1 or auto, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda", "mps", "xpu"):
        raise UsageError(f"device must be cpu, cuda[:N] or auto, got {device!r}")
    return dev


def resolve_name(name: str, field: str = "norm", owner: str = "TrainConfig") -> tuple[str, str]:
    """``(norm, conv)`` of a comparison name such as ``bn``, ``pws`` or ``ws+gn``
    (:func:`normlab.nn.resolve_comparison`); an unknown name is a :class:`~normlab.runner.errors.FieldError` of
    ``owner``'s ``field`` listing the valid names."""
    try:
        return resolve_comparison(name)
    except ValueError:
        raise FieldError(
            owner,
            field,
            f"unknown comparison name {name!r}; valid names: "
            f"{', '.join(comparison_names())} or <conv>+<norm> (e.g. ws+gn)",
        ) from None


@dataclass
class TrainConfig:
    """Everything that defines one training run (SGD with momentum, cross-entropy, MultiStepLR).

    Fields: ``dataset``, ``model``, ``norm``/``conv`` (registry names), ``width``; optimisation ``lr``,
    ``batch_size`` (per process under DDP), ``epochs``, ``momentum``, ``weight_decay`` (not on norm parameters,
    biases and PWS alpha unless ``nowd_norm_alpha`` is False), ``milestones`` (epochs after which the lr is
    multiplied by ``lr_gamma``); ``seed``; ``data_dir``; ``device``; ``monitor_every`` (> 0 attaches a
    :class:`normlab.monitor.VarianceMonitor`) and ``stop_on_collapse``; ``target_acc`` (a test-accuracy fraction
    for ``epochs_to_target``); ``max_steps_per_epoch`` (quick runs); ``num_workers`` (accepted for compatibility:
    data sets are in-memory tensors); ``model_kwargs`` (``blocks``, ``channels`` for
    :func:`~normlab.runner.models.build_model`); ``brn_schedule``: ``"run"`` (the paper's BatchRenorm schedule
    compressed to reach its final limits halfway through the run) or ``"paper"`` (5k-step warm-up);
    ``conv_kwargs`` (extra arguments of every conv of kind ``conv``, e.g. ``{"gamma": 1e-2}`` for pws);
    ``num_samples`` (mnist1d: samples generated, default 25,000) and ``num_train`` (keep the first N training
    samples); ``evals_per_epoch`` (test evaluations per epoch, for curves); ``eval_train_mode`` (also evaluate with
    batch statistics at the training batch size, see :func:`~normlab.runner.training.evaluation.evaluate_train_mode`);
    ``monitor_dense_steps`` / ``monitor_dense_every`` (the monitor also records every ``monitor_dense_every``
    steps during the first ``monitor_dense_steps``); ``amp`` (mixed precision: bfloat16 autocast on CPU, float16
    autocast and a GradScaler on CUDA); ``guard`` (a :class:`normlab.monitor.CollapseGuard` at the library's
    defaults watches the optimizer's steps: on a failure of :mod:`normlab.monitor.collapse` in the training losses, a
    non-finite gradient, or the monitor's alarm once a failure confirms it, the run goes back to a snapshot from
    before the trouble with a lower learning rate; under DDP every rank rolls back together); ``guard_dead`` (with
    ``guard``: the guard knows chance, ln C, instead of estimating it by the first loss, so a monitor alarm on a
    network that never learned waits and is confirmed once the net is judged never to have learned; it rolls back
    slow learners too).
    """

    dataset: str = "digits"
    model: str = "plain"
    norm: str = "bn"
    conv: str = "conv"
    width: float = 1.0
    lr: float = 0.05
    batch_size: int = 64
    epochs: int = 10
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nowd_norm_alpha: bool = True
    milestones: tuple = ()
    lr_gamma: float = 0.1
    seed: int = 0
    data_dir: str | None = None
    device: str = "cpu"
    monitor_every: int = 0
    stop_on_collapse: bool = False
    target_acc: float | None = None
    max_steps_per_epoch: int | None = None
    num_workers: int = 0
    model_kwargs: dict = field(default_factory=dict)
    brn_schedule: str = "run"
    conv_kwargs: dict = field(default_factory=dict)
    num_samples: int | None = None
    num_train: int | None = None
    evals_per_epoch: int = 1
    eval_train_mode: bool = False
    monitor_dense_steps: int = 0
    monitor_dense_every: int = 1
    amp: bool = False
    guard: bool = False
    guard_dead: bool = False

    def __post_init__(self) -> None:
        self.milestones = tuple(self.milestones)

    def validate(self) -> TrainConfig:
        """Raise :class:`~normlab.runner.errors.FieldError` naming the field and what was expected; return self.

        The values it accepted are remembered (and travel with the config to worker processes and Ray tasks): a
        second call on the same values returns at once, so a config is checked once however many hands it passes
        through; a changed field is checked again.
        """
        seen = json_line(self.to_dict())
        if self.__dict__.get("_validated") == seen:
            return self
        self._check_names()
        self._check_numbers()
        self._check_options()
        self.__dict__["_validated"] = seen
        return self

    def _bad(self, name: str, expected: str) -> None:
        raise FieldError("TrainConfig", name, f"must be {expected}, got {getattr(self, name)!r}", sep=" ")

    def _check_names(self) -> None:
        for name, valid in (
            ("dataset", DATASETS),
            ("model", MODELS),
            ("norm", NORM_NAMES),
            ("conv", CONV_KINDS),
            ("brn_schedule", BRN_SCHEDULES),
        ):
            if getattr(self, name) not in valid:
                raise FieldError(
                    "TrainConfig", name, f"unknown {name} {getattr(self, name)!r}; valid names: {', '.join(valid)}"
                )
        if MODEL_DIMS[self.model] != DATASET_DIMS[self.dataset]:
            raise FieldError(
                "TrainConfig",
                "model",
                f"model {self.model!r} takes {MODEL_DIMS[self.model]}-D inputs "
                f"but dataset {self.dataset!r} has {DATASET_DIMS[self.dataset]}-D samples; 1-D models: "
                f"{', '.join(m for m, d in MODEL_DIMS.items() if d == 1)}",
            )

    def _check_numbers(self) -> None:
        for name in ("batch_size", "epochs"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                self._bad(name, "an integer >= 1")
        for name in ("lr", "lr_gamma"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                self._bad(name, "a finite number > 0")
        if not _is_number(self.width) or not 0 < self.width <= 64:
            self._bad("width", "a number in (0, 64]")
        for name in ("momentum", "weight_decay"):
            if not _is_number(getattr(self, name)) or getattr(self, name) < 0:
                self._bad(name, "a finite number >= 0")
        if self.momentum >= 1:
            self._bad("momentum", "a number in [0, 1)")
        if not _is_int(self.seed) or self.seed < 0:
            self._bad("seed", "an integer >= 0")

    def _check_options(self) -> None:
        if any(not _is_int(m) or m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            self._bad("milestones", "increasing epoch numbers >= 1")
        if not _is_int(self.monitor_every) or self.monitor_every < 0:
            self._bad("monitor_every", "an integer >= 0")
        if self.max_steps_per_epoch is not None and (
            not _is_int(self.max_steps_per_epoch) or self.max_steps_per_epoch < 1
        ):
            self._bad("max_steps_per_epoch", "None or an integer >= 1")
        if self.target_acc is not None and not (_is_number(self.target_acc) and 0.0 <= self.target_acc <= 1.0):
            self._bad("target_acc", "None or a fraction in [0, 1]")
        if not _is_int(self.num_workers) or self.num_workers < 0:
            self._bad("num_workers", "an integer >= 0")
        for name in ("amp", "guard", "guard_dead"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "True or False")
        if self.guard_dead and not self.guard:
            self._bad("guard_dead", "False unless guard is True (it changes what the guard counts as trouble)")
        for name in ("model_kwargs", "conv_kwargs"):
            if not isinstance(getattr(self, name), dict):
                self._bad(name, "a dict")
        for name in ("num_samples", "num_train"):
            if getattr(self, name) is not None and (not _is_int(getattr(self, name)) or getattr(self, name) < 1):
                self._bad(name, "None or an integer >= 1")
        for name, low in (("evals_per_epoch", 1), ("monitor_dense_steps", 0), ("monitor_dense_every", 1)):
            if not _is_int(getattr(self, name)) or getattr(self, name) < low:
                self._bad(name, f"an integer >= {low}")
        try:
            resolve_device(self.device)
        except UsageError as e:
            raise FieldError("TrainConfig", "device", str(e)) from None

    def make_model(self, norm_kwargs: dict | None = None) -> torch.nn.Module:
        """The model this config trains, for its data set's input shape and classes (He init from torch's RNG).

        ``norm_kwargs``: further arguments of every normalization layer (the trainer's BatchRenorm schedule).

        Example:
            >>> TrainConfig(dataset="mnist1d", model="plain1d", norm="bn", width=0.5).make_model()(
            ...     torch.randn(2, 1, 40)).shape
            torch.Size([2, 10])
        """
        shape = INPUT_SHAPES[self.dataset]
        return build_model(
            self.model,
            self.norm,
            self.conv,
            shape[0],
            DATASET_CLASSES[self.dataset],
            shape,
            self.width,
            norm_kwargs=norm_kwargs,
            conv_kwargs=self.conv_kwargs,
            **self.model_kwargs,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict`; unknown keys are refused (:func:`~normlab.runner.io.from_fields`)."""
        return from_fields(cls, d)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """``"field: saved -> now"`` for every result-changing field that differs from a saved :meth:`to_dict`
        (a field newer than the saved dict counts as saved with its default)."""
        now = self.to_dict()
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        out = []
        for k in sorted(set(saved) | set(now)):
            if k in RESUME_FREE or (k not in saved and now.get(k) == defaults.get(k, dataclasses.MISSING)):
                continue
            a, b = saved.get(k), now.get(k)
            same = math.isclose(a, b, rel_tol=1e-9) if _is_number(a) and _is_number(b) else a == b
            if not same:
                out.append(f"{k}: {a!r} -> {b!r}")
        return out
