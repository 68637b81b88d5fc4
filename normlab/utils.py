"""Small helpers shared by the training loop: seeding, atomic writes, devices, weight-decay groups."""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (CPU and, if present, CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; otherwise ``torch.device(device)`` (checked to exist)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"resolve_device: device {device!r} requested but CUDA is not available")
    return dev


_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic_write(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then ``os.replace`` onto ``path``."""
    _atomic_write(Path(path), lambda f: torch.save(obj, f))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (utf-8) to ``path`` atomically."""
    _atomic_write(Path(path), lambda f: f.write(text.encode("utf-8")))


def to_jsonable(obj):
    """Convert tensors / numpy scalars / tuples to JSON types; non-finite floats become None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.item() if obj.numel() == 1 else obj.tolist())
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def dumps_line(obj) -> str:
    """One JSON line (no NaN/Infinity tokens)."""
    return json.dumps(to_jsonable(obj), allow_nan=False)


def make_param_groups(model: nn.Module, weight_decay: float, nowd_norm_alpha: bool = True) -> list[dict]:
    """Optimizer groups: with ``nowd_norm_alpha``, :func:`normlab.nn.param_groups` (no weight decay on norm
    parameters, PWS alpha and biases); otherwise one group with ``weight_decay`` on everything."""
    if not nowd_norm_alpha:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    from normlab.nn import param_groups

    return param_groups(model, weight_decay)
