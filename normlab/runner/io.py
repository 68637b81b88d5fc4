"""Files the runner writes: atomic replacement, appends that never follow links, one JSON encoding.

Every output goes through :func:`atomic_write` (or :func:`append_lines` for logs that grow): a unique temporary
file is created next to the target with ``O_EXCL``, written, fsynced and moved over the target with
``os.replace``. A crash leaves either the old file or the new one, never a half-written file; two writers never
share a temporary name; a symbolic link planted at the target is replaced, never followed, so nothing outside the
output directory is written. The temporary files of a killed writer are removed by :func:`remove_stale_temps`.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

__all__ = [
    "atomic_write", "atomic_write_text", "atomic_write_json", "atomic_torch_save", "append_lines",
    "remove_stale_temps", "to_jsonable", "json_line", "TEMP_SUFFIX",
]

TEMP_SUFFIX = ".normlab-tmp"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(binary_file)`` atomically (temp file, fsync, ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    """Write ``obj`` as strict JSON (non-finite floats as null, tensors and numpy values as numbers)."""
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=indent, allow_nan=False) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to ``path`` atomically."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def append_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Append ``lines`` (each without its newline) to ``path``; refuses to follow a symbolic link at ``path``."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
    with os.fdopen(fd, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a killed writer left in ``directory``; returns what was removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.glob(f".*{TEMP_SUFFIX}") if p.is_file() and not p.is_symlink()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def to_jsonable(obj: Any) -> Any:
    """JSON types from tensors, numpy values, tuples and paths; non-finite floats become None."""
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


def json_line(obj: Any) -> str:
    """One line of strict JSON (no NaN/Infinity tokens)."""
    return json.dumps(to_jsonable(obj), allow_nan=False)
