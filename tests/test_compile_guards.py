"""Every layer under torch.compile(fullgraph=True, dynamic=True): no graph break, and no recompile when the batch
size changes or the model goes between train and eval (every layer, every dim, beside the torch layer it stands
beside, which must compile exactly as often).

A compiled training step is what CrossQ-style users run (``torch.compile(update)``); a graph break splits it, and a
recompile per batch size or per ``.train()``/``.eval()`` switch (evaluation every few steps) costs seconds each time
and ends in the recompile limit. The check counts the graphs Dynamo compiles and the graph breaks it records
(``torch._dynamo.utils.counters``), with the ``aot_eager`` backend: AOT autograd traces forward and backward with
dynamic shapes as inductor's would, without generating kernels. Schedule: training steps (forward and backward) at
batch sizes 7, 9, 12, eval (under ``no_grad``) at 8 and 10, training at 11 again, eval at 13: one graph per mode,
two in all.
(The batch sizes differ from every other size of the input: Dynamo would otherwise assume two equal sizes stay
equal, "duck sizing", and compile again when they part, for torch's layers as for these.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normlab.nn as L

C = 4
SPATIAL = {1: (6,), 2: (5, 6), 3: (3, 4, 5)}
SCHEDULE = [("train", 7), ("train", 9), ("train", 12), ("eval", 8), ("eval", 10), ("train", 11), ("eval", 13)]


def compile_counts(module: nn.Module, tail: tuple[int, ...], fullgraph: bool = True, seed: int = 100) -> dict:
    """Run the schedule on ``module`` compiled; return ``{"graphs": frames compiled, "breaks": graph breaks}``."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=fullgraph, dynamic=True)
    gen = torch.Generator().manual_seed(seed)
    for mode, batch in SCHEDULE:
        module.train(mode == "train")
        x = torch.randn((batch, *tail), generator=gen)
        if mode == "train":
            x.requires_grad_()
            compiled(x).square().sum().backward()
        else:
            with torch.no_grad():
                compiled(x)
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def _brn(cls, **kw):
    def make():
        m = cls(C, **kw)
        m.num_batches_tracked.fill_(30_000)  # past the default schedule's warm-up: renormalizing
        return m

    return make


def _cases():
    """(id, normlab layer factory, torch layer factory or None, input shape without the batch dim)."""
    for k, cls, ref in ((1, L.BatchRenorm1d, nn.BatchNorm1d), (2, L.BatchRenorm2d, nn.BatchNorm2d)):
        yield f"BatchRenorm{k}d", _brn(cls), lambda ref=ref: ref(C), (C, *SPATIAL[k])
    yield "BatchRenorm1d-NC", _brn(L.BatchRenorm1d), lambda: nn.BatchNorm1d(C), (C,)
    yield "BatchRenorm3d", _brn(L.BatchRenorm3d), lambda: nn.BatchNorm3d(C), (C, *SPATIAL[3])
    yield "BatchRenorm2d-constant", _brn(L.BatchRenorm2d, rmax=3.0, dmax=5.0), None, (C, *SPATIAL[2])
    yield "BatchRenorm2d-identity", _brn(L.BatchRenorm2d, rmax=1.0, dmax=0.0), None, (C, *SPATIAL[2])
    yield "BatchRenorm2d-cumulative", _brn(L.BatchRenorm2d, momentum=None), None, (C, *SPATIAL[2])
    yield "SyncBatchRenorm", _brn(L.SyncBatchRenorm), lambda: nn.SyncBatchNorm(C), (C, *SPATIAL[2])
    for k in (1, 2, 3):
        bn = getattr(nn, f"BatchNorm{k}d")
        yield (
            f"SwitchableNorm{k}d",
            lambda k=k: getattr(L, f"SwitchableNorm{k}d")(C),
            lambda bn=bn: bn(C),
            (
                C,
                *SPATIAL[k],
            ),
        )
        for name, kw in (("affine", {"affine": True}), ("tracked", {"affine": True, "track_running_stats": True})):
            ours, ref = getattr(L, f"InstanceNorm{k}d"), getattr(nn, f"InstanceNorm{k}d")
            yield (
                f"InstanceNorm{k}d-{name}",
                lambda ours=ours, kw=kw: ours(C, **kw),
                lambda ref=ref, kw=kw: ref(C, **kw),
                (C, *SPATIAL[k]),
            )
        conv = getattr(nn, f"Conv{k}d")
        for prefix in ("WS", "PWS"):
            ours = getattr(L, f"{prefix}Conv{k}d")
            yield (
                f"{prefix}Conv{k}d",
                lambda ours=ours: ours(C, 3, 3, padding=1),
                lambda conv=conv: conv(C, 3, 3, padding=1),
                (C, *SPATIAL[k]),
            )
    yield "PWSConv2d-init_alpha", lambda: L.PWSConv2d(C, 3, 3, padding=1, init_alpha=True), None, (C, *SPATIAL[2])


CASES = list(_cases())


def test_every_normlab_layer_is_checked():
    from normlab.nn.registry import CONV_KINDS, NORM_NAMES, conv_entry, norm_entry

    entries = [norm_entry(n) for n in NORM_NAMES] + [conv_entry(k) for k in CONV_KINDS]
    ours = {c for entry in entries for c in entry.classes.values()}
    ours = {c.__name__ for c in ours if c.__module__.startswith("normlab")} | {"SyncBatchRenorm"}
    assert ours <= {case[0].split("-")[0] for case in CASES}


@pytest.mark.parametrize("make,make_ref,tail", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_no_graph_break_and_one_graph_per_mode(make, make_ref, tail):
    torch.manual_seed(100)
    counts = compile_counts(make(), tail)
    assert counts == {"graphs": 2, "breaks": 0}
    if make_ref is not None:  # the torch layer it stands beside compiles as often
        assert compile_counts(make_ref(), tail) == counts


class _BranchesOnBatch(nn.Module):
    """A layer that branches on the batch size in Python (a guard: one graph per side) and, with ``breaks``, stops
    the graph (as a host read-back or an untraceable call would)."""

    def __init__(self, breaks: bool):
        super().__init__()
        self.breaks = breaks

    def forward(self, x):
        if x.shape[0] > 8:
            x = x * 2
        if self.breaks:
            torch._dynamo.graph_break()
        return x + 1


def test_the_check_sees_a_recompile_and_a_graph_break():
    """The counts above can fail: a size branch recompiles per batch-size range, and a graph break is counted
    (and refused with fullgraph=True)."""
    assert compile_counts(_BranchesOnBatch(False), (C,)) == {"graphs": 4, "breaks": 0}  # (small, large) x mode
    assert compile_counts(_BranchesOnBatch(True), (C,), fullgraph=False)["breaks"] > 0
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compile_counts(_BranchesOnBatch(True), (C,))
