"""One run per output directory: an exclusive lock on ``--out`` for every command that writes into it.

``with out_lock(out, "compare"):`` creates ``out`` (and the parents it needs), opens ``out/.normlab.lock``
without following links and takes an exclusive, non-blocking ``flock`` on it; the file names the holder (pid,
host, command, start time). A second run on the same directory is refused with a one-line
:class:`~normlab.runner.errors.UsageError` naming the holder. The kernel releases the lock when its process dies
(even by ``kill -9``), so a lock file left by a dead process is simply taken over. Leaving the block removes the
lock file, and the directories the lock created if they are still empty, so a refused run leaves nothing behind.

The lock is re-entrant within one process (a library call inside a command that holds it takes it again for free) and
is not inherited by worker processes: a grid's workers run under their parent's lock, and die with the parent
(:mod:`normlab.runner.grid.execute`), so no cell is ever trained by two live processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from normlab.runner.errors import UsageError
from normlab.runner.io import check_dir_option

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None

__all__ = ["out_lock", "lock_holder", "LOCK_NAME"]

#: The lock file's name in the output directory.
LOCK_NAME = ".normlab.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_held: dict[str, int] = {}  # real path of a held lock file -> nesting depth, in this process


def lock_holder(out_dir: str | os.PathLike) -> dict | None:
    """What the lock file of ``out_dir`` says about its holder (pid, host, command, since), or None."""
    try:
        with open(Path(out_dir) / LOCK_NAME, encoding="utf-8") as f:
            info = json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _make_dirs(out: Path, option: str) -> Path | None:
    """Create ``out`` and its missing parents; return the top-most directory created (None if it existed)."""
    missing = [p for p in (out, *out.parents) if not os.path.lexists(p)]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"{option} {out} cannot be created ({e.strerror or type(e).__name__}); expected a "
            f"directory this user may write into"
        ) from None
    return missing[-1] if missing else None


def _remove_created(top: Path | None, out: Path) -> None:
    """Remove ``out`` and its parents up to ``top`` (the directories the lock created) while they are empty."""
    if top is None:
        return
    for p in (out, *out.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return


def _open_locked(path: Path, out: Path, option: str) -> int:
    """Open and flock ``path``; the descriptor, or a refusal naming the holder."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(
                f"{option} {out}: cannot open the lock file {path.name} ({e.strerror}); remove it if it is a link"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            h = lock_holder(out) or {}
            raise UsageError(
                f"{option} {out} is in use by another normlab run (pid {h.get('pid', '?')} on "
                f"{h.get('host', '?')}: normlab {h.get('command', '?')}, since {h.get('since', '?')});"
                f" wait for it to finish or use another {option}"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file between our open and our lock: try the new one


@contextlib.contextmanager
def out_lock(out_dir: str | os.PathLike, command: str, option: str = "--out") -> Iterator[Path]:
    """Hold the exclusive lock of ``out_dir`` for the block (see the module docstring); yields the directory.

    Args:
        out_dir: the output directory (created if missing; checked with :func:`~normlab.runner.io.check_dir_option`).
        command: what holds it, for the refusal message of a second run (e.g. ``"compare"``).
        option: the option name used in messages.
    """
    out = check_dir_option(out_dir, option)
    key = os.path.realpath(out / LOCK_NAME) if out.exists() else None
    if key is not None and key in _held:
        _held[key] += 1
        try:
            yield out
        finally:
            _held[key] -= 1
        return
    created = _make_dirs(out, option)
    path = out / LOCK_NAME
    if fcntl is None:  # pragma: no cover
        yield out
        return
    try:
        fd = _open_locked(path, out, option)
    except BaseException:
        _remove_created(created, out)
        raise
    key = os.path.realpath(path)
    _held[key] = 1
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield out
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            os.unlink(path)  # still holding the lock: a waiting run re-checks the inode and retries
        os.close(fd)
        _remove_created(created, out)
