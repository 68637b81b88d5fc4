"""How BatchRenorm meets the tools of torch, timm and Lightning that look for torch's ``_BatchNorm``.

BatchRenorm derives from ``torch.nn.modules.batchnorm._BatchNorm``, so every tool that dispatches on that class
finds it (the list, tool by tool: ``docs/batchnorm_tools.md``). Most then do the right thing; three kinds need the
layer's help, and :class:`BatchNormTools` gives it without changing the tools. It recognizes them by their code:
the code object of the function whose frame calls into the layer, looked up among the tools that are loaded.

* **Re-estimating the running statistics** (``torch.optim.swa_utils.update_bn``, Lightning's
  ``StochasticWeightAveraging``): they reset the statistics, set ``momentum = None`` (cumulative average) and run
  the loader in training mode, expecting every layer to normalize with its batch statistics. While they run,
  BatchRenorm's limits are ``rmax = 1, dmax = 0`` (r = 1, d = 0: BatchNorm's training output), so the layers
  after it see what a BatchNorm would give them and the new statistics are the loader's average; afterwards
  ``num_batches_tracked`` (the schedule's step) is put back. :func:`begin_reestimation` /
  :func:`end_reestimation` are the same switch for :func:`normlab.nn.update_bn`.
* **Converting to a plain BatchNorm class** (``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, timm's
  ``convert_sync_batchnorm`` and ``convert_splitbn_model``): the layer they would build computes BatchNorm, not
  BatchRenorm. When they read the layer's ``affine`` (after building the new layer, before it is put in the
  model) a ``TypeError`` stops them, naming the layer and what to call instead.
* **Freezing BatchNorm2d** (timm's ``freeze_batch_norm_2d``, also under ``timm.utils.freeze``): it converts
  ``BatchNorm2d`` only and would leave a BatchRenorm trainable; when it walks into the layer's children, a
  ``TypeError`` says how to freeze it.
"""

from __future__ import annotations

import inspect
import sys
from types import CodeType

import torch
from torch import Tensor, nn

__all__ = ["BatchNormTools", "begin_reestimation", "end_reestimation", "kept_step", "reestimating"]

_SWA = ("lightning.pytorch.callbacks.stochastic_weight_avg", "pytorch_lightning.callbacks.stochastic_weight_avg")
_SYNC_ADVICE = "convert with normlab.nn.SyncBatchRenorm.convert_sync_batchrenorm(model, batchnorm=True)"


def _code(fn) -> CodeType:
    return inspect.unwrap(getattr(fn, "__func__", fn)).__code__


def _reestimators() -> dict[CodeType, str]:
    """Code object -> role (``"update_bn"``, ``"begin"``, ``"end"``) of the loaded re-estimation tools."""
    out = {}
    swa = sys.modules.get("torch.optim.swa_utils")
    if swa is not None:
        out[_code(swa.update_bn)] = "update_bn"
    for name in _SWA:
        module = sys.modules.get(name)
        if module is not None:
            callback = module.StochasticWeightAveraging
            out[_code(callback.reset_batch_norm_and_save_state)] = "begin"
            out[_code(callback.reset_momenta)] = "end"
    return out


def _converters() -> dict[CodeType, tuple[str, str]]:
    """Code object -> (tool, what it would build) of the loaded tools that turn a ``_BatchNorm`` into a plain
    BatchNorm class."""
    out = {_code(nn.SyncBatchNorm.convert_sync_batchnorm): ("torch.nn.SyncBatchNorm.convert_sync_batchnorm", "a")}
    norm_act = sys.modules.get("timm.layers.norm_act")
    if norm_act is not None:
        out[_code(norm_act.convert_sync_batchnorm)] = ("timm.layers.convert_sync_batchnorm", "a")
    split = sys.modules.get("timm.layers.split_batchnorm")
    if split is not None:
        out[_code(split.convert_splitbn_model)] = ("timm.layers.convert_splitbn_model", "s")
    return out


def _freezers() -> set[CodeType]:
    norm_act = sys.modules.get("timm.layers.norm_act")
    return {_code(norm_act.freeze_batch_norm_2d)} if norm_act is not None else set()


def _caller(frame, skip: str):
    """The first frame above ``frame`` (itself included) whose function is not named ``skip`` (an override chain)."""
    while frame is not None and frame.f_code.co_name == skip:
        frame = frame.f_back
    return frame


def reestimating(module: nn.Module) -> bool:
    """True while a re-estimation of ``module``'s running statistics runs (its training steps are BatchNorm's)."""
    return getattr(module, "_reestimation", None) is not None


def begin_reestimation(module: nn.Module) -> None:
    """Start a re-estimation: keep ``num_batches_tracked`` (put back by :func:`end_reestimation`). A second call
    before the end (a re-estimation that stopped half-way, then started again) keeps the first one's step and
    starts the new tool call's count of ``momentum`` settings from zero (torch's ``update_bn`` ends at its second)."""
    if not reestimating(module):
        step = getattr(module, "num_batches_tracked", None)
        module.__dict__["_reestimation"] = {"step": None if step is None else step.clone(), "sets": 0}
    module.__dict__["_reestimation"]["sets"] = 0


def kept_step(module: nn.Module) -> Tensor | None:
    """The ``num_batches_tracked`` a running re-estimation will put back, or None (none runs, or no counter)."""
    state = getattr(module, "_reestimation", None)
    return None if state is None else state["step"]


def end_reestimation(module: nn.Module) -> None:
    """End a re-estimation: ``num_batches_tracked`` takes its value from before it again."""
    state = module.__dict__.pop("_reestimation", None)
    step = getattr(module, "num_batches_tracked", None)
    if state is not None and state["step"] is not None and step is not None:
        with torch.no_grad():
            step.copy_(state["step"])


class _Affine:
    """``affine`` as a data descriptor (stored in the instance ``__dict__``, where ``_NormBase.extra_repr`` reads
    it): a read by a tool that would rebuild the layer as a plain BatchNorm raises instead."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        try:
            value = obj.__dict__["affine"]
        except KeyError:
            raise AttributeError("affine") from None
        tool = _converters().get(sys._getframe(1).f_code)
        if tool is not None:
            built = "a plain SyncBatchNorm" if tool[1] == "a" else "a SplitBatchNorm2d (BatchNorm per split)"
            raise TypeError(
                f"{tool[0]}: would turn {type(obj).__name__}({obj.num_features}) into {built}, dropping its "
                f"renormalization; {_SYNC_ADVICE} (see docs/batchnorm_tools.md)"
            )
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__["affine"] = value


class BatchNormTools:
    """Mixin of the BatchRenorm layers (before ``_BatchNorm`` in the bases): the re-estimation switch, the
    refusals of the conversions to a plain BatchNorm and of timm's ``freeze_batch_norm_2d`` (the rules: this
    module's docstring). The layer reads :func:`reestimating` in ``renorm_limits``."""

    _reestimation = None  # a dict while a re-estimation runs (in the instance __dict__)
    affine = _Affine()

    def __setattr__(self, name: str, value) -> None:
        if name == "momentum":
            role = _reestimators().get(sys._getframe(1).f_code)
            if role == "begin":
                begin_reestimation(self)
            elif role == "end" or (role == "update_bn" and self._count_update_bn_set()):
                end_reestimation(self)
        super().__setattr__(name, value)

    def _count_update_bn_set(self) -> bool:
        """torch's update_bn sets momentum twice, to None before the loader and back after it: True at the second."""
        if self._reestimation is None:
            return False
        self._reestimation["sets"] += 1
        return self._reestimation["sets"] == 2

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """During a re-estimation ``num_batches_tracked`` counts the loader's batches (the cumulative average's
        count): the state saved then holds the schedule's step, which the end puts back (a checkpoint written during
        Lightning's BatchNorm epoch resumes the schedule where it was)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        step, key = kept_step(self), prefix + "num_batches_tracked"
        if step is not None and key in destination:
            destination[key] = step if keep_vars else step.detach()

    def __getstate__(self):
        """pickle, ``torch.save(module)``, ``copy.deepcopy``: a copy made during a re-estimation, which no tool will
        end, is the layer as the end would leave it (no re-estimation, the step put back)."""
        state = super().__getstate__()
        step = kept_step(self)
        state.pop("_reestimation", None)
        if step is not None and state["_buffers"].get("num_batches_tracked") is not None:
            state["_buffers"] = type(state["_buffers"])(state["_buffers"], num_batches_tracked=step.clone())
        return state

    def reset_running_stats(self) -> None:
        caller = _caller(sys._getframe(1), "reset_running_stats")
        if caller is not None and _reestimators().get(caller.f_code) == "update_bn":
            begin_reestimation(self)  # before the reset: the step to put back
        super().reset_running_stats()

    def named_children(self):
        if sys._getframe(1).f_code in _freezers():
            raise TypeError(
                f"timm.layers.freeze_batch_norm_2d: would leave {type(self).__name__}({self.num_features}) trainable "
                "(it freezes BatchNorm2d and BatchNormAct2d only); BatchRenorm in eval mode computes BatchNorm, so "
                "normlab.convert.convert_norm(model, to='bn') first (the same eval output), then freeze "
                "(see docs/batchnorm_tools.md)"
            )
        return super().named_children()
