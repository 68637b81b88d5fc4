"""Dispatched aten ops of one training step (forward + backward) per layer, next to torch's layer it replaces.

At small shapes a normalization layer's cost is its per-op dispatch (a few microseconds each on a CPU), not its
passes over the data, so the number of aten ops one training step dispatches is the deterministic twin of the
timed ratios of ``bench_layers.py``: it does not move with the machine's load. Counted with a ``TorchDispatchMode``
over one forward and backward (``backward`` with a given gradient), after two warm-up steps, grouped per op.

    OMP_NUM_THREADS=1 python benchmarks/count_ops.py            # the table
    OMP_NUM_THREADS=1 python benchmarks/count_ops.py --verbose  # and each layer's ops by name
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normlab.nn as L

PAST_WARMUP = 30_000


class _OpLog(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_step(module: nn.Module, x: torch.Tensor, warmup: int = 2) -> collections.Counter:
    """aten ops of one forward + backward of ``module`` on ``x`` (a leaf requiring grad), after ``warmup`` steps."""
    g = torch.randn_like(x)
    for _ in range(warmup):
        module(x).backward(g)
    with _OpLog() as log:
        module(x).backward(g)
    return log.ops


def _brn(dim, c, **kw):
    m = getattr(L, f"BatchRenorm{dim}d")(c, **kw)
    if m.schedule is not None:
        m.num_batches_tracked.fill_(PAST_WARMUP)
    return m


def _cases():
    """(name, reference module, candidate modules by name, input shape); a name ending in channels_last: that
    layout."""
    for shape in [(256, 256), (32, 64), (2, 64, 32, 32)]:
        dim = {2: 1, 4: 2}[len(shape)]
        c = shape[1]
        bn = getattr(nn, f"BatchNorm{dim}d")(c)
        yield (
            f"{shape}",
            bn,
            {
                f"BatchRenorm{dim}d schedule (past warm-up)": _brn(dim, c),
                f"BatchRenorm{dim}d rmax=3, dmax=5": _brn(dim, c, rmax=3.0, dmax=5.0),
                f"BatchRenorm{dim}d rmax=1, dmax=0": _brn(dim, c, rmax=1.0, dmax=0.0),
            },
            shape,
        )
    for layout in ("contiguous", "channels_last"):
        name = f"(2, 64, 32, 32) {layout}"
        yield name, nn.BatchNorm2d(64), {"SwitchableNorm2d": L.SwitchableNorm2d(64)}, (2, 64, 32, 32)
        for track in (False, True):
            suffix = "(track_running_stats)" if track else ""
            ref = nn.InstanceNorm2d(64, affine=True, track_running_stats=track)
            ours = L.InstanceNorm2d(64, affine=True, track_running_stats=track)
            yield name, ref, {f"InstanceNorm2d{suffix}": ours}, (2, 64, 32, 32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--verbose", action="store_true", help="list each layer's ops by name")
    args = parser.parse_args(argv)
    torch.manual_seed(100)
    print(f"{'shape':<32} {'layer':<44} {'ops':>5} {'torch':>6} {'ratio':>6}")
    for shape_name, ref, candidates, shape in _cases():
        x = torch.randn(shape)
        if shape_name.endswith("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        ref_ops = count_step(ref, x)
        ref_n = sum(ref_ops.values())
        for name, module in candidates.items():
            ops = count_step(module, x)
            n = sum(ops.values())
            print(f"{shape_name:<32} {name:<44} {n:>5} {ref_n:>6} {n / ref_n:>6.2f}")
            if args.verbose:
                print("    " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
        if args.verbose:
            print("    torch: " + ", ".join(f"{k} x{v}" for k, v in sorted(ref_ops.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
