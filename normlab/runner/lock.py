"""One run per output directory: an exclusive lock on ``--out`` for every command that writes into it.

``with out_lock(out, "compare"):`` creates ``out`` (and the parents it needs), opens ``out/.normlab.lock``
without following links and takes an exclusive, non-blocking ``flock`` on it; the file names the holder (pid,
host, command, start time). A second run on the same directory is refused with a one-line
:class:`~normlab.runner.errors.UsageError` naming the holder. The kernel releases the lock when its process dies
(even by ``kill -9``), so a lock file left by a dead process is simply taken over. Leaving the block removes the
lock file, and the directories the lock created if they are still empty, so a refused run leaves nothing behind.

**One command per output directory.** A command that owns its output directory passes ``claim``, the command line
that made it (``"normlab compare"``, ``"normlab train"``; a quick mode its own, ``"... --quick"``). Its first run
writes ``OUT/.normlab-run.json`` naming that command and its record file. A later run of the same command resumes; a
run of another command, or of the same one in another mode, is refused in one line naming what is there, as is a
directory already holding files that no command claimed (the user's own). A missing or empty directory is taken. A
run that leaves nothing but the claim removes it again.

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
from normlab.runner.io import atomic_write_json, check_dir_option

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None

__all__ = ["out_lock", "lock_holder", "dir_claim", "check_claim", "LOCK_NAME", "CLAIM_NAME"]

#: The lock file's name in the output directory.
LOCK_NAME = ".normlab.lock"
#: The file naming the command whose output directory it is (written by its first run).
CLAIM_NAME = ".normlab-run.json"
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


def dir_claim(out_dir: str | os.PathLike) -> dict | None:
    """What ``out_dir``'s claim file says (``{"run": command line, "record": its record file}``), or None if it has
    none.

    Raises:
        UsageError: the claim file is a link or not a claim (one line).
    """
    path = Path(out_dir) / CLAIM_NAME
    if not os.path.lexists(path):
        return None
    try:
        info = None if path.is_symlink() else json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("run"), str):
        raise UsageError(f"{path} is not a normlab claim file; move it away or use another output directory")
    return info


def _listing(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_claim(out_dir: str | os.PathLike, claim: str, option: str = "--out") -> bool:
    """Refuse ``out_dir`` for the command line ``claim`` as :func:`out_lock` will (read only: for a command that
    says something before it takes the lock); True if ``out_dir`` is already ``claim``'s.

    Args:
        out_dir: the output directory (a missing one is anyone's).
        claim: the command line that would claim it (``"normlab compare"``).
        option: the option name used in messages.

    Raises:
        UsageError: ``out_dir`` is another command's, or holds files no normlab run wrote (one line).
    """
    out = Path(out_dir)
    if not out.is_dir():
        return False
    info = dir_claim(out)
    if info is not None:
        if info["run"] == claim:
            return True
        rec = info.get("record")
        says = rec if isinstance(rec, str) and os.path.lexists(out / rec) else CLAIM_NAME
        raise UsageError(
            f"{option} {out} holds a `{info['run']}` run ({says}); pass another {option}, or rerun "
            f"`{info['run']}` to resume it"
        )
    other = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_NAME, CLAIM_NAME))
    if other:
        raise UsageError(
            f"{option} {out} holds files no normlab run wrote ({_listing(other)}); pass an empty or new {option}"
        )
    return False


def _claim(out: Path, run: str, record: str | None, option: str) -> bool:
    """Claim ``out`` for the command line ``run`` (see the module docstring); True if this call wrote the claim."""
    if check_claim(out, run, option):
        return False
    atomic_write_json(out / CLAIM_NAME, {"run": run, "record": record})
    return True


def _unclaim_if_empty(out: Path) -> None:
    """Remove the claim this run wrote when the directory holds nothing else (a refused or empty run)."""
    with contextlib.suppress(OSError):
        if {p.name for p in out.iterdir()} <= {LOCK_NAME, CLAIM_NAME}:
            os.unlink(out / CLAIM_NAME)


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
def out_lock(
    out_dir: str | os.PathLike,
    command: str,
    option: str = "--out",
    *,
    claim: str | None = None,
    record: str | None = None,
) -> Iterator[Path]:
    """Hold the exclusive lock of ``out_dir`` for the block (see the module docstring); yields the directory.

    Args:
        out_dir: the output directory (created if missing; checked with :func:`~normlab.runner.io.check_dir_option`).
        command: what holds it, for the refusal message of a second run (e.g. ``"compare"``).
        option: the option name used in messages.
        claim: the command line whose output directory it is (``"normlab compare"``): a directory claimed by
            another, or holding files no run claimed, is refused in one line (None: lock only, as ``report``).
        record: the file that holds the run's result (``"results.json"``), named in another command's refusal.
    """
    out = check_dir_option(out_dir, option)
    key = os.path.realpath(out / LOCK_NAME) if out.exists() else None
    if key is not None and key in _held:
        _held[key] += 1
        try:
            if claim is not None:
                _claim(out, claim, record, option)
            yield out
        finally:
            _held[key] -= 1
        return
    created = _make_dirs(out, option)
    if fcntl is None:  # pragma: no cover
        if claim is not None:
            _claim(out, claim, record, option)
        yield out
        return
    try:
        fd = _open_locked(out / LOCK_NAME, out, option)
    except BaseException:
        _remove_created(created, out)
        raise
    try:
        with _holding(fd, out, command):
            claimed = False
            try:
                claimed = claim is not None and _claim(out, claim, record, option)
                yield out
            finally:
                if claimed:
                    _unclaim_if_empty(out)
    finally:
        _remove_created(created, out)


@contextlib.contextmanager
def _holding(fd: int, out: Path, command: str) -> Iterator[None]:
    """Write the holder into the locked file ``fd`` for the block; then remove the file and release the lock."""
    path = out / LOCK_NAME
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
        yield
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            os.unlink(path)  # still holding the lock: a waiting run re-checks the inode and retries
        os.close(fd)
