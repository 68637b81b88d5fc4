"""The variance monitor on an FSDP2 model (``torch.distributed.fsdp.fully_shard``), on CPU with 2 processes::

    torchrun --nproc_per_node 2 docs/examples/monitor_fsdp.py --steps 20 --every 5 --jsonl runs/fsdp/monitor.jsonl

Each rank trains on its own share of every batch and holds a shard of each weight (whole output filters). The monitor
merges what the ranks measured in one collective per recorded step, so every rank holds the same records - those of
the unsharded model on the global batch - and its rules raise the same events at the same steps. Each rank prints
its last record of the classifier; the lines are identical. ``tests/test_monitor_distributed.py`` runs this script.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from normlab.monitor import VarianceMonitor
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
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        model = build_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mon = VarianceMonitor(model, every=args.every, optimizer=opt)  # after fully_shard, attached to the optimizer
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
        for _ in range(args.steps):
            x = torch.randn(16, 3, 8, 8, generator=data)
            y = torch.randint(0, 10, (16,), generator=data)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # records on the monitor's steps, checks the rules: the same events on every rank
        last = [r for r in mon.records if r["layer"] == "4"][-1]
        line = (
            f"rank {rank}: step {last['step']} layer 4 output_var {last['output_var']:.6g} "
            f"weight_var {last['weight_var']:.6g} shift {last['shift']:.6g} events {[e.rule for e in mon.events]}\n"
        )
        sys.stdout.write(line)  # one write: the ranks' lines do not interleave
        sys.stdout.flush()
        if rank == 0 and args.jsonl:
            mon.to_jsonl(args.jsonl)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
