"""BatchRenorm1d/2d/3d, SyncBatchRenorm and timm's BatchRenormAct2d exact inside the workflows small-batch users run.

A BatchRenorm training output depends on the layer's own state (r and d come from the running statistics before the
batch and from the limits at ``num_batches_tracked``), so every tool that runs a forward again, traces it or
differentiates it another way must see the step of the plain run:

1. activation checkpointing: non-reentrant (early stop on and off), reentrant, nested (both), selective
   (``context_fn``), a layer first in the region, deep inside it, and called several times (the same input twice),
   two forwards before one backward, ``retain_graph`` and a second backward, an input fed again every step, timm's
   ``set_grad_checkpointing``, Hugging Face's ``gradient_checkpointing_enable``, torch.compile over a checkpointed
   model, two gloo ranks: gradients and running statistics equal the plain run's (float64), the step counter
   advances once per forward;
2. torch.fx: ``symbolic_trace`` of every layer, train and eval, constant limits and a schedule, against the module over
   several steps; timm's and torchvision's fx feature extraction, fx conv-BN fusion, fold_for_inference's trace;
3. forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``/``jacfwd``) against reverse mode and finite
   differences.

Every test here fails on the code before the layers took one training step (``normlab.nn._renorm_step``): the
recomputation trained a second time, fx raised on a Proxy, forward AD had no derivative for the statistics kernel.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import socket
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.fx
import torch.multiprocessing as mp
from conftest import needs
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from normlab.nn import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, RenormSchedule, SyncBatchRenorm

F64 = torch.float64
C = 3
aten = torch.ops.aten
# (id, layer class, a channel-preserving linear map of that dim, input shape)
CASES = [
    ("1d-NC", BatchRenorm1d, lambda: nn.Linear(C, C), (6, C)),
    ("1d-NCL", BatchRenorm1d, lambda: nn.Conv1d(C, C, 3, padding=1), (4, C, 5)),
    ("2d", BatchRenorm2d, lambda: nn.Conv2d(C, C, 3, padding=1), (3, C, 4, 3)),
    ("3d", BatchRenorm3d, lambda: nn.Conv3d(C, C, 3, padding=1), (2, C, 2, 3, 3)),
    ("sync", SyncBatchRenorm, lambda: nn.Conv2d(C, C, 3, padding=1), (3, C, 4, 3)),
]
IDS = [c[0] for c in CASES]
LIMITS = {"renorm": {"rmax": 3.0, "dmax": 5.0}, "identity": {"rmax": 1.0, "dmax": 0.0}}
SCHEDULE = {"schedule": RenormSchedule(1, 3.0, 4, 5.0, 3)}  # identity for steps 0-1, then rising: the count matters


def _layer(cls, **limits):
    """A float64 layer whose running statistics are far from the data, so r and d differ from 1 and 0."""
    m = cls(C, dtype=F64, **limits)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([0.7, 1.3, 1.1]))
        m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        m.running_mean.copy_(torch.tensor([0.9, -0.4, 0.2]))
        m.running_var.copy_(torch.tensor([4.0, 0.3, 2.5]))
    return m


class _Region(nn.Module):
    """The checkpointed region, in two halves (the nested flavours checkpoint the first half inside the whole).

    ``first``: the layer sees the region's input; ``deep``: it sees a recomputed intermediate; ``repeated``: one layer
    twice on the same input, then again on another input (each call with the running statistics the previous one
    left)."""

    def __init__(self, cls, lin, position: str, **limits):
        super().__init__()
        self.position = position
        self.norm, self.lin, self.lin2 = _layer(cls, **limits), lin().double(), lin().double()

    def part1(self, x):
        if self.position == "first":
            return self.lin(self.norm(x)).relu()
        return self.lin(x).relu()

    def part2(self, h):
        if self.position == "first":
            return self.lin2(h)
        if self.position == "deep":
            return self.norm(self.lin2(h))
        u = self.lin2(h)
        return self.norm((self.norm(u) + self.norm(u)) * 0.5)

    def forward(self, x):
        return self.part2(self.part1(x))


def _save_convs(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = (aten.convolution.default, aten.addmm.default, aten.mm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _run(flavour: str, region: _Region, x):
    if flavour == "plain":
        return region(x)
    reentrant = flavour in ("reentrant", "nested-reentrant")
    if flavour in ("non-reentrant", "reentrant"):
        return checkpoint(region, x, use_reentrant=reentrant)
    if flavour == "no-early-stop":
        return checkpoint(region, x, use_reentrant=False, early_stop=False)
    if flavour == "selective":
        policy = functools.partial(create_selective_checkpoint_contexts, _save_convs)
        return checkpoint(region, x, use_reentrant=False, context_fn=policy)

    def outer(t):
        return region.part2(checkpoint(region.part1, t, use_reentrant=reentrant))

    return checkpoint(outer, x, use_reentrant=reentrant)


def _batch(shape, step: int, scale: float = 1.5):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(shape, generator=g, dtype=F64) * scale + 0.3, torch.Generator().manual_seed(200 + step)


def _assert_same(plain: nn.Module, other: nn.Module, rtol: float = 1e-9) -> None:
    """Equal gradients and buffers (by name), and the same step counters."""
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=1e-12, msg=name)
    theirs = dict(other.named_buffers())
    for name, b in plain.named_buffers():
        if b.is_floating_point():
            torch.testing.assert_close(theirs[name], b, rtol=rtol, atol=1e-12, msg=name)
        else:
            assert torch.equal(theirs[name], b), (name, theirs[name], b)


def _train_side_by_side(plain, other, shape, steps, run, scale=1.5, plain_run=None):
    """``steps`` training steps of ``plain`` (eager, or through ``plain_run``) and ``other`` (through ``run``) on the
    same batches and output gradients; input gradients compared at every step."""
    for step in range(steps):
        x, g = _batch(shape, step, scale)
        xp, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        yp = plain(xp) if plain_run is None else plain_run(plain, xp)
        gy = torch.randn(yp.shape, generator=g, dtype=F64)
        (yp * gy).sum().backward()
        (run(other, xo) * gy).sum().backward()
        torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-9, atol=1e-12, msg=f"step {step}")


# ------------------------------------------------------------------------------------------ 1. checkpointing
FLAVOURS = ["non-reentrant", "no-early-stop", "reentrant", "nested-non-reentrant", "nested-reentrant", "selective"]


@pytest.mark.parametrize("position", ["first", "deep", "repeated"])
@pytest.mark.parametrize("limits", list(LIMITS), ids=list(LIMITS))
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_checkpoint_matrix_equals_the_plain_run(flavour, case, limits, position):
    """Every checkpoint flavour x layer x limits x position: gradients and running statistics of three steps equal the
    plain run's; the step counter counts each genuine forward once (3 steps x 1 or 3 calls)."""
    _, cls, lin, shape = case
    torch.manual_seed(100)
    plain = _Region(cls, lin, position, **LIMITS[limits])
    ckpt = copy.deepcopy(plain)
    _train_side_by_side(plain, ckpt, shape, 3, functools.partial(_run, flavour))
    _assert_same(plain, ckpt)
    assert int(ckpt.norm.num_batches_tracked) == 3 * (3 if position == "repeated" else 1)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_checkpoint_with_a_schedule_replays_the_forwards_limits(flavour):
    """A schedule crossing its warm-up during the steps: the recomputation uses the limits at the forward's step."""
    torch.manual_seed(101)
    plain = _Region(BatchRenorm2d, CASES[2][2], "repeated", **SCHEDULE)
    ckpt = copy.deepcopy(plain)
    _train_side_by_side(plain, ckpt, CASES[2][3], 3, functools.partial(_run, flavour))
    _assert_same(plain, ckpt)
    assert plain.norm.renorm_limits(8) != (1.0, 0.0)  # the last calls renormalized


@pytest.mark.parametrize("reentrant", [False, True])
def test_two_forwards_before_one_backward_and_retain_graph(reentrant):
    """Two views with equal per-channel statistics (a flip) through the same checkpointed region, one summed loss
    with different output gradients; then ``retain_graph`` and a second backward (the recomputation repeated in a new
    backward pass finds its records again)."""
    torch.manual_seed(102)
    plain = _Region(BatchRenorm2d, CASES[2][2], "deep", **LIMITS["renorm"])
    ckpt = copy.deepcopy(plain)
    x, g = _batch(CASES[2][3], 0)
    views = (x, x.flip(-1))
    grads = [torch.randn(CASES[2][3], generator=g, dtype=F64) for _ in views]
    run = functools.partial(_run, "reentrant" if reentrant else "non-reentrant")
    for model, call in ((plain, lambda m, t: m(t)), (ckpt, run)):
        xs = [v.clone().requires_grad_() for v in views]
        loss = sum((call(model, t) * gy).sum() for t, gy in zip(xs, grads))
        loss.backward(retain_graph=True)
        loss.backward()
        model.input_grads = [t.grad for t in xs]
    for a, b in zip(plain.input_grads, ckpt.input_grads):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    _assert_same(plain, ckpt)
    assert int(ckpt.norm.num_batches_tracked) == 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_same_batch_every_step(reentrant):
    """Overfitting one batch: the layer's inputs are the same every step (no optimizer step here), so each
    recomputation must take this step's records, not older ones with the same values."""
    torch.manual_seed(103)
    plain = _Region(BatchRenorm1d, CASES[0][2], "repeated", **LIMITS["renorm"])
    ckpt = copy.deepcopy(plain)
    x, _ = _batch(CASES[0][3], 0)
    run = functools.partial(_run, "reentrant" if reentrant else "non-reentrant")
    _train_side_by_side(plain, ckpt, CASES[0][3], 4, lambda m, t: run(m, t))  # batches differ: warm the records
    for _ in range(4):
        for model, call in ((plain, lambda m, t: m(t)), (ckpt, run)):
            call(model, x.clone().requires_grad_()).square().sum().backward()
    _assert_same(plain, ckpt)


def test_a_recomputation_without_record_is_reported():
    """Forwards that repeat no genuine forward: a region that calls the layer more often when recomputed than in its
    forward (control flow on a global; reentrant: the non-reentrant checkpoint refuses it itself), and a training
    forward run inside a backward pass (a gradient hook). The layer renormalizes against the running statistics of
    that moment, updates nothing, and ``.eval()`` reports the misses as one RuntimeWarning naming the layer."""
    m = _layer(BatchRenorm2d, **LIMITS["renorm"])
    calls = []

    def region(t):
        calls.append(1)
        return m(t) if len(calls) == 1 else m(m(t))  # the recomputation (second call) runs the layer twice

    x, _ = _batch(CASES[2][3], 0)
    checkpoint(region, x.clone().requires_grad_(), use_reentrant=True).sum().backward()
    t = x.clone().requires_grad_()
    t.register_hook(lambda g: m(g) * 0 + g)
    (m(t) * 2).sum().backward()
    assert int(m.num_batches_tracked) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.eval()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith("BatchRenorm2d: 2 activation-checkpoint recomputation")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_checkpointed_step_reads_nothing_back(flavour):
    """Finding the record reads no device value (its position is a host count): a checkpointed training step
    (forward, recomputation, backward) copies no device value to the host (``tests/test_readbacks.py`` counts the
    plain steps)."""
    from test_readbacks import ReadBacks

    region = _Region(SyncBatchRenorm, CASES[4][2], "repeated", **SCHEDULE)
    for step in range(3):
        x, _ = _batch(CASES[4][3], step)
        with ReadBacks() as reads:
            _run(flavour, region, x.requires_grad_()).sum().backward()
        assert reads.ops == [], step


@pytest.mark.slow
def test_torch_compile_over_a_checkpointed_model():
    """torch.compile over a model that checkpoints a block (the compiled backward recomputes the region): gradients
    and running statistics equal the plain eager run (torch's partitioner would recompute r and d from the updated
    running statistics if the layer did not mark its snapshot to be saved)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _Region(BatchRenorm2d, CASES[2][2], "repeated", **SCHEDULE)

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(104)
    ckpt = Net()
    plain = copy.deepcopy(ckpt.block)
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=True)
    _train_side_by_side(plain, ckpt, CASES[2][3], 3, lambda m, t: compiled(t))
    _assert_same(plain, ckpt.block)


@pytest.mark.slow
def test_timm_resnet10t_with_set_grad_checkpointing(one_thread):
    """timm's resnet10t converted to BatchRenorm (rmax 3, dmax 5), grad checkpointing on: every layer updates once and
    the gradients are the plain model's."""
    timm = needs("timm")
    from normlab.convert import convert_norm

    torch.manual_seed(105)
    plain = convert_norm(timm.create_model("resnet10t", pretrained=False, num_classes=4), to="brn", rmax=3.0, dmax=5.0)
    plain = plain.double()
    for m in plain.modules():
        if isinstance(m, BatchRenorm2d):
            m.running_var.fill_(2.0)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    _train_side_by_side(plain, ckpt, (2, 3, 32, 32), 2, lambda m, t: m(t), scale=1.0)
    _assert_same(plain, ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing(reentrant, one_thread):
    """A Hugging Face MobileViT (BatchNorm in its conv layers, checkpointed layer by layer) converted to BatchRenorm,
    with ``gradient_checkpointing_enable``: the plain model's gradients and running statistics."""
    transformers = needs("transformers")
    from normlab.convert import convert_norm

    torch.manual_seed(106)
    config = transformers.MobileViTConfig(
        image_size=32,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48],
        num_labels=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    model = transformers.MobileViTForImageClassification(config)
    plain = convert_norm(model, to="brn", rmax=3.0, dmax=5.0).double()
    ckpt = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the method's deprecation notice, whichever transformers gives it
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert ckpt.is_gradient_checkpointing
    run = lambda m, t: m(pixel_values=t).logits  # noqa: E731
    _train_side_by_side(plain, ckpt, (2, 3, 32, 32), 2, run, scale=1.0, plain_run=run)
    _assert_same(plain, ckpt)


# ------------------------------------------------------------------------------------------ two gloo ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_worker(rank: int, port: int, out: str) -> None:
    """Each rank: a region with SyncBatchRenorm deep inside and called twice on one input, checkpointed in every
    flavour, against the plain run on the same rank; and the refusal to fx-trace the synchronized step."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for flavour in FLAVOURS:
            torch.manual_seed(107)
            plain = _Region(SyncBatchRenorm, CASES[4][2], "repeated", **SCHEDULE)
            ckpt = copy.deepcopy(plain)
            try:
                _train_side_by_side(plain, ckpt, (2 + rank, C, 4, 3), 3, functools.partial(_run, flavour))
                _assert_same(plain, ckpt)
                results[flavour] = int(ckpt.norm.num_batches_tracked)
            except AssertionError as e:
                results[flavour] = str(e)
        try:
            torch.fx.symbolic_trace(SyncBatchRenorm(C))
            results["fx"] = "traced"
        except TypeError as e:
            results["fx"] = str(e)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sync_batch_renorm_on_two_gloo_ranks_under_every_checkpoint_flavour(tmp_path):
    mp.spawn(_sync_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert {f: results[f] for f in FLAVOURS} == dict.fromkeys(FLAVOURS, 9)
        assert results["fx"].startswith("SyncBatchRenorm: torch.fx cannot trace the synchronized step (2 ranks)")


# ------------------------------------------------------------------------------------------ 2. torch.fx
def _norm_act():
    na = needs("normlab.integrations.timm")
    return na.BatchRenormAct2d


FX_CASES = CASES + [("timm-act", None, None, (3, C, 4, 3))]


@pytest.mark.parametrize("limits", ["renorm", "identity", "schedule"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", FX_CASES, ids=[c[0] for c in FX_CASES])
def test_symbolic_trace_computes_what_the_module_computes(case, train, limits):
    """``torch.fx.symbolic_trace`` of each layer gives one call node for the layer's step; the GraphModule, in the
    mode it was traced in, equals the module over four steps: outputs, gradients, running statistics and step counter
    (r and d from the schedule at num_batches_tracked, evaluated in the graph)."""
    name, cls, _, shape = case
    kw = SCHEDULE if limits == "schedule" else LIMITS[limits]
    m = _layer(_norm_act() if cls is None else cls, **kw).train(train)
    gm = torch.fx.symbolic_trace(copy.deepcopy(m))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "renorm_forward"]
    assert len(calls) == 1
    gm = copy.deepcopy(gm)  # a GraphModule copies and pickles like any module
    _train_side_by_side(m, gm, shape, 4, lambda g, t: g(t))
    _assert_same(m, gm)
    assert int(gm.num_batches_tracked) == (4 if train else 0)


def test_an_untraceable_schedule_is_refused_in_one_line():
    m = BatchRenorm2d(C, schedule=lambda step: (min(3.0, 1.0 + step / 100), 0.0))
    with pytest.raises(TypeError) as err:
        torch.fx.symbolic_trace(m)
    text = str(err.value)
    assert text.startswith("BatchRenorm2d: torch.fx cannot trace its schedule") and "\n" not in text


@pytest.mark.slow
def test_fx_tools_on_converted_models(one_thread, timm_registered):
    """timm's fx feature extraction (regnetx_002 on BatchRenormAct2d), torchvision's create_feature_extractor and
    fx conv-BN fusion on a converted resnet10t, and fold_for_inference's torch.fx dataflow."""
    timm = needs("timm")
    from torch.fx.experimental.optimization import fuse
    from torchvision.models.feature_extraction import create_feature_extractor

    from normlab.convert import convert_norm, fold_for_inference
    from normlab.convert.dataflow import trace_flow

    torch.manual_seed(108)
    x = torch.randn(2, 3, 32, 32)
    feats = timm.create_model("regnetx_002", norm_layer=_norm_act(), features_only=True, feature_cls="fx")
    assert [f.shape[1] for f in feats(x)] == [32, 24, 56, 152, 368]
    model = convert_norm(timm.create_model("resnet10t", pretrained=False), to="brn", rmax=3.0, dmax=5.0)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchvision warns when the train and eval graphs differ
        extractor = create_feature_extractor(model, return_nodes={"layer2": "mid", "fc": "out"})
    got = extractor(x)
    torch.testing.assert_close(got["out"], reference(x), rtol=1e-5, atol=1e-6)
    _assert_buffers_equal(reference, extractor)  # one training step each, the same running statistics
    model.eval()
    torch.testing.assert_close(fuse(model)(x), model(x), rtol=1e-5, atol=1e-5)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, BatchRenorm2d)]
    assert trace_flow(model, convs, norms, None)[0].how == "torch.fx"
    torch.testing.assert_close(fold_for_inference(model)(x), model(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ 3. forward-mode AD
AD_MODES = {"renorm": ("train", LIMITS["renorm"]), "identity": ("train", LIMITS["identity"]), "eval": ("eval", {})}


@pytest.mark.parametrize("mode", list(AD_MODES))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_mode_ad_equals_reverse_mode(case, mode):
    """Dual numbers, torch.func.jvp and jacfwd through each layer (float64): ``<v, J u>`` from forward mode equals
    ``<J^T v, u>`` from reverse mode (no gradient through r and d in either), jacfwd equals jacrev, each transform
    trains once; in eval the tangent equals central finite differences."""
    from torch.func import jacfwd, jacrev, jvp

    _, cls, _, shape = case
    train, kw = AD_MODES[mode]
    m = _layer(cls, **(kw or LIMITS["renorm"])).train(train == "train")
    x, g = _batch(shape, 0)
    u, v = (torch.randn(shape, generator=g, dtype=F64) for _ in range(2))
    copies = [copy.deepcopy(m) for _ in range(5)]
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(copies[0](fwAD.make_dual(x, u))).tangent
    xr = x.clone().requires_grad_()
    (vjp,) = torch.autograd.grad(copies[1](xr), xr, v)
    torch.testing.assert_close((tangent * v).sum(), (vjp * u).sum(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jvp(copies[2], (x,), (u,))[1], tangent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jacfwd(copies[3])(x), jacrev(copies[4])(x), rtol=1e-10, atol=1e-12)
    for other in copies[1:]:
        _assert_buffers_equal(copies[0], other)
    assert int(copies[0].num_batches_tracked) == (1 if train == "train" else 0)
    if train == "eval":
        h = 1e-6
        fd = (copies[0](x + h * u) - copies[0](x - h * u)) / (2 * h)
        torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-7)


def _assert_buffers_equal(a: nn.Module, b: nn.Module) -> None:
    """Equal buffers, by name (``b`` may hold only some of ``a``'s)."""
    theirs = dict(b.named_buffers())
    for name, x in a.named_buffers():
        if name in theirs:
            torch.testing.assert_close(theirs[name], x, rtol=1e-12, atol=1e-14, msg=name)
