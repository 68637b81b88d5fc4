"""The runner's exceptions: what the command line reports as one line instead of a traceback.

``UsageError``: a request the runner refuses (an option value that cannot work, an impossible combination, an
output directory that holds another run); exit code 2. ``RunError``: a run that cannot go on for a reason the
user must look at (an unreadable checkpoint); exit code 1. The library (``normlab.nn``, ``normlab.functional``,
...) raises plain ``ValueError``/``TypeError``; the runner checks its input at its boundary and raises these.
"""

from __future__ import annotations

__all__ = ["RunnerError", "UsageError", "FieldError", "RunError", "error_line"]


class RunnerError(Exception):
    """Base of the runner's refusals; ``exit_code`` is what the command line returns."""

    exit_code = 1


class UsageError(RunnerError, ValueError):
    """Bad user input: the message names the option and what was expected (exit code 2)."""

    exit_code = 2


class FieldError(UsageError):
    """A refused value of one field of a spec or a config (``GridSpec lrs: expected ...``).

    ``problem`` may name the fields of ``refs`` as ``{field}``; the command line says the same with its option
    names (:meth:`for_options`), so each fact is checked once, by the spec or config that owns it. ``sep`` joins
    the field and the problem (``": "``; ``" "`` for ``lr must be ...``).
    """

    def __init__(self, owner: str, field: str, problem: str, refs: tuple[str, ...] = (), sep: str = ": "):
        self.owner, self.field, self.problem, self.refs, self.sep = owner, field, problem, refs, sep
        super().__init__(f"{owner} {field}{sep}{self._text(lambda f: f)}")

    def __reduce__(self):  # picklable (a worker process or a Ray task raises it; the parent reads it)
        return type(self), (self.owner, self.field, self.problem, self.refs, self.sep)

    def _text(self, name) -> str:
        text = self.problem
        for ref in self.refs:
            text = text.replace("{" + ref + "}", name(ref))
        return text

    def for_options(self, option) -> UsageError:
        """The same refusal naming options: ``option(field) -> "--option"``."""
        return UsageError(f"{option(self.field)}{self.sep}{self._text(option)}")


class RunError(RunnerError, RuntimeError):
    """A run that cannot go on (e.g. a corrupt checkpoint); nothing was overwritten (exit code 1)."""

    exit_code = 1


def error_line(e: BaseException, with_type: bool = False) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line reports;
    ``with_type`` prefixes ``"TypeName: "``."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if not line:
        return type(e).__name__
    return f"{type(e).__name__}: {line}" if with_type else line
