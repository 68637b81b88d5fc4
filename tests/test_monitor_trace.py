"""The monitor's records, events and state over whole trainings, bit for bit against a stored trace.

Three small models train for 60 steps under :class:`~normlab.monitor.VarianceMonitor` at ``every=1`` and ``every=10``
(the light per-step path of the countdown between records): a CNN with BatchNorm (SGD, a hidden conv's weights
multiplied by 8 at step 23, a light step), a pre-LN GPT-like transformer (AdamW, the loss, gradient-norm and
non-finite rules beside the defaults, the probes) and a residual CNN (SGD; a conv weight set to inf at step 41, so
that the records and the countdown see non-finite values). Every record, every event, the history and the monitor's
``state_dict`` (each rule's running state, fed by the light values too) are serialized with ``repr`` floats and
compared with ``tests/data/monitor_trace.json``, written by the code before the monitor's cost was cut (issue 35):
a cheaper way to compute the records must give the same records, bit for bit.

The values depend on torch's CPU kernels: the trace is compared on the torch version and CPU capability that wrote
it, on one thread (skipped elsewhere, with the command that rewrites it). Rewrite it only when a change of values is
intended::

    PYTHONPATH=. .venv/bin/python tests/test_monitor_trace.py --write
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import DEFAULT_RULES, GradNormZScoreRule, LossSpikeRule, NonFiniteRule

TRACE = Path(__file__).parent / "data" / "monitor_trace.json"
STEPS = 60
EVERY = (1, 10)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 24, d: int = 32, context: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(Block(d, 2), Block(d, 2))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.n1, self.n2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


def cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def resnetish() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        ResBlock(8), nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        ResBlock(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def _images(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 12, 12, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(STEPS)]


def _tokens(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 24, (4, 17), generator=gen) for _ in range(STEPS))]


def _scale(path: str, factor: float, step: int, every_step_after: bool = False):
    """Multiply a layer's weight by ``factor`` at ``step`` (and at every later step with ``every_step_after``)."""

    def hit(model: nn.Module, s: int) -> None:
        if s == step or (every_step_after and s > step):
            with torch.no_grad():
                model.get_submodule(path).weight.mul_(factor)

    return hit


SETUPS = {  # name: (model, seed, data, optimizer, extra rules, probes, what happens at a step)
    "cnn_bn": (
        cnn_bn, 110, _images, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), [], None, _scale("6", 10.0, 23),
    ),
    "gpt": (
        TinyGPT,
        111,
        _tokens,
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        [LossSpikeRule(min_history=5), GradNormZScoreRule(warmup=5), NonFiniteRule()],
        True,
        _scale("blocks.1.fc1", 3.0, 37, every_step_after=True),
    ),
    "resnetish": (
        resnetish,
        112,
        _images,
        lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
        [],
        None,
        _scale("4", float("inf"), 41),
    ),
}  # fmt: skip


def _dump(value) -> str:
    """One canonical line: floats as their repr (bit-exact), non-finite ones as NaN / Infinity, keys sorted."""
    return json.dumps(value, sort_keys=True, allow_nan=True)


def _digest(record: dict) -> str:
    """A record as ``"step layer sha256"`` (the hash of its canonical line, 16 hex digits): the trace stays small."""
    return f"{record['step']} {record['layer']} {hashlib.sha256(_dump(record).encode()).hexdigest()[:16]}"


def trace(name: str, every: int) -> dict[str, list[str]]:
    """Train setup ``name`` for STEPS steps under a monitor recording every ``every`` steps: its records (digests),
    events, history and state (canonical JSON lines)."""
    make, seed, data_of, optimizer, extra, probes, hit = SETUPS[name]
    torch.manual_seed(seed)
    model = make()
    opt = optimizer(model.parameters())
    rules = DEFAULT_RULES() + [copy.deepcopy(r) for r in extra]
    mon = VarianceMonitor(model, every=every, rules=rules, probes=probes, optimizer=opt)
    for step, (x, y) in enumerate(data_of(seed + 1000)):
        hit(model, step)
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        mon.observe_loss(loss)
        opt.step()
    return {
        "records": [_digest(r) for r in mon.records],
        "events": [_dump(e.to_dict()) for e in mon.events],
        "history": [_dump(e.to_dict()) for e in mon.history],
        "state": [_dump(mon.state_dict())],
    }


def _platform() -> dict:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def _all_traces() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction's rounding depends on how it is split over threads
    try:
        return {f"{name}/every={every}": trace(name, every) for name in SETUPS for every in EVERY}
    finally:
        torch.set_num_threads(threads)


def _stored() -> dict:
    stored = json.loads(TRACE.read_text())
    if stored["platform"] != _platform():
        pytest.skip(
            f"tests/data/monitor_trace.json was written on {stored['platform']}, this is {_platform()}: rewrite it "
            "with the code before a change (python tests/test_monitor_trace.py --write) to compare on this platform"
        )
    return stored["traces"]


@pytest.fixture(scope="module")
def traces() -> dict:
    return _all_traces()


@pytest.mark.parametrize("run", [f"{name}/every={every}" for name in SETUPS for every in EVERY])
def test_records_events_and_state_are_bitwise_the_stored_trace(traces, run):
    expected, got = _stored()[run], traces[run]
    for part in ("records", "events", "history", "state"):
        assert len(got[part]) == len(expected[part]), f"{run}: {part}: {len(got[part])} != {len(expected[part])}"
        for i, (a, b) in enumerate(zip(got[part], expected[part])):
            assert a == b, f"{run}: {part}[{i}] differs:\n got      {a[:600]}\n expected {b[:600]}"


def test_the_trace_has_events_light_steps_and_non_finite_values():
    """The stored runs exercise what a cheaper computation could get wrong: events at light steps, alarms of each
    default rule kind, non-finite records."""
    stored = json.loads(TRACE.read_text())["traces"]
    events = [json.loads(e) for run in stored.values() for e in run["events"]]
    assert any(e["step"] % 10 for e in events if e["rule"] == "countdown")  # the light path fired
    assert {e["rule"] for e in events} >= {"factor", "countdown"}
    assert any(e["value"] is None or not math.isfinite(e["value"]) for e in events)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_monitor_trace.py --write   (rewrites tests/data/monitor_trace.json)")
    TRACE.write_text(json.dumps({"platform": _platform(), "traces": _all_traces()}, indent=0) + "\n")
    print(f"wrote {TRACE} ({TRACE.stat().st_size} bytes)")
