"""The lab's command line, ``normlab-lab demo | reproduce | capsules | report | collapse-bench``.

Each command is one module here with ``add_parser(subparsers)`` (which sets ``run``) and ``run(args) -> int``, as
normlab's own commands are: the argument types and one-line errors of :mod:`normlab.cli.args`, and
:func:`normlab.cli.run_command` to run them (a refusal is one line with exit code 2, Ctrl-C exits with 130).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from normlab.cli import run_command
from normlab.cli.args import OneLineParser
from normlab_lab import DEMO_MINUTES, PROG, __version__
from normlab_lab.cli import capsules, collapse_bench, demo, report, reproduce

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = (demo, reproduce, capsules, report, collapse_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description=f"The paper's lab on normlab: the demo (the paper's claims on MNIST-1D in about {DEMO_MINUTES:g} "
        "minutes on 2 cores), "
        "the full reproduction, the capsule routing experiment and the collapse benchmark.",
        epilog=f"Start with `{PROG} demo`. `{PROG} <command> --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the lab's command line; returns the exit code."""
    return run_command(build_parser(), argv)
