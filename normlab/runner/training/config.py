"""What defines a training run: :class:`TrainConfig`, the one source of the runner's defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from normlab._checks import is_int, is_number, number_problem
from normlab.nn import CONV_KINDS, NORM_NAMES, comparison_names, resolve_comparison
from normlab.runner.data.datasets import DATASET_CLASSES, DATASET_DIMS, INPUT_SHAPES
from normlab.runner.errors import FieldError, UsageError
from normlab.runner.factories import is_builtin, resolve
from normlab.runner.io import from_fields, json_line, to_jsonable
from normlab.runner.models import MAX_WIDTH, MODEL_DIMS, MODELS, build_model

__all__ = ["TrainConfig", "GROUPS", "RESUME_FREE", "BRN_SCHEDULES", "STOP_ON", "resolve_device", "resolve_name"]

BRN_SCHEDULES = ("run", "paper")
#: The values of ``stop_on``, what stops a run before its last epoch (see :class:`TrainConfig`).
STOP_ON = ("non_finite", "confirmed", "alarm")
# Fields that may differ between a run and its resumption: they do not change the results.
RESUME_FREE = ("data_dir", "device")
MAX_THREADS = 1024


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


#: The fields of a :class:`TrainConfig` by what they decide, each in exactly one group. A config stays one flat
#: record, so its JSON, a grid's shared options and a resume check compare it field by field.
GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("dataset", "data_dir", "num_samples", "num_train"),
    "model": ("model", "norm", "conv", "width", "model_kwargs", "conv_kwargs", "brn_schedule"),
    "task": ("loss", "metric"),
    "optimization": (
        "lr",
        "batch_size",
        "epochs",
        "momentum",
        "weight_decay",
        "nowd_norm_alpha",
        "milestones",
        "lr_gamma",
        "max_steps_per_epoch",
        "amp",
        "seed",
        "device",
    ),
    "evaluation": ("evals_per_epoch", "eval_train_mode", "target_acc"),
    "monitoring": ("monitor_every", "monitor_dense_steps", "monitor_dense_every", "stop_on", "guard", "guard_dead"),
}


@dataclass
class TrainConfig:
    """Everything that defines one training run (SGD with momentum, a MultiStepLR schedule, a loss and a metric).

    The fields, by group (:data:`GROUPS`):

    - *data*: ``dataset``, a data set by name (:func:`normlab.runner.factories.resolve`): ``digits``, ``mnist1d``,
      ``cifar10`` or a data factory ``pkg.module:function`` (:mod:`normlab.runner.data.user`); ``data_dir``
      (cifar10: the python batches; mnist1d: the cache of the generated arrays); ``num_samples`` (mnist1d: samples
      generated, default 25,000); ``num_train`` (keep the first N training samples).
    - *model*: ``model``, a model by name: ``plain``, ``plain1d``, ``resnet``, ``resnet_pws``, ``cnn1d``,
      ``timm:NAME``, ``torchvision:NAME`` or a model factory ``pkg.module:function``
      (:mod:`normlab.runner.training.setup`); ``norm``, ``conv`` (names of :func:`normlab.nn.create_norm` and
      :func:`normlab.nn.create_conv`; a factory's model gets them by :func:`~normlab.runner.training.norms.put_norm`);
      ``width`` (channel multiplier of the built-in models, in (0, :data:`~normlab.runner.models.MAX_WIDTH`]);
      ``model_kwargs`` (further arguments of the model: ``blocks``, ``channels`` of the built-in ones, anything a
      factory takes); ``conv_kwargs`` (arguments of every conv of kind ``conv``, ``{"gamma": 1e-2}`` for pws);
      ``brn_schedule`` (``"run"``, the paper's BatchRenorm schedule compressed to reach its final limits halfway
      through the run, or ``"paper"``, a 5k-step warm-up).
    - *task*: ``loss`` (``cross_entropy``, ``mse`` or ``pkg.module:function``) and ``metric`` (``accuracy``,
      ``none`` or ``pkg.module:function``; :mod:`normlab.runner.training.task`). The summary's ``*_acc`` values are
      the metric's (accuracy unless ``metric`` names another).
    - *optimization*: ``lr``, ``batch_size`` (per process under DDP), ``epochs``, ``momentum``, ``weight_decay``
      (not on norm parameters, biases and PWS alpha unless ``nowd_norm_alpha`` is False), ``milestones`` (epochs
      after which the lr is multiplied by ``lr_gamma``), ``max_steps_per_epoch`` (quick runs), ``amp`` (mixed
      precision: bfloat16 autocast on CPU, float16 autocast and a GradScaler on CUDA), ``seed``, ``device``.
    - *evaluation*: ``evals_per_epoch`` (test evaluations per epoch, for curves), ``eval_train_mode`` (also
      evaluate with batch statistics at the training batch size,
      :func:`~normlab.runner.training.evaluation.evaluate_train_mode`), ``target_acc`` (a metric value for
      ``epochs_to_target``).
    - *monitoring*: ``monitor_every`` (> 0 attaches a :class:`normlab.monitor.VarianceMonitor` recording every N
      steps, and every ``monitor_dense_every`` steps during the first ``monitor_dense_steps``); ``stop_on``, what
      stops a run before its last epoch (:data:`STOP_ON`): ``"non_finite"`` (a non-finite loss; always),
      ``"confirmed"`` (also a monitor alarm confirmed by a failure of :mod:`normlab.monitor.collapse` in the
      training losses: an explosion, a return to chance), ``"alarm"`` (also the monitor's alarm alone); ``guard`` (a
      :class:`normlab.monitor.CollapseGuard` at the library's defaults watches the optimizer's steps: on a failure
      of :mod:`normlab.monitor.collapse` in the training losses, a non-finite gradient, or the monitor's alarm once
      a failure confirms it, the run goes back to a snapshot from before the trouble with a lower learning rate;
      under DDP every rank rolls back together); ``guard_dead`` (with ``guard``: the guard knows chance, the task's
      chance loss, instead of estimating it by the first loss, so a monitor alarm on a network that never learned
      is confirmed once the net is judged never to have learned; it rolls back slow learners too).
    """

    # -- data
    dataset: str = "digits"
    data_dir: str | None = None
    num_samples: int | None = None
    num_train: int | None = None
    # -- model
    model: str = "plain"
    norm: str = "bn"
    conv: str = "conv"
    width: float = 1.0
    model_kwargs: dict = field(default_factory=dict)
    conv_kwargs: dict = field(default_factory=dict)
    brn_schedule: str = "run"
    # -- task
    loss: str = "cross_entropy"
    metric: str = "accuracy"
    # -- optimization
    lr: float = 0.05
    batch_size: int = 64
    epochs: int = 10
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nowd_norm_alpha: bool = True
    milestones: tuple = ()
    lr_gamma: float = 0.1
    max_steps_per_epoch: int | None = None
    amp: bool = False
    seed: int = 0
    device: str = "cpu"
    # -- evaluation
    evals_per_epoch: int = 1
    eval_train_mode: bool = False
    target_acc: float | None = None
    # -- monitoring
    monitor_every: int = 0
    monitor_dense_steps: int = 0
    monitor_dense_every: int = 1
    stop_on: str = "non_finite"
    guard: bool = False
    guard_dead: bool = False

    def __post_init__(self) -> None:
        self.milestones = tuple(self.milestones)

    def validate(self) -> TrainConfig:
        """Raise :class:`~normlab.runner.errors.FieldError` naming the field and what was expected; return self.

        The values it accepted are remembered (and travel with the config to worker processes and Ray tasks): a
        second call on the same values returns at once, so a config is checked once however many hands it passes
        through; a changed field is checked again. Names of factories are resolved (imported) here.
        """
        seen = json_line(self.to_dict())
        if self.__dict__.get("_validated") == seen:
            return self
        self._check_data()
        self._check_model()
        self._check_task()
        self._check_optimization()
        self._check_evaluation()
        self._check_monitoring()
        self.__dict__["_validated"] = seen
        return self

    @property
    def builtin_model(self) -> bool:
        """``model`` is one of normlab's own networks (:data:`~normlab.runner.models.MODELS`)."""
        return is_builtin("model", self.model)

    def _bad(self, name: str, expected: str) -> None:
        raise FieldError("TrainConfig", name, f"must be {expected}, got {getattr(self, name)!r}", sep=" ")

    def _number(self, name: str, **bounds) -> None:
        expected = number_problem(getattr(self, name), **bounds)
        if expected is not None:
            self._bad(name, expected)

    def _one_of(self, name: str, valid: tuple[str, ...]) -> None:
        if getattr(self, name) not in valid:
            raise FieldError(
                "TrainConfig", name, f"unknown {name} {getattr(self, name)!r}; valid names: {', '.join(valid)}"
            )

    def _check_data(self) -> None:
        resolve("data", self.dataset)
        for name in ("num_samples", "num_train"):
            self._number(name, integer=True, low=1, optional=True)
        if self.num_samples is not None and self.dataset != "mnist1d":
            self._bad("num_samples", "None unless dataset is mnist1d (generated data)")

    def _check_model(self) -> None:
        resolve("model", self.model)
        self._one_of("norm", NORM_NAMES)
        self._one_of("conv", CONV_KINDS)
        self._one_of("brn_schedule", BRN_SCHEDULES)
        self._number("width", low=0, high=MAX_WIDTH, low_open=True)
        for name in ("model_kwargs", "conv_kwargs"):
            if not isinstance(getattr(self, name), dict):
                self._bad(name, "a dict")
        if not self.builtin_model and self.width != 1.0:
            self._bad("width", f"1 for model {self.model!r} (it applies to the built-in models {', '.join(MODELS)})")
        data_dims = DATASET_DIMS.get(self.dataset)
        if self.builtin_model and data_dims is not None and MODEL_DIMS[self.model] != data_dims:
            raise FieldError(
                "TrainConfig",
                "model",
                f"model {self.model!r} takes {MODEL_DIMS[self.model]}-D inputs "
                f"but dataset {self.dataset!r} has {data_dims}-D samples; 1-D models: "
                f"{', '.join(m for m, d in MODEL_DIMS.items() if d == 1)}",
            )

    def _check_task(self) -> None:
        resolve("loss", self.loss)
        resolve("metric", self.metric)

    def _check_optimization(self) -> None:
        for name in ("batch_size", "epochs"):
            self._number(name, integer=True, low=1)
        for name in ("lr", "lr_gamma"):
            self._number(name, low=0, low_open=True)
        self._number("momentum", low=0, high=1, high_open=True)
        self._number("weight_decay", low=0)
        self._number("seed", integer=True, low=0)
        self._number("max_steps_per_epoch", integer=True, low=1, optional=True)
        if any(not is_int(m) or m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            self._bad("milestones", "increasing epoch numbers >= 1")
        for name in ("amp", "nowd_norm_alpha"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "True or False")
        try:
            resolve_device(self.device)
        except UsageError as e:
            raise FieldError("TrainConfig", "device", str(e)) from None

    def _check_evaluation(self) -> None:
        self._number("evals_per_epoch", integer=True, low=1)
        self._number("target_acc", optional=True, finite=True)
        if not isinstance(self.eval_train_mode, bool):
            self._bad("eval_train_mode", "True or False")

    def _check_monitoring(self) -> None:
        self._number("monitor_every", integer=True, low=0)
        self._number("monitor_dense_steps", integer=True, low=0)
        self._number("monitor_dense_every", integer=True, low=1)
        self._one_of("stop_on", STOP_ON)
        for name in ("guard", "guard_dead"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "True or False")
        if self.guard_dead and not self.guard:
            self._bad("guard_dead", "False unless guard is True (it changes what the guard counts as trouble)")

    def make_model(self, norm_kwargs: dict | None = None) -> torch.nn.Module:
        """The built-in model this config trains, for its built-in data set's input shape and classes (He init from
        torch's RNG); a model or data set from a factory is built by
        :func:`~normlab.runner.training.setup.build_model`, which needs the data.

        ``norm_kwargs``: further arguments of every normalization layer (the trainer's BatchRenorm schedule).

        Example:
            >>> TrainConfig(dataset="mnist1d", model="plain1d", norm="bn", width=0.5).make_model()(
            ...     torch.randn(2, 1, 40)).shape
            torch.Size([2, 10])
        """
        if not self.builtin_model or self.dataset not in INPUT_SHAPES:
            raise UsageError(
                f"TrainConfig.make_model: builds the built-in models on the built-in data sets; model {self.model!r} "
                f"on {self.dataset!r} is built by normlab.runner.training.setup.build_model"
            )
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
            same = math.isclose(a, b, rel_tol=1e-9) if is_number(a, True) and is_number(b, True) else a == b
            if not same:
                out.append(f"{k}: {a!r} -> {b!r}")
        return out
