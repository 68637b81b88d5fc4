"""The ``normlab`` command line: ``train | compare | report | monitor | bench | export``.

Each command is one module here with ``add_parser(subparsers)`` (which sets ``run``) and ``run(args) -> int``.
Every user error is one line, ``normlab <command>: error: <option>: <what was expected>``: option values are
checked where they are parsed (:class:`~normlab.cli.args.OneLineParser`, exit code 2), the rest before anything is
written; a refusal of the runner (:class:`~normlab.runner.errors.RunnerError`) is printed as one line with its
exit code (2 for bad input). Commands that write into ``--out`` hold its lock
(:func:`normlab.runner.lock.out_lock`). Ctrl-C or SIGTERM stops with exit code 130, stops the worker processes
and leaves every finished result on disk.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from normlab import __version__
from normlab.runner.errors import RunnerError, error_line

from . import bench, compare, export, monitor, report, train
from .args import OneLineParser

__all__ = ["main", "build_parser", "run_command", "COMMANDS"]

COMMANDS = (train, compare, report, monitor, bench, export)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="normlab",
        description="Normalization layers, a variance-transmission monitor and an experiment runner that compares "
        "normalizations (none, BN, BRN, GN, SN, WN, WS, PWS) across learning rates and batch sizes.",
        epilog="Start with `normlab compare --norms none,bn,pws --epochs 1` (three normalizations on the bundled "
        "digits, about a minute). `normlab <command> --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    return run_command(build_parser(), argv)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``parser``, whose subcommands set ``run``, and run the command;
    returns the exit code.

    A :class:`~normlab.runner.errors.RunnerError` is printed as one line, ``<prog> <command>: error: ...``, and
    exits with its code (2 for bad input); Ctrl-C or SIGTERM exits with 130; no command prints the help and exits
    with 2. Any command line built on normlab's commands behaves as ``normlab`` does with this.
    """
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return int(args.run(args) or 0)
    except RunnerError as e:
        print(f"{parser.prog} {args.command}: error: {error_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
