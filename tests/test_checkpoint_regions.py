"""Held-out checks of BatchRenorm under activation checkpointing in the orders users run it in, beyond the one-region
matrix of tests/test_workflows_batch_renorm.py. Each test covers a whole class; each failed on the code before its
fix (said per test), which found a recomputation's forward by a fingerprint of 32 input values.

1. One layer in several checkpointed regions before their backward, with equal inputs (R-Drop, a siamese pair, a
   batch fed twice) or inputs equal wherever a sparse sample looks (a constant border), recomputed in any order
   (one summed loss: the later region first; separate backwards in reverse order): every flavour and layer. The
   fingerprint handed every recomputation the newest record: wrong r and d, silently.
2. More checkpointed forwards of a layer before one backward than the fingerprint's 32-row table held: each
   recomputation missed and renormalized against the statistics of the last forward.
3. A selective-checkpoint policy that saves pointwise ops (or every op): the step's in-place arithmetic mutated a
   cached output and torch raised.
4. A module compiled on its own and run inside an eager checkpoint (``block.compile()`` under Hugging Face's or timm's
   checkpointing): the recomputation reran the compiled step, which updated the running statistics a second time
   and renormalized against them.
5. A real model checkpointed whole (timm's resnet10t) trained with R-Drop (the same batch twice, one loss): SGD
   steps against the plain run.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import needs
from test_workflows_batch_renorm import CASES, FLAVOURS, LIMITS, SCHEDULE, _assert_same, _batch, _Region, _run
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from normlab.nn import BatchRenorm2d

F64 = torch.float64
aten = torch.ops.aten


def _act_case():
    act = needs("normlab.integrations.timm").BatchRenormAct2d
    return functools.partial(act, apply_act=False)


LAYERS = CASES + [("timm-act", None, CASES[2][2], CASES[2][3])]
IDS = [c[0] for c in LAYERS]


def _region(case, position="repeated", **limits) -> _Region:
    name, cls, lin, _ = case
    return _Region(_act_case() if cls is None else cls, lin, position, **limits)


def _sample_twin(x: torch.Tensor) -> torch.Tensor:
    """``x`` changed everywhere but at 32 evenly spaced positions in memory (what the fingerprint sampled)."""
    n = x.numel()
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.arange(32) * (n // 32) if n >= 32 else torch.arange(n)] = True
    g = torch.Generator().manual_seed(150)
    other = x.flatten() + torch.randn(n, generator=g, dtype=x.dtype)
    return torch.where(keep, x.flatten(), other).view_as(x)


def _two_regions(model, run, xs, grads, order: str):
    """Two forwards of one model (each through ``run``), then the backward in ``order``: ``one-loss`` (their sum),
    ``reversed`` (the second's first) or ``accumulated`` (the first's first). Returns the input gradients."""
    xs = [x.clone().requires_grad_() for x in xs]
    losses = [(run(model, x) * g).sum() for x, g in zip(xs, grads)]
    if order == "one-loss":
        sum(losses).backward()
    else:
        for loss in losses if order == "accumulated" else losses[::-1]:
            loss.backward()
    return [x.grad for x in xs]


# ------------------------------------------------------------------------------------------ 1. several regions
INPUTS = {  # how the layer's inputs in the two regions relate -> (where the layer sits in the region, its calls)
    "equal": ("repeated", 3),  # deep in the region and called three times: equal values on every call
    "equal-where-sampled": ("first", 1),  # first: it sees the region's inputs, equal at the sampled positions
}


@pytest.mark.parametrize("order", ["one-loss", "reversed", "accumulated"])
@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("case", LAYERS, ids=IDS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_one_layer_in_several_regions_before_their_backward(flavour, case, inputs, order):
    """Two checkpointed forwards of a region on inputs a value key confuses, before their backward: gradients,
    running statistics and step counter equal the plain run's whatever the backward order."""
    position, calls = INPUTS[inputs]
    torch.manual_seed(151)
    plain = _region(case, position, **LIMITS["renorm"])
    ckpt = copy.deepcopy(plain)
    x, g = _batch(case[3], 0)
    xs = [x, x.clone() if inputs == "equal" else _sample_twin(x)]
    grads = [torch.randn(case[3], generator=g, dtype=F64) for _ in xs]
    expected = _two_regions(plain, lambda m, t: m(t), xs, grads, order)
    got = _two_regions(ckpt, functools.partial(_run, flavour), xs, grads, order)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    _assert_same(plain, ckpt)
    assert int(ckpt.norm.num_batches_tracked) == 2 * calls


class _FunctionCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint written as an autograd Function, as DeepSpeed's and Megatron's are."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.backward(ctx.run(x), grad)
        return None, x.grad


def _run_other(flavour: str, region: _Region, x):
    """The checkpoint implementations beyond torch.utils.checkpoint's flavours: nested with the other kind inside,
    an autograd Function, torch's composable ``checkpoint(module)`` (hooks, no checkpoint call on the stack)."""
    if flavour == "function":
        return _FunctionCheckpoint.apply(region, x)
    if flavour == "composable":
        if not getattr(region, "composable", False):
            from torch.distributed._composable import checkpoint as checkpoint_module

            checkpoint_module(region)
            region.composable = True
        return region(x)
    outer, inner = (False, True) if flavour == "reentrant-in-non-reentrant" else (True, False)

    def whole(t):
        return region.part2(checkpoint(region.part1, t, use_reentrant=inner))

    return checkpoint(whole, x, use_reentrant=outer)


@pytest.mark.parametrize("order", ["one-loss", "reversed", "accumulated"])
@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize(
    "flavour", ["reentrant-in-non-reentrant", "non-reentrant-in-reentrant", "function", "composable"]
)
def test_other_checkpoints_of_one_layer_in_several_regions(flavour, inputs, order):
    """The same class for the other ways to checkpoint a region (BatchRenorm2d)."""
    position, calls = INPUTS[inputs]
    torch.manual_seed(151)
    plain = _region(CASES[2], position, **LIMITS["renorm"])
    ckpt = copy.deepcopy(plain)
    x, g = _batch(CASES[2][3], 0)
    xs = [x, x.clone() if inputs == "equal" else _sample_twin(x)]
    grads = [torch.randn(CASES[2][3], generator=g, dtype=F64) for _ in xs]
    expected = _two_regions(plain, lambda m, t: m(t), xs, grads, order)
    got = _two_regions(ckpt, functools.partial(_run_other, flavour), xs, grads, order)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    _assert_same(plain, ckpt)
    assert int(ckpt.norm.num_batches_tracked) == 2 * calls


# ------------------------------------------------------------------------------------------ 2. many forwards
@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant", "nested-non-reentrant"])
def test_many_checkpointed_forwards_before_one_backward(flavour):
    """40 checkpointed forwards of a layer (a schedule crossing its warm-up among them) before one backward: each
    recomputation repeats its own forward."""
    torch.manual_seed(152)
    plain = _region(CASES[0], "deep", **SCHEDULE)
    ckpt = copy.deepcopy(plain)
    xs = [_batch(CASES[0][3], i)[0] for i in range(40)]
    grads = [_batch(CASES[0][3], 100 + i)[0] for i in range(40)]
    for model, run in ((plain, lambda m, t: m(t)), (ckpt, functools.partial(_run, flavour))):
        leaves = [x.clone().requires_grad_() for x in xs]
        sum((run(model, t) * g).sum() for t, g in zip(leaves, grads)).backward()
        model.input_grads = [t.grad for t in leaves]
    for a, b in zip(plain.input_grads, ckpt.input_grads):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    _assert_same(plain, ckpt)
    assert int(ckpt.norm.num_batches_tracked) == 40


# ------------------------------------------------------------------------------------------ 3. any SAC policy
def _save(ops, ctx, op, *args, **kwargs):
    if ops is None or op in ops:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "save-every-op": None,
    "save-pointwise": (aten.mul.Tensor, aten.add.Tensor, aten.clone.default, aten.where.self, aten.sub.Tensor),
    "save-nothing": (),
}


@pytest.mark.parametrize("limits", ["renorm", "schedule"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_any_selective_checkpoint_policy(case, policy, limits):
    """Selective activation checkpointing with a policy that saves every op, pointwise ops or nothing: the layer's
    step is recomputed whatever the policy (its update runs once), with the plain run's gradients."""
    torch.manual_seed(153)
    plain = _region(case, "repeated", **(SCHEDULE if limits == "schedule" else LIMITS["renorm"]))
    ckpt = copy.deepcopy(plain)
    context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_save, POLICIES[policy]))
    for step in range(3):
        x, g = _batch(case[3], step)
        gy = torch.randn(case[3], generator=g, dtype=F64)
        (plain(x) * gy).sum().backward()
        (checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=False, context_fn=context) * gy).sum().backward()
    _assert_same(plain, ckpt)


# ------------------------------------------------------------------------------------------ 4. compiled inside
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(154)
        self.region = _region(CASES[2], "repeated", **SCHEDULE)

    def forward(self, x):
        return self.region(x)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_module_compiled_inside_an_eager_checkpoint(reentrant, one_thread):
    """``checkpoint(compiled_block, x)``: the layer's step runs eagerly from the compiled graph, so the recomputation
    finds its record: the plain run's gradients and one update per forward, over three steps."""
    torch._dynamo.reset()
    plain = _Block()
    ckpt = copy.deepcopy(plain)
    compiled = torch.compile(ckpt, backend="aot_eager")
    for step in range(3):
        x, g = _batch(CASES[2][3], step)
        gy = torch.randn(CASES[2][3], generator=g, dtype=F64)
        (plain(x) * gy).sum().backward()
        (checkpoint(compiled, x.clone().requires_grad_(), use_reentrant=reentrant) * gy).sum().backward()
    _assert_same(plain, ckpt)
    assert int(ckpt.region.norm.num_batches_tracked) == 9


@pytest.mark.slow
def test_fullgraph_inside_an_eager_checkpoint_is_refused(one_thread):
    torch._dynamo.reset()
    compiled = torch.compile(_Block(), backend="aot_eager", fullgraph=True)
    x, _ = _batch(CASES[2][3], 0)
    with pytest.raises(Exception, match="BatchRenorm compiled inside an eager torch.utils.checkpoint region"):
        checkpoint(compiled, x.requires_grad_(), use_reentrant=False)


# ------------------------------------------------------------------------------------------ 5. real models
def _r_drop_steps(plain, ckpt, run, shape, steps: int = 2):
    """R-Drop: the same batch twice through the model, one loss; SGD steps of both models side by side."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (plain, ckpt)]
    for step in range(steps):
        x, g = _batch(shape, step, scale=1.0)
        for model, opt in zip((plain, ckpt), opts):
            opt.zero_grad()
            a, b = run(model, x), run(model, x.clone())
            gy = torch.randn(a.shape, generator=torch.Generator().manual_seed(155 + step), dtype=F64)
            ((a * gy).sum() + (a - b).square().sum()).backward()
            opt.step()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-11)
    _assert_same(plain, ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_timm_model_checkpointed_whole_with_r_drop(reentrant, one_thread):
    """timm's resnet10t converted to BatchRenorm (rmax 3, dmax 5 from step 0), checkpointed whole (its stem sees the
    batch itself), trained with R-Drop: two SGD steps equal the plain run's."""
    timm = needs("timm")
    from normlab.convert import convert_norm

    torch.manual_seed(157)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
    plain = convert_norm(model, to="brn", rmax=3.0, dmax=5.0).double()
    for m in plain.modules():
        if isinstance(m, BatchRenorm2d):
            m.running_var.fill_(2.0)
    ckpt = copy.deepcopy(plain)

    def run(m, t):
        return m(t) if m is plain else checkpoint(m, t.detach().requires_grad_(), use_reentrant=reentrant)

    _r_drop_steps(plain, ckpt, run, (2, 3, 16, 16))
