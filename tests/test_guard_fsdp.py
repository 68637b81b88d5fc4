"""CollapseGuard under FSDP2 (``fully_shard`` on submodules and the root: DTensor parameters and moments) with 2 gloo
ranks on CPU.

Trouble seen on one rank only (a non-finite loss or a non-finite gradient in its shard, on rank 0 or on rank 1; a
loss climb on its share of the batch, a monitor alarm), on both, or on none: no rank waits for a collective another
never makes (every run under a timeout), both ranks roll back to the same step at the same learning rate, in one
collective per checked step, and end on the same parameters - those of the same run unsharded on one process, on
the global batch, where that is well defined (an injected NaN). With each snapshot store (host, disk, dcp), each
rank's snapshot holds its own shards only (about half of the unsharded snapshot's bytes on 2 ranks). A PWS conv and
SyncBatchRenorm model runs with the monitor too; what the guard cannot support is refused in one line.

Each rank's loss is the mean over its 4 of the 8 samples of a batch, so FSDP2's averaged gradient, and the guard's
mean of the ranks' losses, are the unsharded model's on the 8.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from normlab.monitor import (
    CollapseCriteria,
    CollapseGuard,
    Event,
    RescueOptions,
    Rule,
    RunCollapsed,
    SnapshotOptions,
    VarianceMonitor,
)
from normlab.nn import BatchRenorm2d, PWSConv2d, SyncBatchRenorm

F64 = torch.float64
WORLD = 2
SHARE = 4  # samples per rank of each batch of 8
STEPS = 16
EVERY, CHECK = 4, 2  # a snapshot every 4 steps, a check every 2
BAD = 9  # the step trouble is injected at (seen at the check after it: rolled back to step 4)
TIMEOUT_S = 150
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ models and data
def _mlp(sync: bool = False) -> nn.Sequential:
    """Layers of 48, 48 and 3 rows: shards of 24 + 24 and an uneven 2 + 1."""
    torch.manual_seed(100)
    return nn.Sequential(
        nn.Linear(6, 48, dtype=F64), nn.ReLU(), nn.Linear(48, 48, dtype=F64), nn.ReLU(), nn.Linear(48, 3, dtype=F64)
    )


def _pws_brn(sync: bool) -> nn.Sequential:
    """PWS conv -> (Sync)BatchRenorm -> ReLU -> linear: 5 filters (3 + 2 rows), a head of 3 (2 + 1)."""
    torch.manual_seed(100)
    norm = (SyncBatchRenorm if sync else BatchRenorm2d)(5, dtype=F64, rmax=1.3, dmax=0.4, momentum=0.5)
    return nn.Sequential(
        PWSConv2d(3, 5, 3, padding=1, dtype=F64), norm, nn.ReLU(), nn.Flatten(), nn.Linear(80, 3, dtype=F64)
    )


MODELS = {"mlp": (_mlp, (0, 2, 4), (6,)), "pws_brn": (_pws_brn, (0, 4), (3, 4, 4))}


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (two sharded moments per parameter); SGD for the conv net, whose conv bias before the norm has a zero
    gradient that Adam would turn into steps of rounding noise, different sharded and unsharded."""
    if kind == "mlp":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _shard(model: nn.Module, layers, tp: bool = False) -> nn.Module:
    """FSDP2 on ``layers`` and the root; or tensor parallelism: layer 0 by columns (Shard(0)), layer 2 by rows
    (Shard(1), its bias Replicate), the head left whole on each rank."""
    from torch.distributed.fsdp import fully_shard

    if tp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for i in layers:
        fully_shard(model[i])
    fully_shard(model)
    return model


def _batch(step: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(2 * SHARE, *shape, generator=g, dtype=F64), torch.randint(0, 3, (2 * SHARE,), generator=g)


class _AlarmOnRank(Rule):
    """A user's rule that raises an alarm at ``step`` on ``rank`` only, once (a transient: not in its state)."""

    name, every_step, needs_loss = "rank_alarm", True, False

    def __init__(self, rank: int, step: int) -> None:
        self.fire = step if dist.get_rank() == rank else None

    def check(self, ctx, records):
        if ctx.step != self.fire:
            return None
        self.fire = None
        return Event(self.name, "alarm", ctx.step, f"alarm on rank {dist.get_rank()}")


# ------------------------------------------------------------------------------------------------ one run
SCENARIOS = {  # name: (model, stores, guard options, the rescues both ranks must record)
    "none": ("mlp", ("host",), {}, []),
    "nan loss on rank 0": ("mlp", ("host", "dcp"), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "nan loss on rank 1": ("mlp", ("host", "disk", "dcp"), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "nan on both": ("mlp", ("host",), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "nan grad on rank 0": ("mlp", ("host",), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "nan grad on rank 1": ("mlp", ("host",), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "loss climb on rank 1": ("mlp", ("host",), {"window": 2}, [(BAD, "exploded", BAD, 4, 6, 0.005)]),
    "alarm on rank 1": ("mlp", ("host",), {"monitor": True}, [(5, "alarm", 5, 0, 6, 0.005)]),
    "give up (raise)": ("mlp", ("host",), {"max_rescues": 0}, []),
    "give up (stop)": ("mlp", ("host",), {"max_rescues": 0, "on_give_up": "stop"}, []),
    "resume nan loss on rank 1": ("mlp", ("host", "dcp"), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "tp nan loss on rank 1": ("mlp", ("host", "dcp"), {}, [(BAD, "non_finite", BAD, 4, 6, 0.005)]),
    "pws_brn nan loss on rank 1": (
        "pws_brn",
        ("host", "disk", "dcp"),
        {"monitor": True},
        [(BAD, "non_finite", BAD, 4, 6, 0.005)],
    ),
}
UNSHARDED = (
    "nan loss on rank 0",
    "nan loss on rank 1",
    "nan on both",
    "nan grad on rank 0",
    "nan grad on rank 1",
    "pws_brn nan loss on rank 1",
)


def _guard(model, opt, scenario: str, store: str, directory: str | None) -> CollapseGuard:
    extra = SCENARIOS[scenario][2]
    monitor = None
    if extra.get("monitor"):
        rules = [_AlarmOnRank(1, 5)] if scenario == "alarm on rank 1" else None
        monitor = VarianceMonitor(model, every=EVERY, rules=rules, optimizer=opt)
    return CollapseGuard(
        model,
        opt,
        monitor,
        snapshots=SnapshotOptions(every=EVERY, store=store, directory=directory),
        rescue=RescueOptions(
            check_every=CHECK,
            confirm=None,
            max_rescues=extra.get("max_rescues", 3),
            on_give_up=extra.get("on_give_up", "raise"),
        ),
        criteria=CollapseCriteria(window=extra.get("window", EVERY)),  # snapshots EVERY apart reach a window back
    )


def _poison_grad(model: nn.Module, on: int, rank: int | None) -> None:
    """A NaN in the head's gradient, in the first row of rank ``on``'s shard (rows 0:2 on rank 0, 2:3 on rank 1):
    there on rank ``on`` only, or at that global row of the whole gradient (unsharded: ``rank`` None)."""
    grad = model[4].weight.grad
    if rank is None:
        grad[2 * on, 0] = float("nan")
    elif rank == on:
        grad.to_local()[0, 0] = float("nan")


def _step(model, opt, guard, scenario: str, t: int, shape, rank: int | None):
    """One training step on batch t with the scenario's trouble: under FSDP2 rank r's 4 samples, under tensor
    parallelism and unsharded (rank None) all 8."""
    x, y = _batch(t, shape)
    lo, n = (SHARE * rank, SHARE) if rank is not None and not scenario.startswith("tp") else (0, 2 * SHARE)
    loss = F.cross_entropy(model(x[lo : lo + n]), y[lo : lo + n])
    if scenario == "nan on both" and t == BAD:
        loss = loss * float("nan")  # NaN everywhere, its gradients too
    opt.zero_grad()
    loss.backward()
    seen = loss.detach()
    on = int(scenario[-1]) if scenario[-1].isdigit() else 1  # the rank that sees the trouble (give up: rank 1)
    one_sided = "nan loss on rank" in scenario or scenario.startswith("give up")
    if one_sided and t == BAD and rank in (on, None):
        seen = seen * float("nan")  # seen by that rank only (unsharded: the mean is NaN); its gradients stay finite
    if scenario == "loss climb on rank 1" and t == BAD and rank == 1:
        seen = seen * 1e4  # its share's loss explodes: the ranks' mean does too
    if scenario.startswith("nan grad on rank") and t == BAD:
        _poison_grad(model, on, rank)
    guard.observe_loss(seen)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _outcome(model, guard, shape) -> dict:
    return {
        "rescues": [
            (r.step, r.kind, r.onset, r.restored_step, r.steps_lost, round(r.lr_after, 9)) for r in guard.rescues
        ],
        "steps": guard.steps,
        "state": {k: _full(v) for k, v in model.state_dict().items()},
        "gave_up": guard.gave_up,
        "records": None if guard.monitor is None else [dict(r) for r in guard.monitor.records],
    }


# ------------------------------------------------------------------------------------------------ the ranks
def _count_collectives(calls: list, inside: dict) -> None:
    """Wrap torch.distributed's collectives: a call made inside ``opt.step()`` is recorded with the guard's steps."""
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*a, _fn=fn, _name=name, **k):
            if inside:
                calls.append((_name, inside["guard"].steps))
            return _fn(*a, **k)

        setattr(dist, name, counted)


def _sharded_run(rank: int, scenario: str, store: str, out_dir: str, calls: list, inside: dict) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    kind = SCENARIOS[scenario][0]
    make, layers, shape = MODELS[kind]
    model = _shard(make(True), layers, tp=scenario.startswith("tp"))
    opt = _optimizer(kind, model)
    directory = None if store == "host" else os.path.join(out_dir, f"{scenario}-{store}".replace(" ", "_"))
    guard = _guard(model, opt, scenario, store, directory)
    calls.clear()
    checked, comms, collapsed = [], [], None
    for t in range(STEPS):
        if scenario.startswith("resume") and t == RESUME:
            guard = _resumed(guard, model, opt, scenario, store, directory)
        _step(model, opt, guard, scenario, t, shape, rank)
        due = guard.gave_up is None and ((guard.steps + 1) % CHECK == 0 or (guard.steps + 1) % EVERY == 0)
        if due:
            checked.append(guard.steps + 1)
        inside["guard"] = guard
        try:
            with CommDebugMode() as comm:
                opt.step()
        except RunCollapsed as e:
            collapsed = (guard.steps, e.kind, str(e).split(":")[1])
            break
        finally:
            inside.clear()
        comms.append((due, comm.get_total_counts()))
    out = _outcome(model, guard, shape)
    out.update(calls=list(calls), checked=checked, comms=comms, collapsed=collapsed, bytes=_bytes(guard, rank))
    guard.close()
    return out


RESUME = 7  # "resume": the guard's state saved after step 6 (one step not checked yet) and loaded by a new guard


def _resumed(guard, model, opt, scenario: str, store: str, directory) -> CollapseGuard:
    """This rank's guard state through torch.save / torch.load(weights_only=True) into a new guard."""
    import io

    buffer = io.BytesIO()
    torch.save(guard.state_dict(), buffer)
    guard.close()
    guard = _guard(model, opt, scenario, store, directory)
    guard.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    return guard


def _bytes(guard: CollapseGuard, rank: int) -> dict:
    """This rank's newest snapshot: what the store holds (its file's size for dcp), and its local shapes."""
    from normlab.monitor.shards import is_local_shard

    key = guard._snaps[-1].key
    held, chunks = guard._store.nbytes(key), None
    if type(guard._store).__name__ == "DCPStore":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import MetadataIndex

        path = guard._store._held[key][0]
        held = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        chunks = sorted(  # which file holds which block of the head's weight and of its first moment
            (fqn, tuple(c.offsets), tuple(c.sizes), meta.storage_data[MetadataIndex(fqn, c.offsets)].relative_path)
            for fqn in ("model.4.weight", "optimizer.state.4.exp_avg")
            for c in getattr(meta.state_dict_metadata.get(fqn), "chunks", ())
        )
    model = guard._store.get(key)["model"]
    shards = {k: tuple(v["local"].shape) for k, v in model.items() if is_local_shard(v)}
    return {"held": held, "shards": shards, "agreed": guard.nbytes, "chunks": chunks}


def _bounded(rank: int) -> dict:
    """``max_bytes`` between the two ranks' bytes: the ranks' shards differ (2 + 1 rows of the head), yet every rank
    keeps the same snapshots, and a bound too small for one is refused on both at the same step."""

    def run(max_bytes):
        model = _shard(_mlp(), MODELS["mlp"][1])
        opt = _optimizer("mlp", model)
        guard = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=EVERY, keep=10, max_bytes=max_bytes))
        try:
            for t in range(STEPS):
                _step(model, opt, guard, "none", t, MODELS["mlp"][2], rank)
                opt.step()
        except ValueError as e:
            return guard, str(e)
        return guard, None

    guard, _ = run(None)
    largest, own = guard._snaps[-1].size, guard._store.nbytes(guard._snaps[-1].key)
    out = {"largest": largest, "own": own}
    for key, limit in (("fits one", 2 * largest - 1), ("too small", largest // 2)):
        guard, said = run(limit)
        out[key] = ([s.step for s in guard._snaps], guard.steps, guard.nbytes, said)
    return out


def _refusals() -> dict:
    """What the guard cannot support, each refused in one line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import DTensor, Partial

    said = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    part = nn.Linear(4, 2)
    part.weight = nn.Parameter(DTensor.from_local(torch.zeros(2, 4), mesh, [Partial()]))
    small = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp"))["dp"]  # one rank per mesh: stages
    stage = fully_shard(nn.Sequential(nn.Linear(4, 2)), mesh=small)
    fsdp1 = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 2)), device_id=torch.device("cpu"))
    for key, model in (("partial", part), ("stage", stage), ("fsdp1", fsdp1)):
        try:
            CollapseGuard(model, torch.optim.SGD(model.parameters(), lr=0.1))
            said[key] = None
        except ValueError as e:
            said[key] = str(e)
    return said


def _layer_loads(rank: int) -> dict:
    """Every normlab layer with a state (tests/test_workflows_norms.py's list, in 2d), under fully_shard, loads its
    own sharded state silently; a NaN in rank 1's copy of each floating tensor (its shard of a parameter) is named
    on rank 1, which holds it, without a collective."""
    import warnings

    from test_workflows_norms import STATE_LAYERS
    from torch.distributed.fsdp import fully_shard

    said = {}
    for name, make, d in STATE_LAYERS:
        if d not in (0, 2):
            continue
        torch.manual_seed(100)
        layer = fully_shard(make())
        clean = {k: v.detach().clone() for k, v in layer.state_dict().items()}
        for key in [k for k, v in clean.items() if v.is_floating_point()]:
            for bad in (False, True):
                state = {k: v.detach().clone() for k, v in clean.items()}
                if bad and rank == 1:
                    local = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
                    local.view(-1)[0] = float("nan")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    layer.load_state_dict(state)
                messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
                said[name, key, bad] = (hasattr(state[key], "to_local"), messages)
    return said


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    calls, inside = [], {}
    _count_collectives(calls, inside)
    try:
        out = {
            (scenario, store): _sharded_run(rank, scenario, store, out_dir, calls, inside)
            for scenario, (_, stores, _, _) in SCENARIOS.items()
            for store in stores
        }
        out["refusals"] = _refusals()
        out["bounded"] = _bounded(rank)
        out["layer loads"] = _layer_loads(rank)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario, run once by 2 gloo ranks (one spawn for all: starting the processes is most of the time)."""
    out = tmp_path_factory.mktemp("fsdp_guard")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"FSDP2 guard workers still running after {TIMEOUT_S} s: a rank waits on another")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """The same runs on one process, unsharded, on the global batch (BatchRenorm2d for SyncBatchRenorm)."""
    torch.set_num_threads(1)
    out = {}
    for scenario in UNSHARDED:
        kind = SCENARIOS[scenario][0]
        make, _, shape = MODELS[kind]
        for store in SCENARIOS[scenario][1]:
            model = make(False)
            opt = _optimizer(kind, model)
            directory = None if store == "host" else str(tmp_path_factory.mktemp("unsharded"))
            guard = _guard(model, opt, scenario, store, directory)
            for t in range(STEPS):
                _step(model, opt, guard, scenario, t, shape, None)
                opt.step()
            out[scenario, store] = _outcome(model, guard, shape)
            key = guard._snaps[-1].key
            held = guard._store.nbytes(key)
            if store == "dcp":
                held = os.path.getsize(os.path.join(guard._store._held[key][0], "__0_0.distcp"))
            out[scenario, store]["bytes"] = {"held": held}
            guard.close()
    return out


# ------------------------------------------------------------------------------------------------ the checks
RUNS = [(scenario, store) for scenario, (_, stores, _, _) in SCENARIOS.items() for store in stores]


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario,store", RUNS)
def test_every_rank_takes_the_same_decision_and_ends_on_the_same_parameters(ranks, scenario, store):
    r0, r1 = ranks[0][scenario, store], ranks[1][scenario, store]
    assert r0["rescues"] == r1["rescues"] == SCENARIOS[scenario][3]
    assert r0["steps"] == r1["steps"] and r0["collapsed"] == r1["collapsed"] and r0["gave_up"] == r1["gave_up"]
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k
    assert repr(r0["records"]) == repr(r1["records"])  # the monitor's too (merged, restored with the snapshots)
    if scenario == "give up (raise)":  # both ranks raise at the check after the bad step
        assert r0["collapsed"] == (BAD + 1, "non_finite", " gave up after 0 rescue(s)")
    if scenario == "give up (stop)":  # both roll back to step 4 and then leave the steps alone
        assert r0["gave_up"].endswith("back on the state of step 4") and r0["steps"] == 4


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario,store", [(s, st) for s, st in RUNS if s in UNSHARDED or s.startswith("tp")])
def test_the_sharded_run_is_the_unsharded_run(ranks, unsharded, scenario, store):
    got, want = ranks[0][scenario, store], unsharded[scenario.removeprefix("tp "), store]
    assert got["rescues"] == want["rescues"] and got["steps"] == want["steps"]
    assert set(got["state"]) == set(want["state"])
    for k, v in want["state"].items():  # the parameters and SyncBatchRenorm's running statistics (float64)
        torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)
    if want["records"] is not None:  # the monitor's records kept after the rollback: the same steps
        assert [(r["step"], r["layer"]) for r in got["records"]] == [(r["step"], r["layer"]) for r in want["records"]]


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario,store", RUNS)
def test_one_collective_per_checked_step(ranks, scenario, store):
    """Inside ``opt.step()``: the guard's one all_gather at each checked step and none at the others; nothing else
    communicates, no DTensor operation either (CommDebugMode), except the monitor's own all-reduce and DCP's own
    collectives when it writes or reads a snapshot."""
    monitor = SCENARIOS[scenario][2].get("monitor", False)
    for r in ranks[0][scenario, store], ranks[1][scenario, store]:
        gathers = [steps for name, steps in r["calls"] if name == "all_gather_single"]
        assert gathers == r["checked"], (r["calls"], r["checked"])
        others = {name for name, _ in r["calls"]} - {"all_gather_single"}
        if store != "dcp":
            assert others <= ({"all_reduce"} if monitor else set()), others
        if store != "dcp" and not monitor:
            assert [c for _, c in r["comms"]] == [int(due) for due, _ in r["comms"]], r["comms"]


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("store", ["host", "disk", "dcp"])
def test_each_rank_keeps_only_its_shards(ranks, unsharded, store):
    scenario = "nan loss on rank 1"
    whole = unsharded[scenario, store]["bytes"]["held"]
    held = [ranks[r][scenario, store]["bytes"]["held"] for r in range(WORLD)]
    for h in held:  # about half each (the random generators' 5 kB are each rank's own)
        assert 0.4 * whole < h < (0.62 if store != "dcp" else 0.75) * whole, (held, whole)
    if store == "host":  # exactly the local shards: 24 + 24 rows, 24 + 24, and 2 + 1 of the head
        shards = [ranks[r][scenario, store]["bytes"]["shards"] for r in range(WORLD)]
        assert shards[0]["4.weight"] == (2, 48) and shards[1]["4.weight"] == (1, 48)
        assert shards[0]["0.weight"] == shards[1]["0.weight"] == (24, 6)
        assert held[0] > held[1]
    if store == "dcp":  # DCP writes each tensor with ~1.5 kB of its own: the optimizer's settings and step counters
        # (replicated: written by one rank) weigh on this small model. Each rank wrote its own rows and nothing else:
        for r in range(WORLD):
            assert ranks[r][scenario, store]["bytes"]["chunks"] == [
                (fqn, (0, 0), (2, 48), "__0_0.distcp") for fqn in ("model.4.weight", "optimizer.state.4.exp_avg")
            ][:1] + [("model.4.weight", (2, 0), (1, 48), "__1_0.distcp")] + [
                ("optimizer.state.4.exp_avg", (0, 0), (2, 48), "__0_0.distcp"),
                ("optimizer.state.4.exp_avg", (2, 0), (1, 48), "__1_0.distcp"),
            ]
    agreed = {ranks[r][scenario, store]["bytes"]["agreed"] for r in range(WORLD)}
    assert len(agreed) == 1  # the bytes every rank bounds its snapshots by: the same number everywhere


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_what_the_guard_cannot_support_is_refused_in_one_line(ranks):
    for r in ranks:
        said = r["refusals"]
        assert said["partial"] is not None and "\n" not in said["partial"]
        assert "CollapseGuard" in said["partial"] and "Partial(sum)" in said["partial"]
        assert said["stage"] is not None and "mesh of 1 of the 2 ranks" in said["stage"]
        assert "pipeline stages" in said["stage"]
        assert said["fsdp1"].startswith("CollapseGuard: FullyShardedDataParallel (FSDP1) is not supported")
        assert "\n" not in said["stage"] + said["fsdp1"]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_every_layer_loads_its_sharded_state_and_names_a_non_finite_shard_where_it_is(ranks):
    """The guard's restore loads each layer's sharded state: FiniteState's check reads the rank's own shard."""
    said = [r["layer loads"] for r in ranks]
    assert {name for name, _, _ in said[0]} >= {"PWSConv2d", "WSConv2d", "BatchRenorm2d", "SyncBatchRenorm"}
    assert any(sharded for sharded, _ in said[0].values())
    for (name, key, bad), (sharded, messages) in said[0].items():
        assert messages == [], (name, key)  # rank 0 holds no NaN
        theirs = said[1][name, key, bad][1]
        if not bad:
            assert theirs == [], (name, key)
            continue
        assert len(theirs) == 1 and theirs[0].startswith(f"{name}: the loaded state is not finite: {key} (1 of ")
        assert theirs[0].endswith("in this rank's shard)" if sharded else "values NaN/inf)") or ", " in theirs[0]
        assert "\n" not in theirs[0]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_max_bytes_drops_and_refuses_the_same_snapshots_on_every_rank(ranks):
    """Rank 0 holds more (2 of the head's 3 rows) than rank 1: a bound between two snapshots of rank 1 and two of
    rank 0 keeps one on both, as the rank that holds the most allows; one too small is refused on both ranks."""
    b0, b1 = ranks[0]["bounded"], ranks[1]["bounded"]
    assert b0["largest"] == b1["largest"] == b0["own"] > b1["own"]
    assert 2 * b1["own"] <= 2 * b0["largest"] - 1  # rank 1's own bytes would have kept two
    assert b0["fits one"] == b1["fits one"] == ([STEPS], STEPS, b0["largest"], None)
    steps, said = b0["too small"][1], b0["too small"][3]
    assert b1["too small"][1::2] == (steps, said) and steps == EVERY  # the first snapshot with the moments
    assert said.startswith(f"CollapseGuard: one snapshot takes {b0['largest']} bytes, over snapshots.max_bytes")


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("store", ["host", "dcp"])
def test_a_guard_resumed_from_each_ranks_state_goes_on_as_if_never_interrupted(ranks, store):
    """Each rank's ``guard.state_dict()`` (its shards in local form, plain tensors) saved and loaded by a new guard
    mid-run: the same rescue and the same parameters as the run never interrupted."""
    for r in ranks:
        got, want = r["resume nan loss on rank 1", store], r["nan loss on rank 1", store]
        assert got["rescues"] == want["rescues"] and got["steps"] == want["steps"]
        for k, v in want["state"].items():
            assert torch.equal(got["state"][k], v), k
