"""Deploy a trained run: rebuild its model from ``checkpoint.pt``, fold it for inference, export ONNX / TorchScript.

:func:`load_run_model` rebuilds the eval-mode model of a ``normlab train`` run (or of a grid cell); :func:`fold_run`
folds it with :func:`normlab.convert.fold_for_inference` (WS/PWS/weight-norm kernels become plain convs, an
eval-mode BatchNorm after a conv is folded into it); :func:`export_onnx` writes it with ``torch.onnx.export``
(a dynamic batch axis, input ``input``, output ``logits``) and checks it in onnxruntime; :func:`export_torchscript`
traces it with ``torch.jit.trace`` (deprecated by torch >= 2.9 in favour of ``torch.export``; kept for runtimes that
still load TorchScript) and checks the trace at another batch size. Files are written atomically.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.convert import fold_for_inference
from normlab.runner.data.datasets import INPUT_SHAPES
from normlab.runner.errors import RunError, UsageError, error_line
from normlab.runner.io import atomic_write
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import read_checkpoint

__all__ = [
    "INPUT_SHAPES",
    "require_onnx",
    "load_run_model",
    "fold_run",
    "export_onnx",
    "export_torchscript",
    "max_rel_diff",
]


def _checkpoint_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    ck = p / "checkpoint.pt" if p.is_dir() else p
    if not ck.is_file():
        raise UsageError(f"CHECKPOINT {path}: expected a normlab run directory or its checkpoint.pt")
    return ck


def load_run_model(path: str | os.PathLike) -> tuple[nn.Module, TrainConfig, tuple[int, ...]]:
    """The eval-mode model of the run at ``path`` (a run directory or its ``checkpoint.pt``), the run's config and
    the shape of one input sample. Reads with ``torch.load(weights_only=True)``.

    Raises:
        UsageError: no checkpoint there, not one normlab wrote, or weights that do not fit its configuration.
    """
    ck_path = _checkpoint_path(path)
    try:
        ck = read_checkpoint(ck_path)
    except ValueError as e:
        raise UsageError(f"CHECKPOINT {ck_path} is {e}") from None
    cfg = TrainConfig.from_dict(ck["config"]).validate()
    shape = INPUT_SHAPES[cfg.dataset]
    model = cfg.make_model()
    try:
        model.load_state_dict(ck["model"])
    except (RuntimeError, KeyError, TypeError) as e:  # written by another normlab version, or edited
        raise UsageError(
            f"CHECKPOINT {ck_path}: its weights do not fit the model its config describes ({error_line(e)})"
        ) from None
    return model.eval(), cfg, shape


def max_rel_diff(got: Any, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    got = torch.as_tensor(got, dtype=torch.float64)
    want = want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def fold_run(model: nn.Module, shape: tuple[int, ...], batch: int = 2, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The folded model and the example input (``batch`` random samples) it was checked on (RunError when the
    folded model's outputs differ from the original's)."""
    example = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))
    try:
        return fold_for_inference(model, example), example
    except RuntimeError as e:
        raise RunError(f"folding for inference failed: {error_line(e)}") from None


@contextlib.contextmanager
def _quiet():
    """torch's exporters print progress, deprecation notes and log optional operators they skip: keep them off the
    user's terminal (a failed export still raises)."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def require_onnx() -> None:
    """A one-line UsageError naming the extra when torch.onnx.export's exporter (onnxscript) is not installed."""
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        raise UsageError("--onnx needs the ONNX exporter: pip install 'normlab[onnx]'") from None


def _onnx_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    require_onnx()
    batch = torch.export.Dim("batch", min=1, max=2**20)
    try:
        with _quiet():
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                input_names=["input"],
                output_names=["logits"],
                dynamic_shapes=({0: batch},),
                verbose=False,
            )
        return program.model_proto.SerializeToString()
    except Exception as e:  # the exporter's many error types (unsupported operator, export failure, ...)
        raise RunError(f"ONNX export failed: {error_line(e, with_type=True)}") from None


def _onnxruntime_diff(data: bytes, model: nn.Module, inputs: list[torch.Tensor]) -> float | None:
    """Largest relative difference between onnxruntime and torch on ``inputs`` (None without onnxruntime)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    try:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        with torch.no_grad():
            return max(max_rel_diff(session.run(None, {"input": x.numpy()})[0], model(x)) for x in inputs)
    except Exception as e:  # onnxruntime's own error types
        raise RunError(
            f"ONNX export: onnxruntime cannot run the exported model ({error_line(e, with_type=True)})"
        ) from None


def export_onnx(model: nn.Module, example: torch.Tensor, path: str | os.PathLike, rtol: float = 1e-4) -> float | None:
    """Write ``model`` as ONNX to ``path`` and check it in onnxruntime (at the example's batch size and another).

    Returns:
        The largest relative difference from torch, or None when onnxruntime is not installed.

    Raises:
        RunError: onnxruntime's outputs differ from torch's by more than ``rtol`` (nothing is written).
    """
    data = _onnx_bytes(model, example)
    diff = _onnxruntime_diff(data, model, [example, torch.cat([example, example[:1]])])
    if diff is not None and diff > rtol:
        raise RunError(f"ONNX export: onnxruntime differs from torch by {diff:.3g} (relative), above {rtol:g}")
    atomic_write(path, lambda f: f.write(data))
    return diff


def export_torchscript(model: nn.Module, example: torch.Tensor, path: str | os.PathLike, rtol: float = 1e-4) -> float:
    """Trace ``model`` with ``torch.jit.trace`` and save it to ``path``; returns the relative difference of the
    loaded trace from torch at another batch size (RunError above ``rtol``; nothing is written then)."""
    try:
        with _quiet(), torch.no_grad():
            traced = torch.jit.trace(model, example)
            buf = io.BytesIO()
            torch.jit.save(traced, buf)
            buf.seek(0)
            other = torch.cat([example, example[:1]])
            diff = max_rel_diff(torch.jit.load(buf)(other), model(other))
    except Exception as e:  # tracing or running the trace failed
        raise RunError(f"TorchScript export failed: {error_line(e, with_type=True)}") from None
    if diff > rtol:
        raise RunError(f"TorchScript export: the trace differs from torch by {diff:.3g} (relative), above {rtol:g}")
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    return diff
