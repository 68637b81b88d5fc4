"""Held-out checks of normlab's layers in the orders and combinations users run them in, beyond the one-tool tests
of tests/test_batchnorm_tools.py and tests/test_workflows_norms.py. Each test covers a whole class of cases; each
failed on the code before its fix (said per test).

1. A re-estimation of BatchRenorm's running statistics restarted after an interrupted one (torch's ``update_bn``,
   Lightning's SWA BatchNorm epoch, ``normlab.nn.update_bn``, in every order): the loader's average, the step back.
2. What a re-estimation shows outside the layer while it runs (``state_dict``, pickle, ``copy.deepcopy``): the
   schedule's step, and a copy that no tool will end is not re-estimating.
3. A torch.fx GraphModule of a model holding SwitchableNorm, InstanceNorm or PWS (init_alpha) follows ``.train()``/
   ``.eval()`` and ``update_bn`` as the ``call_module`` node of a torch BatchNorm does, whichever mode it was traced
   in.
4. PWS's data-dependent init under activation checkpointing, selective policies included: the gradients of the
   plain step.
5. ``convert_norm`` of a BatchNorm without tensors (``affine=False, track_running_stats=False``): the new layer on
   the model's device and dtype.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
import torch.fx
from conftest import needs
from test_workflows_norms import SPECS, Spec
from torch import nn
from torch.optim.swa_utils import update_bn as torch_update_bn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import normlab.nn as L
from normlab.convert import convert_norm
from normlab.nn import RenormSchedule, update_bn

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SIZE = {1: (10,), 2: (5, 6), 3: (3, 4, 4)}
LIMITS = dict(schedule=RenormSchedule(warmup_steps=0, rmax=3.0, rmax_steps=2, dmax=5.0, dmax_steps=2))


def _data(dim: int, n: int = 3, seed: int = 300) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 3, *SIZE[dim], generator=gen) * 2 + 0.5 for _ in range(n)]


def _brn_model(dim: int, flavour: str = "plain") -> nn.Sequential:
    """conv -> BatchRenorm (a flavour) -> conv -> BatchNorm, trained a few steps (its schedule past the warm-up)."""
    torch.manual_seed(301)
    if flavour == "plain":
        brn = getattr(L, f"BatchRenorm{dim}d")(4, **LIMITS)
    elif flavour == "sync":
        brn = L.SyncBatchRenorm(4, **LIMITS)  # no process group: the single-process layer
    else:
        brn = needs("normlab.integrations.timm").BatchRenormAct2d(4, apply_act=False, **LIMITS)
    model = nn.Sequential(CONV[dim](3, 4, 3, padding=1), brn, CONV[dim](4, 4, 1), BN[dim](4))
    with torch.no_grad():
        for x in _data(dim, 3, seed=302):
            model.train()(x)
    return model


def _reference(model: nn.Sequential, dim: int, data) -> nn.Sequential:
    """The model with a BatchNorm in the BatchRenorm's place, re-estimated by torch's update_bn: what every layer
    must end with."""
    ref = copy.deepcopy(model)
    bn = BN[dim](4)
    bn.load_state_dict(ref[1].state_dict(), strict=False)
    ref[1] = bn
    torch_update_bn(data, ref)
    return ref


def _limits(brn: nn.Module, step=None) -> list[float]:
    """The (rmax, dmax) of the next training batch (of ``step``): (1, 0) while a re-estimation runs."""
    return [float(v) for v in brn.renorm_limits(step)]


class _Holder:
    """Lightning's SWA callback's BatchNorm epoch, without a Trainer: its reset, the loader, its ``reset_momenta``."""

    def __init__(self, model: nn.Module):
        pl = needs("lightning.pytorch")

        class Module(pl.LightningModule):
            def __init__(self, net):
                super().__init__()
                self.net = net

        self.module = Module(model)
        self.swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)

    def begin(self) -> None:
        self.swa.reset_batch_norm_and_save_state(self.module)

    def end(self) -> None:
        self.swa.reset_momenta()


def _re_estimate(tool: str, model: nn.Sequential, data, interrupt: bool = False) -> None:
    """One re-estimation by ``tool``; with ``interrupt``, the loader raises after its first batch."""

    def loader():
        for i, x in enumerate(data):
            if interrupt and i == 1:
                raise KeyboardInterrupt
            yield x

    try:
        if tool == "torch":
            torch_update_bn(loader(), model)
        elif tool == "normlab":
            update_bn(loader(), model)
        else:
            swa = _Holder(model)
            swa.begin()
            with torch.no_grad():
                for x in loader():
                    model.train()(x)
            swa.end()
    except KeyboardInterrupt:
        pass


# ------------------------------------------------------------------------------------------------------------------
# 1. A re-estimation restarted after an interrupted one
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("second", ["torch", "normlab", "lightning"])
@pytest.mark.parametrize("first", ["torch", "lightning"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_a_re_estimation_restarted_after_an_interrupted_one_is_exact(dim, first, second):
    """A re-estimation stopped half-way (an exception out of the loader: torch's update_bn and Lightning leave the
    layer re-estimating), then run again by any tool: every layer ends with the loader's average, BatchRenorm with
    its step from before the first. Old code: torch's update_bn after an interrupted one ended the re-estimation at
    its first momentum setting (the count of the first call went on), so the BatchRenorm renormalized against the
    reset statistics (those of the layers after it 45 % off) and its step advanced by the loader's batches."""
    model, data = _brn_model(dim), _data(dim)
    step = model[1].num_batches_tracked.clone()
    ref = _reference(model, dim, data)
    _re_estimate(first, model, data, interrupt=True)
    _re_estimate(second, model, data)
    for i in (1, 3):
        torch.testing.assert_close(model[i].running_mean, ref[i].running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[i].running_var, ref[i].running_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[1].num_batches_tracked, step)
    assert _limits(model[1]) == _limits(model[1], step) != [1.0, 0.0]  # renormalizes again, at its step


# ------------------------------------------------------------------------------------------------------------------
# 2. What a re-estimation shows outside the layer while it runs
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["1d", "2d", "3d", "sync", "norm_act"])
@pytest.mark.parametrize("tool", ["torch", "normlab", "lightning"])
def test_the_state_seen_during_a_re_estimation_holds_the_schedule_step(tool, flavour):
    """Half-way through a re-estimation (a hook on the layer after the BatchRenorm), ``state_dict`` holds the step
    the end puts back (a checkpoint written during Lightning's BatchNorm epoch), and a pickled or deep-copied layer,
    which no tool will end, is the layer as the end leaves it: not re-estimating (it renormalizes with its limits at
    that step), its step put back. The pass itself is unchanged. Old code: the state held the loader's count and the
    copies computed BatchNorm for ever."""
    dim = int(flavour[0]) if flavour[0].isdigit() else 2
    model = _brn_model(dim, "plain" if flavour[0].isdigit() else flavour)
    data, brn = _data(dim), model[1]
    step, limits = brn.num_batches_tracked.clone(), _limits(brn)
    ref = _reference(model, dim, data)
    seen = []

    def look(module, args):
        if len(seen) == 1:  # the second batch: statistics half-way
            buf = io.BytesIO()
            torch.save(brn, buf)
            copies = (
                copy.deepcopy(brn),
                pickle.loads(pickle.dumps(brn)),
                torch.load(io.BytesIO(buf.getvalue()), weights_only=False),
            )
            seen.append((brn.state_dict()["num_batches_tracked"].clone(), copies))
        else:
            seen.append(None)

    handle = model[2].register_forward_pre_hook(look)
    _re_estimate(tool, model, data)
    handle.remove()
    saved, copies = seen[1]
    assert torch.equal(saved, step)
    for c in copies:
        assert torch.equal(c.num_batches_tracked, step) and _limits(c) == limits != [1.0, 0.0]
    torch.testing.assert_close(brn.running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[3].running_var, ref[3].running_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(brn.num_batches_tracked, step)


# ------------------------------------------------------------------------------------------------------------------
# 3. A torch.fx GraphModule follows the mode and settings of the layers it holds
# ------------------------------------------------------------------------------------------------------------------
def _run(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    model.train(mode == "train")
    return model(x)


def _assert_state_equal(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Every tensor the GraphModule holds equals the model's (a graph keeps the tensors it reads: a WS/PWS conv's
    kernel is computed in the graph, from ``weight`` and ``alpha``)."""
    state, traced = model.state_dict(), gm.state_dict()
    assert traced.keys() <= state.keys()
    torch.testing.assert_close(traced, {k: state[k] for k in traced}, rtol=0, atol=0)


def _renorm_specs() -> list[Spec]:
    """BatchRenorm in each flavour of its limits: constants, the identity, and a schedule that starts renormalizing
    within the test's steps (so the graph must read ``num_batches_tracked`` when it runs); SyncBatchRenorm on one
    process; timm's NormAct version."""
    out = []
    for d in (1, 2, 3):
        brn = getattr(L, f"BatchRenorm{d}d")
        out.append(Spec(f"BRN{d}d-limits", lambda brn=brn: brn(3, rmax=3.0, dmax=5.0), d))
        out.append(Spec(f"BRN{d}d-identity", lambda brn=brn: brn(3, rmax=1.0, dmax=0.0), d))
        schedule = RenormSchedule(warmup_steps=1, rmax=3.0, rmax_steps=3, dmax=5.0, dmax_steps=2)
        out.append(Spec(f"BRN{d}d-schedule", lambda brn=brn, s=schedule: brn(3, schedule=s), d))
    out.append(Spec("SyncBRN-limits", lambda: L.SyncBatchRenorm(3, rmax=3.0, dmax=5.0), 2))
    return out


RENORM_SPECS = _renorm_specs()


@pytest.mark.parametrize("traced_in", ["train", "eval"])
@pytest.mark.parametrize("spec", SPECS + RENORM_SPECS, ids=repr)
def test_fx_graph_module_follows_train_eval_and_update_bn(spec, traced_in):
    """``symbolic_trace`` of a model holding the layer, traced in one mode, then trained, evaluated, trained again
    and re-estimated by ``normlab.nn.update_bn`` on the GraphModule: outputs and state equal the model's at every
    step, as for a torch BatchNorm (a ``call_module`` node reads the mode when the graph runs), and the GraphModule's
    ``state_dict`` has the model's keys. Old code: the graph kept the mode and momentum it was traced with (a model
    traced in training mode updated its running statistics in eval; one traced in eval never trained them, nor set
    PWS's alpha; update_bn's momentum=None was not seen)."""
    model = nn.Sequential(nn.Identity(), spec.build(seed=310)).train(traced_in == "train")
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    if getattr(model[1], "init_alpha", not isinstance(model[1], L.WS_CONV_TYPES)):
        assert gm.state_dict().keys() == model.state_dict().keys()  # the layer is held whole
    for i, mode in enumerate(["train", "train", "eval", "train", "eval"]):
        x = spec.input(seed=311 + i)
        torch.testing.assert_close(_run(gm, x, mode), _run(model, x, mode), rtol=0, atol=0)
        _assert_state_equal(gm, model)
    loader = [spec.input(seed=320), spec.input(seed=321)]
    update_bn(loader, gm)
    update_bn(loader, model)
    _assert_state_equal(gm, model)
    x = spec.input(seed=322)
    torch.testing.assert_close(_run(gm, x, "eval"), _run(model, x, "eval"), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# 4. PWS's data-dependent init under activation checkpointing
# ------------------------------------------------------------------------------------------------------------------
_SAVED = {torch.ops.aten.convolution.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _checkpointed(block: nn.Module, how: str):
    if how == "reentrant":
        return lambda x: checkpoint(block, x, use_reentrant=True)
    if how == "non-reentrant":
        return lambda x: checkpoint(block, x, use_reentrant=False)
    save = CheckpointPolicy.MUST_SAVE if how == "save-convs" else CheckpointPolicy.PREFER_SAVE
    policy = lambda ctx, op, *a, **k: save if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "save-convs", "prefer-save-convs"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_pws_init_alpha_under_checkpointing_gives_the_plain_gradients(dim, how):
    """Two training steps (the first sets alpha from the data) of conv -> PWS(init_alpha) -> SwitchableNorm, under
    each kind of checkpoint: outputs, gradients and state equal the plain steps'. Old code: the recomputation of the
    init step skipped the init's convolution, so a selective policy that saves convolutions handed the PWS conv the
    saved output of the init's (the gradients of that step were wrong, silently)."""
    torch.manual_seed(330)
    pws = getattr(L, f"PWSConv{dim}d")(4, 4, 3, padding=1, init_alpha=True)
    plain = nn.Sequential(CONV[dim](3, 4, 1), pws, getattr(L, f"SwitchableNorm{dim}d")(4)).double()
    ckpt = copy.deepcopy(plain)
    run = _checkpointed(ckpt, how)
    for step in range(2):
        x = _data(dim, 1, seed=331 + step)[0].double().requires_grad_()
        y, yc = plain(x), run(x)
        torch.testing.assert_close(yc, y, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(y)
        y.backward(g)
        yc.backward(g)
        for (name, p), pc in zip(plain.named_parameters(), ckpt.parameters()):
            torch.testing.assert_close(pc.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(ckpt.state_dict(), plain.state_dict(), rtol=0, atol=0)
        for m in (plain, ckpt):
            m.zero_grad()


# ------------------------------------------------------------------------------------------------------------------
# 5. convert_norm of a BatchNorm without tensors
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    "to, kw", [("brn", {}), ("sn", {}), ("in", {"affine": True}), ("gn", {"affine": True}), ("ln", {"affine": True})]
)
def test_convert_norm_puts_a_layer_without_a_source_tensor_on_the_models_device_and_dtype(to, kw, device):
    """``BatchNorm2d(affine=False, track_running_stats=False)`` has no tensor to take the device and dtype from: the
    new layer's parameters and buffers take the model's (float64 here). Old code: torch's defaults (CPU, float32)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False, track_running_stats=False))
    model = model.to(device=device, dtype=torch.float64)
    new = convert_norm(model, to=to, **kw)[1]
    tensors = [*new.parameters(), *new.buffers()]
    assert tensors and all(t.device.type == device for t in tensors), [(t.device, t.dtype) for t in tensors]
    assert all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
