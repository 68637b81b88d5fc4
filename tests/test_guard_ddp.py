"""CollapseGuard under DDP with 2 gloo ranks: trouble seen on one rank only (rank 0 or rank 1), on both, or on none;
every rank rolls back to the same step together, in one collective per checked step, and no rank waits for a
collective another rank never makes (each run under a timeout)."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
STEPS = 16
TIMEOUT_S = 180
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
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _AlarmOn:
    """A monitor that raises an alarm at ``step`` on ``rank`` only (attached to the optimizer as VarianceMonitor)."""

    def __init__(self, optimizer, rank, step):
        from normlab.monitor.optim_step import step_hooks

        self.optimizer, self.alarm, self.current_step, self.records = optimizer, None, 0, []
        self.fire = step if dist.get_rank() == rank else None  # once (a transient: not part of the state)
        step_hooks(optimizer).add(0, lambda: None, self._after)

    def _after(self, stepped, loss):
        if self.current_step == self.fire:
            self.alarm, self.fire = type("Alarm", (), {"step": self.current_step, "__str__": lambda s: "alarm"})(), None
        self.current_step += 1

    def state_dict(self):
        return {"current_step": self.current_step, "alarm": self.alarm}

    def load_state_dict(self, state):
        self.current_step, self.alarm = state["current_step"], state["alarm"]


def _count_collectives(calls: list, current: dict) -> None:
    """Wrap torch.distributed's collectives: each call is recorded with the current guard's step count."""
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*a, _fn=fn, _name=name, **k):
            calls.append((_name, current["guard"].steps if current else None))
            return _fn(*a, **k)

        setattr(dist, name, counted)


def _run(rank: int, scenario: str, store: str, out_dir: str, calls: list, current: dict) -> dict:
    from normlab.monitor import CollapseCriteria, CollapseGuard, RescueOptions, SnapshotOptions

    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    monitor = _AlarmOn(opt, rank=1, step=5) if scenario == "alarm on rank 1" else None
    directory = None if store == "host" else os.path.join(out_dir, "snapshots")
    guard = CollapseGuard(
        model,
        opt,
        monitor,
        snapshots=SnapshotOptions(every=4, store=store, directory=directory),
        rescue=RescueOptions(check_every=2, confirm=None),
        criteria=CollapseCriteria(window=4),  # snapshots 4 apart reach a window and the margin back
    )
    calls.clear()
    current["guard"] = guard
    g = torch.Generator().manual_seed(101 + rank)  # each rank its own shard
    checked = []
    for t in range(STEPS):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if scenario == "nan on both" and t == 9:
            loss = loss * float("nan")  # non-finite everywhere (the gradients too, averaged by DDP)
        opt.zero_grad()
        loss.backward()
        seen = loss.detach()
        if scenario == f"nan on rank {rank}" and t == 9:
            seen = seen * float("nan")  # a rank-local trouble: only this rank sees it, its gradients stay finite
        guard.observe_loss(seen)
        before = guard.steps
        opt.step()
        if (before + 1) % 2 == 0 or (before + 1) % 4 == 0:
            checked.append(before + 1)
    current.clear()
    return {
        "rescues": [(r.step, r.kind, r.onset, r.restored_step, r.steps_lost, r.lr_after) for r in guard.rescues],
        "steps": guard.steps,
        "params": [p.detach().clone() for p in model.parameters()],
        "calls": list(calls),
        "checked": checked,
    }


SCENARIOS = {  # scenario: the snapshot stores it runs with
    "none": ("host",),
    "nan on rank 0": ("host", "dcp"),
    "nan on rank 1": ("host", "dcp"),  # with "dcp" the snapshots are written by the ranks together, too
    "nan on both": ("host",),
    "alarm on rank 1": ("host",),
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    calls, current = [], {}
    _count_collectives(calls, current)
    try:
        out = {
            (scenario, store): _run(
                rank, scenario, store, os.path.join(out_dir, scenario.replace(" ", "_")), calls, current
            )
            for scenario, stores in SCENARIOS.items()
            for store in stores
        }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, run once by 2 gloo ranks (one spawn for all: starting the processes is most of the time)."""
    out = tmp_path_factory.mktemp("ddp_guard")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"DDP guard workers still running after {TIMEOUT_S} s: a rank waits on another")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_rolls_back_to_the_same_step_together(runs, scenario):
    for store in SCENARIOS[scenario]:
        _check(runs[0][scenario, store], runs[1][scenario, store], scenario, store)


def _check(r0: dict, r1: dict, scenario: str, store: str) -> None:
    assert r0["rescues"] == r1["rescues"] and r0["steps"] == r1["steps"]
    for p, q in zip(r0["params"], r1["params"]):
        assert torch.equal(p, q)
    expected = {
        "none": [],
        "nan on rank 0": [(9, "non_finite", 9, 4, 6, 0.05)],  # seen at the check after step 9: back to 4 (9 - 4 = 5)
        "nan on rank 1": [(9, "non_finite", 9, 4, 6, 0.05)],
        "nan on both": [(9, "non_finite", 9, 4, 6, 0.05)],
        "alarm on rank 1": [(5, "alarm", 5, 0, 6, 0.05)],  # rank 0 had no alarm and rolled back with rank 1
    }[scenario]
    assert [tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in r0["rescues"]] == expected
    for r in (r0, r1):  # one all_gather per check, at the checks only (plus DCP's own at snapshots)
        guard_calls = [steps for name, steps in r["calls"] if name == "all_gather_single"]
        assert guard_calls == r["checked"], (r["calls"], r["checked"])
        if store == "host":
            assert {name for name, _ in r["calls"]} <= {"all_gather_single"}
