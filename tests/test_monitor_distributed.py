"""The monitor on 2 gloo ranks (CPU): FSDP2 (``fully_shard``) and DDP give the records, events and rule states of the
unsharded model on the global batch, identical on both ranks; SyncBatchRenorm inside FSDP2 is the unsharded layer on
the global batch; placements that split a filter are refused in one line.

The model (issue: PWSConv2d -> BatchRenorm2d -> ReLU -> Linear, here with SyncBatchRenorm so that the sharded
forward is the global one) has 5 conv filters (3 + 2 rows on the ranks), a linear layer of 3 (2 + 1) and one of 1
(1 + 0: an empty shard); the ranks get 3 and 5 samples of each batch of 8 (uneven: the count-weighted merges).
Each rank's loss is its samples' sum times WORLD / 8, so that the gradient both wrappers average over the ranks, and
the mean of the ranks' losses, are the unsharded model's mean loss on the 8 samples.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import CountdownRule, FactorRule, LossSpikeRule, RegimeRule
from normlab.nn import BatchRenorm2d, PWSConv2d, SyncBatchRenorm, WSConv2d

F64 = torch.float64
WORLD = 2
SPLITS = (3, 5)
STEPS = 5
EVERY = 2  # steps 1 and 3 are light steps (the countdown's output variance, merged over the ranks)
BLOW_UP = 3  # the hidden linear layer's weight is multiplied at this step: the variance rules fire
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(sync: bool) -> nn.Sequential:
    torch.manual_seed(100)
    norm = (SyncBatchRenorm if sync else BatchRenorm2d)(5, dtype=F64, rmax=1.3, dmax=0.4, momentum=0.5)
    with torch.no_grad():
        norm.running_mean.copy_(torch.tensor([0.8, -0.1, 0.0, 0.3, -0.5]))  # the renorm limits clip some channels
        norm.running_var.copy_(torch.tensor([4.0, 1.1, 0.2, 0.5, 2.0]))
    return nn.Sequential(
        PWSConv2d(3, 5, 3, padding=1, dtype=F64),
        norm,
        nn.ReLU(),
        WSConv2d(5, 3, 1, dtype=F64),
        nn.GroupNorm(1, 3, dtype=F64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 3, dtype=F64),
        nn.ReLU(),
        nn.Linear(3, 1, dtype=F64),
    )


SHARDED = (0, 3, 7, 9)  # the layers fully_shard is applied to (then the whole model)


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for i in SHARDED:
        fully_shard(model[i])
    fully_shard(model)
    return model


def _rules():
    return [
        # the raw shift, asked for: the blow-up scales a kernel as a whole, which the default scale-free shift
        # leaves alone (round 4); a factor event is what this test needs merged across the ranks
        FactorRule(watch=("output_var", "shift"), explode_factor={"output_var": 1e3, "shift": 100.0}),
        RegimeRule(),
        CountdownRule(grad_ratio=100.0),  # the gradient norm on every step (sharded gradients: one all-reduce)
        LossSpikeRule(factor=1.5, window=3, min_history=1),  # the loss on every step: the mean over the ranks
    ]


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 3, 4, 4, generator=g, dtype=F64) * 1.5 + 0.3, torch.randn(8, 1, generator=g, dtype=F64)


class _Updates:
    """A sink that keeps the per-filter mean updates of every recorded step."""

    def __init__(self):
        self.updates = []

    def write_records(self, records, updates):
        self.updates.append({k: v.detach().double().clone() for k, v in updates.items()})


def _train(model, core: nn.Module, lo: int, hi: int) -> dict:
    """STEPS monitored SGD steps on samples [lo, hi) of each batch; what the ranks and the reference compare."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = VarianceMonitor(model, every=EVERY, rules=_rules(), optimizer=opt)
    sink = _Updates()
    mon.add_sink(sink)
    for step in range(STEPS):
        if step == BLOW_UP:
            with torch.no_grad():
                core[7].weight.mul_(30.0)
        x, y = _batch(step)
        loss = F.mse_loss(model(x[lo:hi]), y[lo:hi], reduction="sum") * (WORLD if hi - lo < 8 else 1) / 8
        opt.zero_grad()
        loss.backward()
        mon.observe_loss(loss)
        opt.step()
    return {
        "records": list(mon.records),
        "events": [e.to_dict() for e in mon.events],
        "rules": {r.name: r.state_dict() for r in mon.rules},
        "updates": sink.updates,
        "brn": _full_state(core[1]),
    }


def _full_state(module: nn.Module) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _fsdp_run(lo: int, hi: int) -> dict:
    model = _shard(_model(sync=True))
    out = _train(model, model, lo, hi)
    out["state"] = _full_state(model)
    return out


def _ddp_run(lo: int, hi: int) -> dict:
    core = _model(sync=True)
    out = _train(nn.parallel.DistributedDataParallel(core), core, lo, hi)
    out["state"] = _full_state(core)
    return out


def _collectives(lo: int, hi: int) -> dict[str, list[int]]:
    """The collectives (any: the monitor's all-reduce and any a DTensor op would start) of each optimizer step under
    FSDP2 with every=2: with rules=[], one on each recorded step and none on the others; with the default rules
    (the countdown reads every step's output variance) one on every step."""
    from torch.distributed.tensor.debug import CommDebugMode

    counts = {}
    for key, rules in (("record_only", []), ("default", None)):
        model = _shard(_model(sync=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = VarianceMonitor(model, every=2, rules=rules, optimizer=opt)
        counts[key] = []
        for step in range(4):
            x, y = _batch(step)
            loss = F.mse_loss(model(x[lo:hi]), y[lo:hi])
            opt.zero_grad()
            loss.backward()
            with CommDebugMode() as comm:
                opt.step()
            counts[key].append(comm.get_total_counts())
        assert mon.records
    return counts


def _refusals() -> dict:
    """What cannot be supported, each refused in one line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    said = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    row = parallelize_module(nn.Sequential(nn.Linear(4, 6)), mesh, {"0": RowwiseParallel()})  # weight Shard(1)
    up = nn.Sequential(nn.ConvTranspose2d(4, 3, 3))
    fully_shard(up[0])
    fully_shard(up)  # Shard(0) of a (C_in, C_out, k, k) weight: input channels, not filters
    for key, model in (("rowwise", row), ("conv_transpose", up)):
        try:
            VarianceMonitor(model)
            said[key] = None
        except ValueError as e:
            said[key] = str(e)
    late = _model(sync=False)
    opt = torch.optim.SGD(late.parameters(), lr=0.05)
    VarianceMonitor(late, every=1, rules=[], optimizer=opt)  # made before fully_shard: refused at its first record
    _shard(late)
    x, y = _batch(0)
    F.mse_loss(late(x), y).backward()
    try:
        opt.step()  # the monitor's step: out of the optimizer's step hooks
        said["late"] = None
    except RuntimeError as e:
        said["late"] = str(e)
    return said


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        lo = sum(SPLITS[:rank])
        hi = lo + SPLITS[rank]
        result = {"fsdp": _fsdp_run(lo, hi), "ddp": _ddp_run(lo, hi), "collectives": _collectives(lo, hi)}
        result["refusals"] = _refusals()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """The unsharded model on one process, the global batch, BatchRenorm2d (what SyncBatchRenorm reduces to)."""
    torch.set_num_threads(1)
    model = _model(sync=False)
    out = _train(model, model, 0, 8)
    out["state"] = _full_state(model)
    return out


def _close(got, want, where: str, rel: float = 1e-9) -> None:
    """Nested dicts/lists of numbers equal to ``rel`` (tensors to the same), keys and structure exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(set(got) ^ set(want)))
        for k in want:
            _close(got[k], want[k], f"{where}.{k}", rel)
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]", rel)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got.double(), want.double(), rtol=rel, atol=1e-12, msg=where)
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=rel, abs=1e-12, nan_ok=True), where
    else:
        assert got == want, where


def _identical(got, want, where: str) -> None:
    """Nested values equal exactly (tensors by value, nan equal to nan)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            _identical(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _identical(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, float):
        assert got == want or (math.isnan(got) and math.isnan(want)), where
    else:
        assert got == want, where


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_records_events_and_rules_equal_the_unsharded_run_on_every_rank(ranks, reference, wrapper):
    got = [r[wrapper] for r in ranks]
    # every rank holds the same records, events and rule states, bit for bit (one merge, the same on every rank)
    for key in ("records", "events", "rules", "updates"):
        _identical(got[1][key], got[0][key], key)
    # and they are the unsharded model's on the global batch: weights, updates, activations, the merged loss and
    # the gradient norm the rules read (in their states)
    records = [dict(r) for r in got[0]["records"]]
    types = {r["layer"]: r.pop("type") for r in records}
    want = [dict(r) for r in reference["records"]]
    want_types = {r["layer"]: r.pop("type") for r in want}
    assert types == dict(want_types, **{"1": "SyncBatchRenorm"})  # FSDP2's FSDPPWSConv2d is recorded as PWSConv2d
    _close(records, want, "records")
    _close(got[0]["events"], reference["events"], "events")
    _close(got[0]["rules"], reference["rules"], "rules", rel=1e-6)  # the gradient norm is taken in float32
    _close(got[0]["updates"], reference["updates"], "updates")
    assert [e["rule"] for e in reference["events"]] == ["countdown", "loss_spike", "factor"]  # the blow-up was seen
    assert {r["step"] for r in reference["records"]} == {0, 2, 4}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_sync_batch_renorm_inside_the_wrapper_trains_as_the_unsharded_layer(ranks, reference, wrapper):
    """SyncBatchRenorm's running statistics and step counter equal on both ranks and equal BatchRenorm2d's on the
    global batch; every parameter after the steps equals the unsharded model's."""
    got = [r[wrapper] for r in ranks]
    for key, value in got[0]["brn"].items():
        assert torch.equal(value, got[1]["brn"][key]), key
    _close(got[0]["brn"], reference["brn"], "brn", rel=1e-10)
    assert int(got[0]["brn"]["num_batches_tracked"]) == STEPS
    _close(got[0]["state"], reference["state"], "state", rel=1e-9)


@pytest.mark.timeout(240)
def test_the_monitor_communicates_once_per_monitored_step_on_every_rank(ranks):
    for r in ranks:
        assert r["collectives"] == {"record_only": [1, 0, 1, 0], "default": [1, 1, 1, 1]}


@pytest.mark.timeout(240)
def test_placements_that_split_a_filter_are_refused_in_one_line(ranks):
    for r in ranks:
        said = r["refusals"]
        assert said["rowwise"] is not None and "\n" not in said["rowwise"]
        assert "layer '0' (Linear)" in said["rowwise"] and "Shard(dim=1)" in said["rowwise"]
        assert "tensor parallelism" in said["rowwise"] and "Shard(0)" in said["rowwise"]
        assert said["conv_transpose"] is not None and "ConvTranspose2d" in said["conv_transpose"]
        assert "Replicate only" in said["conv_transpose"]
        assert "layer '0' was sharded" in said["late"] and "after fully_shard" in said["late"]


def _aborted_at_exit(done: subprocess.CompletedProcess) -> bool:
    """Both ranks printed their line and a rank then aborted outside Python ("terminate called without an active
    exception", SIGABRT, no Python frame in the fault handler's dump: after the script had returned). Seen in 1-3 of
    16 runs of this example on a 2-core machine loaded with three busy processes, and once in a CI run; a plain FSDP2
    loop without the monitor showed none in 20 runs, so whether the monitor raises its odds is not known (docs/
    monitor.md, "Distributed training"). A run that fails in any other way, or aborts three times, fails the test."""
    printed = sum(line.startswith("rank ") for line in done.stdout.splitlines()) == 2
    return printed and "terminate called without an active exception" in done.stderr and "exitcode: -6" in done.stderr


@pytest.mark.timeout(600)
def test_the_fsdp_example_runs_under_torchrun():
    """docs/examples/monitor_fsdp.py, as docs/monitor.md runs it: torchrun --nproc_per_node 2 on CPU, the monitor and
    the guard; rank 1 alone sees a NaN loss at step 9 and both ranks roll back to the snapshot of step 6 (snapshots
    asked every 2 steps are taken 6 apart, so that three reach the loss window of 10 and the margin of 2 back)."""
    script = os.path.join(ROOT, "docs", "examples", "monitor_fsdp.py")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    args = ["--steps", "12", "--nan-at", "9", "--snapshot-every", "2", "--check-every", "2"]
    for _ in range(3):  # gloo's C++ teardown can abort a finished rank at interpreter exit (below): run it again
        done = subprocess.run([*cmd, script, *args], env=env, capture_output=True, text=True, timeout=200)
        if done.returncode == 0 or not _aborted_at_exit(done):
            break
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and lines[0].split(":", 1)[1] == lines[1].split(":", 1)[1], done.stdout
    assert math.isfinite(float(lines[0].rsplit("output_var ", 1)[1].split()[0]))
    assert "rescues [(9, 'non_finite', 6, 0.0005)]" in lines[0], lines[0]
