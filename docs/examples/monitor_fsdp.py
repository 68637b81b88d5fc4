"""The variance monitor and the collapse guard on an FSDP2 model (``torch.distributed.fsdp.fully_shard``), on CPU with
2 processes::

    torchrun --nproc_per_node 2 docs/examples/monitor_fsdp.py --steps 20 --every 5 --jsonl runs/fsdp/monitor.jsonl
    torchrun --nproc_per_node 2 docs/examples/monitor_fsdp.py --steps 20 --nan-at 12 --store dcp --snapshots runs/fsdp

Each rank trains on its own share of every batch and holds a shard of each weight (whole output filters). The monitor
merges what the ranks measured in one collective per recorded step, so every rank holds the same records - those of
the unsharded model on the global batch - and its rules raise the same events at the same steps. The guard keeps
each rank's own shards of the model and the optimizer state in its snapshots and shares what the ranks saw in one
collective per check: with ``--nan-at N`` rank 1 alone sees a NaN loss at step N, and both ranks roll back to the
same snapshot at the same lower learning rate. Each rank prints its last record of the classifier and the rescues;
the lines are identical. ``tests/test_monitor_distributed.py`` runs this script.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from normlab.monitor import CollapseGuard, RescueOptions, SnapshotOptions, VarianceMonitor
from normlab.nn import PWSConv2d, SyncBatchRenorm


def build_model() -> nn.Module:
    """PWS conv -> synchronized Batch Renormalization -> ReLU -> linear, each weight sharded over the ranks."""
    torch.manual_seed(100)  # the same initial weights on every rank; fully_shard keeps each rank's shard
    model = nn.Sequential(
        PWSConv2d(3, 16, 3, padding=1),
        SyncBatchRenorm(16),  # batch statistics over every rank's samples
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )
    fully_shard(model[0])
    fully_shard(model[4])
    fully_shard(model)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="the monitor's recording interval")
    parser.add_argument("--jsonl", default=None, help="rank 0 writes the monitor log (JSONL) here")
    parser.add_argument("--snapshot-every", type=int, default=4, help="the guard's snapshot interval")
    parser.add_argument("--check-every", type=int, default=2, help="the guard's check interval")
    parser.add_argument("--store", default="host", choices=("host", "disk", "dcp"), help="where snapshots live")
    parser.add_argument("--snapshots", default=None, help="the directory of the disk and dcp stores")
    parser.add_argument("--nan-at", type=int, default=None, help="rank 1 alone sees a NaN loss at this step")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = VarianceMonitor(model, every=args.every, optimizer=opt)  # after fully_shard, attached to the optimizer
        guard = CollapseGuard(  # after the monitor, on the same optimizer: every rank with the same options
            model,
            opt,
            mon,
            snapshots=SnapshotOptions(every=args.snapshot_every, store=args.store, directory=args.snapshots),
            rescue=RescueOptions(check_every=args.check_every),
        )
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
        for step in range(args.steps):
            x = torch.randn(16, 3, 8, 8, generator=data)
            y = torch.randint(0, 10, (16,), generator=data)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if step == args.nan_at and rank == 1:
                loss = loss * float("nan")  # trouble on one rank only
            guard.observe_loss(loss)
            opt.step()  # the monitor records and checks its rules; the guard checks, snapshots, rolls back
        last = [r for r in mon.records if r["layer"] == "4"][-1]
        rescues = [(r.step, r.kind, r.restored_step, r.lr_after) for r in guard.rescues]
        line = (
            f"rank {rank}: step {last['step']} layer 4 output_var {last['output_var']:.6g} "
            f"weight_var {last['weight_var']:.6g} shift {last['shift']:.6g} events {[e.rule for e in mon.events]} "
            f"rescues {rescues} snapshot bytes {guard.nbytes}\n"
        )
        sys.stdout.write(line)  # one write: the ranks' lines do not interleave
        sys.stdout.flush()
        guard.close()
        if rank == 0 and args.jsonl:
            mon.to_jsonl(args.jsonl)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
