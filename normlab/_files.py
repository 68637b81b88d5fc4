"""Writing files safely: the one helper every normlab output goes through (library and runner alike).

:func:`atomic_write` creates a unique temporary file next to the target with ``O_EXCL | O_NOFOLLOW``, writes it,
fsyncs it and moves it over the target with ``os.replace``: a crash leaves the old file or the new one, never a
half-written one; two writers never share a temporary name; a symbolic link planted at the target is replaced,
never followed, so nothing outside the target's directory is written. :func:`append_bytes` opens with
``O_APPEND | O_NOFOLLOW``: it refuses a link at the target. :func:`atomic_savefig` saves a matplotlib figure the
same way. Temporary files end with :data:`TEMP_SUFFIX` (``normlab.runner.io.remove_stale_temps`` cleans them).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "append_bytes", "atomic_savefig", "TEMP_SUFFIX"]

#: The suffix of a writer's temporary file, which replaces the target when complete (a killed writer's are removed
#: later).
TEMP_SUFFIX = ".normlab-tmp"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` through ``write(binary_file)`` atomically (temp file, fsync, ``os.replace``).

    Args:
        path: the target; its directory is created if missing. A symbolic link at ``path`` is replaced.
        write: called with the temporary file opened for binary writing.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)  # the umask applies
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


def append_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing); raises ``OSError`` instead of following a link."""
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    with os.fdopen(fd, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_savefig(fig, path: str | os.PathLike, **kwargs) -> Path:
    """``fig.savefig(path, **kwargs)`` through :func:`atomic_write` (format from the suffix, default png)."""
    path = Path(path)
    fmt = kwargs.pop("format", None) or (path.suffix[1:] or "png")
    return atomic_write(path, lambda f: fig.savefig(f, format=fmt, **kwargs))
