"""``normlab-lab reproduce``: the full reproduction (the demo's sections trained to their plateau on MNIST-1D) or the
PWS paper's CIFAR-10 table (``--preset cifar10-pws``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from normlab.cli.args import MAX_SEED, MAX_WORKERS, device, integer, list_of, threads_int
from normlab.cli.plan import announce_grids
from normlab.runner.data.cifar10 import download_cifar10
from normlab.runner.errors import UsageError
from normlab.runner.grid.execute import BACKENDS, plan_grid, run_cells
from normlab.runner.grid.ray_backend import check_address, check_device, require_ray
from normlab.runner.grid.report import print_summary
from normlab.runner.io import check_dir_option, remove_stale_temps
from normlab.runner.lock import out_lock
from normlab_lab import PROG
from normlab_lab.demo.experiment import run_demo
from normlab_lab.demo.report import first_table
from normlab_lab.reproduce.cifar10 import cifar10_grids, has_cifar10, write_synthetic_cifar10
from normlab_lab.reproduce.mnist1d import FULL_PROTOCOL, SMOKE_PROTOCOL
from normlab_lab.verdicts import PAPER_COMPARE, PAPER_EFFECTS

NAME = "reproduce"
PRESETS = ("mnist1d", "cifar10-pws")
#: Each preset's output directory; its --smoke version writes beside it (``-smoke``): each claims its own.
OUTS = {"mnist1d": "runs/reproduce", "cifar10-pws": "runs/cifar10_pws"}


def _smoke(outs: dict[str, str]) -> dict[str, str]:
    return {k: f"{v}-smoke" for k, v in outs.items()}


def _claim(args: argparse.Namespace) -> str:
    """The command line that claims the output directory: the preset and --smoke each have their own."""
    preset = "" if args.preset == "mnist1d" else f" --preset {args.preset}"
    return f"{PROG} {NAME}{preset}" + (" --smoke" if args.smoke else "")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="the full reproduction: the demo's sections to their plateau (about an hour on 2 cores), or the "
        "paper's CIFAR-10 table (--preset cifar10-pws, for a GPU or a Ray cluster)",
        description="mnist1d (default): the demo's sections (a) learning rates, (b) batch sizes, (c) collapse "
        "diagnosis with guarded twins, (d) step cost, every run trained to its plateau on all of MNIST-1D with an lr "
        "schedule, seeds 300-302 (lab/docs/reproduction.md, 'Full reproduction'). cifar10-pws: the PWS paper's "
        "classification table: CIFAR-10, the plain net and the ResNet x BN, GN, SN, WN, PWS x lr 1e-2, 1e-1, 200 "
        "epochs (lr x0.1 after 100, 150, 180), SGD momentum 0.9, weight decay 5e-4, batch 128, flip + crop. "
        "Prints its estimated time first; rerun to resume.",
    )
    p.add_argument("--preset", choices=PRESETS, default="mnist1d", help="what to reproduce (default mnist1d)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long version of the same pipeline (cifar10-pws: one 2-step epoch on 256 images, random "
        "CIFAR-shaped images where --data-dir holds no CIFAR-10); checks the pipeline, proves nothing",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"output directory (default {', '.join(OUTS.values())}, with --smoke {', '.join(_smoke(OUTS).values())})",
    )
    p.add_argument("--data-dir", default=None, help="cifar10-pws: the directory holding cifar-10-batches-py")
    p.add_argument("--download", action="store_true", help="cifar10-pws: fetch CIFAR-10 (170 MB) into --data-dir")
    p.add_argument("--device", type=device, default="auto", help="cifar10-pws: cpu, cuda[:N] or auto (default)")
    p.add_argument(
        "--seeds",
        type=list_of(integer(0, MAX_SEED, what="a seed"), "seeds"),
        default=None,
        help="cifar10-pws: comma-separated seeds (default 300)",
    )
    p.add_argument(
        "--workers",
        type=integer(0, MAX_WORKERS, what="a number of workers"),
        default=0,
        help="parallel worker processes (default 0: one per usable core)",
    )
    p.add_argument("--threads", type=threads_int, default=None, help="torch threads per worker (default 1)")
    p.add_argument("--backend", choices=BACKENDS, default="process", help="process (default) or ray")
    p.add_argument("--address", default=None, help="with --backend ray: the Ray cluster (host:port or auto)")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress line (runs remaining and ETA after each run)"
    )
    p.set_defaults(run=run)
    return p


def _check(args: argparse.Namespace) -> Path:
    """Refuse options that do not fit, before anything is written; the output directory."""
    cifar = args.preset == "cifar10-pws"
    for flag, value in (("--data-dir", args.data_dir), ("--seeds", args.seeds)):
        if value is not None and not cifar:
            raise UsageError(f"{flag} applies to --preset cifar10-pws (mnist1d is generated, its seeds are fixed)")
    if args.download and not cifar:
        raise UsageError("--download applies to --preset cifar10-pws")
    if args.download and args.data_dir is None:
        raise UsageError("--download: expected a --data-dir to download cifar10 into")
    if args.address is not None and args.backend != "ray":
        raise UsageError("--address applies to --backend ray")
    if args.backend == "ray":
        require_ray(local=args.address is None)
        check_device(args.device)
        if args.address is not None:
            check_address(args.address)
    out = check_dir_option(args.out or (_smoke(OUTS) if args.smoke else OUTS)[args.preset], "--out")
    if args.data_dir is not None:
        check_dir_option(args.data_dir, "--data-dir", writable=args.download)
    if cifar and not args.smoke and not args.download and not has_cifar10(args.data_dir):
        raise UsageError(
            f"--data-dir: expected CIFAR-10's python batches (cifar-10-batches-py) in "
            f"{args.data_dir or 'a --data-dir'}; "
            "add --download to fetch them, or --smoke to check the pipeline on random images"
        )
    return out


def _run_mnist1d(args: argparse.Namespace, out: Path) -> int:
    with out_lock(out, NAME, claim=_claim(args), record="demo.json"):
        for d in (out, out / "data"):
            remove_stale_temps(d)
        demo = run_demo(
            out,
            protocol=SMOKE_PROTOCOL if args.smoke else FULL_PROTOCOL,
            mode="smoke" if args.smoke else "full",
            workers=args.workers,
            threads=args.threads,
            progress=not args.no_progress,
            backend=args.backend,
            address=args.address,
            announce=lambda grids, after_s: announce_grids(NAME, grids, args.workers, args.address, after_s, PROG),
        )
    print("\n".join(first_table(demo)))
    print(f"\nreport: {out / 'report.md'}")
    return 0


def _cifar_data(args: argparse.Namespace, out: Path) -> str:
    """The data directory of the run: --data-dir (downloaded first with --download), or for a smoke run without
    CIFAR-10 there, random CIFAR-shaped batches under OUT/synthetic-cifar10 (said in one line)."""
    if args.download:
        download_cifar10(args.data_dir)
    if has_cifar10(args.data_dir):
        return str(args.data_dir)
    where = out / "synthetic-cifar10"
    write_synthetic_cifar10(where)
    print(f"{PROG} {NAME}: no CIFAR-10 in --data-dir; the smoke run uses random CIFAR-shaped images ({where})")
    return str(where)


def _run_cifar10(args: argparse.Namespace, out: Path) -> int:
    with out_lock(out, NAME, claim=_claim(args)):
        remove_stale_temps(out)
        data_dir = _cifar_data(args, out)
        specs = cifar10_grids(tuple(args.seeds or (300,)), data_dir, smoke=args.smoke, device=args.device)
        grids = [plan_grid(PAPER_COMPARE, spec, out / model) for model, spec in specs.items()]
        estimate_s = announce_grids(NAME, grids, args.workers, args.address, prog=PROG)
        for g in grids:
            g.start()
        try:
            run_cells(
                grids,
                workers=args.workers,
                threads=args.threads,
                progress=not args.no_progress,
                backend=args.backend,
                address=args.address,
                estimate_s=estimate_s,
                label=f"{PROG} {NAME}",
            )
        finally:
            results = [g.finish(render=True) for g in grids]
    for g, r in zip(grids, results):
        print_summary(r, g.out, PAPER_EFFECTS)
    return 0


def run(args: argparse.Namespace) -> int:
    out = _check(args)
    if args.preset == "cifar10-pws":
        return _run_cifar10(args, out)
    return _run_mnist1d(args, out)


__all__ = ["add_parser", "run", "PRESETS"]
