"""Files the runner writes: atomic replacement, appends that never follow links, one JSON encoding, checked
output directories.

Every output goes through :func:`atomic_write` (or :func:`append_lines` for logs that grow), the helper of
``normlab._files``: a unique temporary file is created next to the target with ``O_EXCL``, written, fsynced and
moved over the target with ``os.replace``. A crash leaves either the old file or the new one, never a half-written
file; two writers never share a temporary name; a symbolic link planted at the target is replaced, never followed,
so nothing outside the output directory is written. The temporary files of a killed writer are removed by
:func:`remove_stale_temps`. :func:`check_dir_option` refuses an output directory that cannot work (empty, a file,
under a file, not writable) before anything is written; :mod:`normlab.runner.lock` keeps two runs out of one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab._files import TEMP_SUFFIX, append_bytes, atomic_savefig, atomic_write
from normlab.runner.errors import UsageError

__all__ = [
    "atomic_write",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "atomic_savefig",
    "append_lines",
    "remove_stale_temps",
    "to_jsonable",
    "json_line",
    "check_dir_option",
    "from_fields",
    "TEMP_SUFFIX",
]


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
    append_bytes(path, "".join(line + "\n" for line in lines).encode("utf-8"))


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


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (as a link or anything else)."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path(path.anchor or ".")


def check_dir_option(path: str | os.PathLike | None, option: str = "--out", *, writable: bool = True) -> Path:
    """Refuse a directory option that cannot work, before anything is written; returns it as a Path.

    Refused (:class:`~normlab.runner.errors.UsageError`, naming ``option``): an empty string, an existing
    non-directory (a file, or a link to one), a dangling link, a path under a file, and with ``writable`` a directory
    (or its nearest existing ancestor, when it is still to be created) that this process may not write into. A link
    to a directory is accepted: the user named it.
    """
    if path is None or not str(path).strip():
        raise UsageError(f"{option}: expected a directory path, got an empty string")
    p = Path(path)
    if os.path.lexists(p) and not p.exists():
        raise UsageError(f"{option} {p} is a symbolic link to a missing path; expected a directory")
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option} {p} is a file; expected a directory")
    anchor = _first_existing(p.absolute())
    if not anchor.is_dir():
        raise UsageError(f"{option} {p} is under {anchor}, which is a file; expected a directory path")
    if writable and not os.access(anchor, os.W_OK | os.X_OK):
        what = "is not writable" if anchor == p.absolute() else f"cannot be created ({anchor} is not writable)"
        raise UsageError(f"{option} {p} {what}; expected a directory this user may write into")
    return p


def from_fields(cls, d: dict[str, Any], what: str | None = None):
    """The dataclass ``cls`` from a dict of its fields (a JSON record); one policy for every record the runner
    reads: an unknown key is refused in one line naming the keys and the fields, never dropped."""
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict):
        raise UsageError(f"{what or cls.__name__}: expected a JSON object of its fields, got {type(d).__name__}")
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise UsageError(
            f"{what or cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))}; its fields: {', '.join(names)}"
        )
    return cls(**d)
