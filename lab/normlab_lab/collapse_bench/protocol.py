"""The collapse benchmark's protocol, shared by its stages: the runs (set-up x learning rate x seed), their file
names and records, the seeds it may use and the definitions every stage reads (:data:`LEAD`, :func:`criteria`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from normlab.monitor.collapse import CollapseCriteria
from normlab.runner.errors import UsageError
from normlab_lab.collapse_bench.setups import ALL_SETUPS, SETUPS

__all__ = [
    "LEAD",
    "WINDOW",
    "MIN_SEED",
    "criteria",
    "run_name",
    "configs",
    "run_path",
    "load_run",
    "parse_seeds",
    "parse_setups",
]

LEAD = 5  # a warning counts when it comes >= LEAD steps before the collapse step
WINDOW = CollapseCriteria().window  # steps of the smoothed loss of the collapse label: the taxonomy's default
MIN_SEED = 100  # seeds 0-99 are reserved for outside checks


def criteria(chance_loss: float) -> CollapseCriteria:
    """The failure taxonomy's criteria of one run (the label, the collection's stop and the guard read them): the
    library's defaults (a :data:`WINDOW`-step window), with the run's chance loss."""
    return CollapseCriteria(chance_loss=chance_loss, window=WINDOW)


def run_name(cfg: dict) -> str:
    """A run's file stem: ``<set-up>_lr<lr>_s<seed>``."""
    return f"{cfg['setup']}_lr{cfg['lr']:g}_s{cfg['seed']}"


def configs(seeds: Iterable[int], setups: Sequence[str] = tuple(SETUPS)) -> list[dict]:
    """Every run of the protocol: set-up x lr x seed."""
    return [dict(setup=s, lr=lr, seed=seed) for seed in seeds for s in setups for lr in ALL_SETUPS[s]["lrs"]]


def run_path(out: Path, cfg: dict) -> Path:
    """Where ``collect`` writes a run's JSONL."""
    return Path(out) / f"{run_name(cfg)}.jsonl"


def load_run(path: Path) -> tuple[dict, list[dict]]:
    """``(header, steps)`` of one run's JSONL."""
    with open(path) as f:
        lines = [json.loads(s) for s in f if s.strip()]
    return lines[0], lines[1:]


def parse_seeds(text: str) -> list[int]:
    """ "300-305" or "300,302" -> seeds; seeds below :data:`MIN_SEED` are refused (reserved)."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.partition("-")
            seeds += list(range(int(a), int(b or a) + 1))
    except ValueError:
        raise UsageError(f"--seeds: expected seeds such as 300-302 or 300,310, got {text!r}") from None
    if not seeds:
        raise UsageError(f"--seeds: expected at least one seed, got {text!r}")
    if min(seeds) < MIN_SEED:
        raise UsageError(f"--seeds: expected seeds >= {MIN_SEED} (0-99 are reserved), got {min(seeds)}")
    return seeds


def parse_setups(text: str) -> list[str]:
    """A comma-separated list of set-up names (the report's or the pilot-only ones)."""
    setups = [s for s in text.split(",") if s]
    for s in setups:
        if s not in ALL_SETUPS:
            raise UsageError(f"--setups: unknown set-up {s!r}; expected one of {', '.join(ALL_SETUPS)}")
    return setups
