"""Where the guard keeps its snapshots (normlab.monitor.snapshots): host memory, torch.save files, a distributed
checkpoint; the bounds on how many and how large; the same rescue from each store."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from normlab.monitor import CollapseCriteria, CollapseGuard, RescueOptions, SnapshotOptions
from normlab.monitor.snapshots import DCPStore, DiskStore, HostStore, make_store, tensor_bytes


def _net(seed=100):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _train(model, opt, n, poison=(), guard=None, seed=101):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y) * (float("nan") if i in poison else 1.0)
        opt.zero_grad()
        loss.backward()
        if guard is not None:
            guard.observe_loss(loss)
        opt.step()


def _guarded(store, tmp_path, **snap):
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    directory = None if store == "host" else tmp_path / store
    guard = CollapseGuard(
        model,
        opt,
        snapshots=SnapshotOptions(every=4, store=store, directory=directory, **snap),
        rescue=RescueOptions(check_every=2),
        criteria=CollapseCriteria(window=4),  # snapshots 4 apart reach a window and the margin back
    )
    return model, opt, guard


@pytest.mark.parametrize("store", ["host", "disk", "dcp"])
def test_every_store_gives_the_same_rescue_and_the_same_weights(store, tmp_path):
    ref_model, ref_opt, ref = _guarded("host", tmp_path)
    _train(ref_model, ref_opt, 15, poison=(11,), guard=ref)
    model, opt, guard = _guarded(store, tmp_path)
    _train(model, opt, 15, poison=(11,), guard=guard)
    assert guard.rescues == ref.rescues and guard.rescues[0].restored_step == 4  # 11 - margin 4 = 7: the snapshot of 4
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert guard.nbytes > 0
    guard.close()
    assert guard.nbytes == 0


def test_the_disk_store_writes_one_file_per_snapshot_atomically_and_removes_what_it_drops(tmp_path):
    model, opt, guard = _guarded("disk", tmp_path, keep=2)
    assert guard.snapshot_every == 8  # two kept snapshots reach a window (4) and the margin (4) back
    _train(model, opt, 17, guard=guard)
    names = sorted(p.name for p in (tmp_path / "disk").iterdir())
    assert names == ["snapshot-1-rank0.pt", "snapshot-2-rank0.pt"]  # steps 8 and 16; step 0's file went with it
    state = torch.load(tmp_path / "disk" / names[-1], weights_only=True)  # plain tensors and values
    assert set(state) >= {"model", "optimizer", "rng", "tracker"}
    assert guard.nbytes == sum(p.stat().st_size for p in (tmp_path / "disk").iterdir())


def test_the_dcp_store_writes_model_and_optimizer_through_distributed_checkpoint(tmp_path):
    store = DCPStore(tmp_path)
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    _train(net, opt, 2)
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "rng": {"torch": torch.get_rng_state()}}
    store.put(3, state)
    assert (tmp_path / "dcp-3" / ".metadata").exists()
    back = store.get(3)
    assert all(torch.equal(back["model"][k], v) for k, v in net.state_dict().items())
    assert back["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    assert all(
        torch.equal(back["optimizer"]["state"][i]["exp_avg"], s["exp_avg"])
        for i, s in opt.state_dict()["state"].items()
    )
    store.drop(3)
    assert not (tmp_path / "dcp-3").exists()


def test_the_host_store_copies_and_reuses_the_buffers_of_a_dropped_snapshot():
    store = HostStore()
    w = torch.ones(4)
    store.put(0, {"w": w})
    w.add_(1.0)  # a later change does not reach the snapshot
    assert torch.equal(store.get(0)["w"], torch.ones(4))
    kept = store.get(0)["w"]
    store.drop(0)
    store.put(1, {"w": w})
    assert store.get(1)["w"] is kept and torch.equal(kept, w)  # the buffer came back from the pool
    assert not store.pin or torch.cuda.is_available()  # pinned memory only where CUDA is (for CUDA tensors)
    assert type(make_store("disk", "x")) is DiskStore and tensor_bytes(store.get(1)) == 16


def test_max_bytes_keeps_the_snapshots_under_it_and_refuses_one_larger_than_it(tmp_path):
    one = _guarded("host", tmp_path)[2].nbytes
    model, opt, guard = _guarded("host", tmp_path, keep=10, max_bytes=2 * one + one // 2)
    _train(model, opt, 13, guard=guard)
    assert [s.step for s in guard._snaps] == [8, 12] and guard.nbytes <= 2 * one + one // 2
    with pytest.raises(ValueError, match=r"CollapseGuard: one snapshot takes \d+ bytes, over snapshots.max_bytes"):
        _guarded("host", tmp_path, max_bytes=one // 2)


def test_a_checkpoint_carries_disk_snapshots_as_tensors_and_a_resume_puts_them_back(tmp_path):
    model, opt, guard = _guarded("disk", tmp_path)
    _train(model, opt, 9, guard=guard)
    buf = io.BytesIO()
    torch.save(guard.state_dict(), buf)
    buf.seek(0)
    other = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=4, store="disk", directory=tmp_path / "other"))
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert [s.step for s in other._snaps] == [0, 4, 8]
    assert len(list((tmp_path / "other").iterdir())) == 3
