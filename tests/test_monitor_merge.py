"""The pieces the monitor merges its records with, on one process: the moments merge against the formula, the
reduction's single-rank identity, the static channel counts every rank agrees on, the record keys from the moments,
and the refusals that need no second rank (tests/test_monitor_distributed.py runs 2 gloo ranks; the read-backs are
counted in tests/test_readbacks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor, stats
from normlab.monitor.hooks import StepStats, activation_moments
from normlab.monitor.layers import input_channel_dims, input_channels, layer_kind
from normlab.monitor.ranks import Ranks, Reduction
from normlab.nn import BatchRenorm1d, InstanceNorm3d, PWSConv1d, SwitchableNorm2d, WSConv3d

F64 = torch.float64


def _parts(sizes, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=F64) * 3 + 7 for n in sizes]


def _moments(parts):
    count = torch.tensor([float(p.numel()) for p in parts], dtype=F64)
    mean = torch.stack([p.mean() if p.numel() else torch.zeros((), dtype=F64) for p in parts])
    m2 = torch.stack([(p - p.mean()).square().sum() if p.numel() else torch.zeros((), dtype=F64) for p in parts])
    return count, mean, m2


@pytest.mark.parametrize("sizes", [(3, 5), (4, 0, 9, 1), (0, 6)])
def test_merge_moments_is_the_variance_of_the_union(sizes):
    """N = sum n_r, mean = sum n_r mean_r / N, M2 = sum (M2_r + n_r (mean_r - mean)^2): the biased variance M2 / N
    of the concatenated parts (an empty part, with mean and M2 given as 0, adds nothing)."""
    parts = _parts(sizes)
    count, mean, m2 = stats.merge_moments(*_moments(parts))
    union = torch.cat(parts)
    assert float(count) == union.numel()
    torch.testing.assert_close(mean, union.mean(), rtol=1e-13, atol=0)
    torch.testing.assert_close(m2 / count, union.var(unbiased=False), rtol=1e-12, atol=0)


def test_merge_moments_of_one_part_is_that_part_and_keeps_non_finite_values():
    count, mean, m2 = _moments(_parts((5,)))
    merged = stats.merge_moments(count, mean, m2)
    assert all(torch.equal(a, b) for a, b in zip(merged, (count[0], mean[0], m2[0])))
    nan_parts = _parts((3, 4))
    nan_parts[1][2] = float("nan")
    assert torch.isnan(stats.merge_moments(*_moments(nan_parts))[2])


def test_a_reduction_on_one_process_returns_every_part_unchanged():
    red = Reduction(Ranks())
    mean, m2, rows = torch.tensor(2.0), torch.tensor(3.0), torch.arange(4.0)
    handles = [red.moments((5, mean, m2)), red.moments(None), red.weighted((7, rows), 4), red.weighted(None, 3)]
    handles.append(red.rows(rows, 0, 4))
    red.run()
    got = [red.get(h) for h in handles]
    assert got[0] == (5, mean, m2) and got[1] == (0, None, None)
    assert got[2][0] is rows and got[2][1] == 7 and got[3] == (None, 0) and got[4] is rows


def _layers():
    """One module of every watched family, with an input: conv 1d/2d/3d (grouped, transposed, WS/PWS), linear on
    2-D and 3-D inputs, lazy linear after its first forward, and the norms (BN, BRN, SN, IN, GN, LN, RMSNorm)."""
    lazy = nn.LazyLinear(3)
    lazy(torch.randn(2, 6))
    return [
        (nn.Conv1d(4, 6, 3, groups=2), (2, 4, 7)),
        (PWSConv1d(3, 5, 3), (3, 7)),  # unbatched
        (nn.Conv2d(3, 4, 3), (2, 3, 6, 6)),
        (WSConv3d(2, 3, 1), (2, 2, 3, 3, 3)),
        (nn.ConvTranspose2d(4, 6, 3, groups=2), (2, 4, 5, 5)),
        (nn.Linear(5, 3), (4, 5)),
        (nn.Linear(5, 3), (2, 3, 5)),
        (lazy, (2, 6)),
        (nn.BatchNorm2d(4), (3, 4, 2, 2)),
        (BatchRenorm1d(5), (6, 5)),
        (SwitchableNorm2d(4), (3, 4, 2, 2)),
        (InstanceNorm3d(3, affine=True), (2, 3, 2, 2, 2)),
        (nn.GroupNorm(2, 4), (3, 4, 5)),
        (nn.LayerNorm([4, 5]), (2, 3, 4, 5)),
        (nn.RMSNorm(6), (2, 3, 6)),
    ]


@pytest.mark.parametrize("module,shape", _layers(), ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_the_static_channel_count_is_the_one_the_input_gives(module, shape):
    """Every rank sizes its part of the merge from the module (input_channels), before knowing whether the layer ran
    on it: that count is the channel count input_channel_dims finds in a real input."""
    kind = layer_kind(module)
    x = torch.randn(shape)
    dims = input_channel_dims(module, kind, x)
    assert dims is not None and input_channels(module, kind) == int(torch.tensor([x.shape[d] for d in dims]).prod())


def test_the_activation_moments_give_the_record_keys_of_the_formulas():
    """output_var = M2 / numel = Var[Y]; input keys from E[X], E[X^2]; channel keys from the per-channel moments."""
    conv = nn.Conv2d(3, 4, 3, dtype=F64)
    x = torch.randn(5, 3, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(100)) + 0.5
    y = conv(x).detach()
    step = StepStats()
    step.add_activation("c", activation_moments(conv, "conv", (x,), y))
    rec = step.finish()[0]["c"]
    assert rec["output_var"] == pytest.approx(float(y.var(unbiased=False)), rel=1e-12)
    m, sq = float(x.mean()), float(x.square().mean())
    assert (rec["input_mean_sq"], rec["input_sq"]) == (pytest.approx(m * m, rel=1e-12), pytest.approx(sq, rel=1e-12))
    ratios = x.mean((0, 2, 3)).square() / x.square().mean((0, 2, 3))
    assert rec["input_ratio_ch_mean"] == pytest.approx(float(ratios.mean()), rel=1e-12)
    assert rec["input_ratio_ch_max"] == pytest.approx(float(ratios.max()), rel=1e-12)


def test_fsdp1_is_refused_in_one_line():
    """FullyShardedDataParallel (FSDP1) flattens the weights it shards: refused, naming fully_shard. (FSDP1 needs an
    accelerator to be built, so a stand-in of its class is used.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class StandIn(FullyShardedDataParallel):
        def __init__(self, module):
            nn.Module.__init__(self)
            self._fsdp_wrapped_module = module

    with pytest.raises(ValueError) as info:
        VarianceMonitor(nn.Sequential(StandIn(nn.Linear(2, 2))))
    said = str(info.value)
    assert "FullyShardedDataParallel (FSDP1)" in said and "fully_shard" in said and "\n" not in said
