"""normlab.integrations.timm: normlab's norms as timm NormAct layers, in timm's own architectures."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")
from conftest import TIMM_TABLES as TABLES  # noqa: E402
from conftest import timm_tables  # noqa: E402
from timm.layers import BatchNormAct2d  # noqa: E402

from normlab.convert import convert_norm  # noqa: E402
from normlab.integrations.timm import (  # noqa: E402
    BatchRenormAct2d,
    GroupNorm1Act2d,
    GroupNormAct2d,
    InstanceNormAct2d,
    SwitchableNormAct2d,
    SyncBatchRenormAct,
)
from normlab.nn import BatchRenorm2d, SwitchableNorm2d  # noqa: E402

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def acts(model: nn.Module, cls: type) -> list[str]:
    return [type(m.act).__name__ for m in model.modules() if isinstance(m, cls) and hasattr(m, "act")]


def train_step(model: nn.Module) -> torch.Tensor:
    model.train()
    loss = nn.functional.cross_entropy(model(X), torch.tensor([1, 2]))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    return loss


@pytest.mark.parametrize(
    "name, norm_layer, cls",
    [
        ("resnetv2_18", BatchRenormAct2d, BatchRenormAct2d),  # resnet family (pre-activation ResNet-v2)
        ("resnext26ts", BatchRenormAct2d, BatchRenormAct2d),  # resnet family (byobnet ResNeXt, SiLU)
        ("regnetx_002", BatchRenormAct2d, BatchRenormAct2d),
        ("regnetx_002", BatchRenorm2d, BatchRenormAct2d),  # the bare norm maps to its NormAct
        ("regnetx_002", "batchrenorm", BatchRenormAct2d),
        ("efficientnet_b0", BatchRenormAct2d, BatchRenormAct2d),  # SiLU
        ("cspresnet50", BatchRenormAct2d, BatchRenormAct2d),
        ("regnetx_002", SwitchableNormAct2d, SwitchableNormAct2d),
        ("efficientnet_b0", SwitchableNorm2d, SwitchableNormAct2d),
        ("regnetx_002", InstanceNormAct2d, InstanceNormAct2d),
        ("regnetx_002", GroupNormAct2d, GroupNormAct2d),
        ("regnetx_002", GroupNorm1Act2d, GroupNorm1Act2d),
    ],
)
def test_create_model_with_normlab_norm_act_layers(name, norm_layer, cls, timm_registered):
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=4)
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4, norm_layer=norm_layer)
    assert acts(model, cls) == acts(ref, BatchNormAct2d) and acts(model, cls)  # the architecture's activations
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    if cls is BatchRenormAct2d:  # same state_dict keys: a timm checkpoint loads, and eval outputs are BatchNorm's
        model.load_state_dict(ref.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(X), ref.eval()(X), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(train_step(model))


def test_plain_norm_architecture_takes_the_bare_norm():
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4, norm_layer=BatchRenorm2d)
    assert sum(type(m) is BatchRenorm2d for m in model.modules()) == 14
    assert torch.isfinite(train_step(model))


@pytest.mark.parametrize(
    "to, cls",
    [
        ("brn", BatchRenormAct2d),
        ("sn", SwitchableNormAct2d),
        ("in", InstanceNormAct2d),
        ("gn", GroupNormAct2d),
        ("ln", GroupNorm1Act2d),
        ("bn", BatchNormAct2d),
    ],
)
def test_convert_norm_of_a_timm_model_gives_the_norm_act_classes(to, cls):
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=4).eval()
    old = {n: m for n, m in model.named_modules() if isinstance(m, BatchNormAct2d)}
    keys = set(model.state_dict())
    convert_norm(model, to)
    new = dict(model.named_modules())
    for name, bn in old.items():
        assert type(new[name]) is cls and new[name].act is bn.act and new[name].drop is bn.drop
    if to in ("brn", "bn"):
        assert set(model.state_dict()) == keys
    assert torch.isfinite(train_step(model))


def test_sync_batch_norm_act_to_brn():
    from timm.layers import convert_sync_batchnorm

    model = convert_sync_batchnorm(timm.create_model("regnetx_002", pretrained=False, num_classes=4))
    convert_norm(model, "brn")
    assert any(type(m) is SyncBatchRenormAct for m in model.modules())
    assert acts(model, SyncBatchRenormAct) == acts(timm.create_model("regnetx_002"), BatchNormAct2d)
    assert torch.isfinite(train_step(model))  # no process group: BatchRenorm


def test_constructors_have_batchnormact2d_signature():
    expected = list(inspect.signature(BatchNormAct2d.__init__).parameters)
    for cls in (
        BatchRenormAct2d,
        SyncBatchRenormAct,
        SwitchableNormAct2d,
        InstanceNormAct2d,
        GroupNormAct2d,
        GroupNorm1Act2d,
    ):
        assert list(inspect.signature(cls.__init__).parameters)[: len(expected)] == expected, cls.__name__
    m = BatchRenormAct2d(8, act_layer="silu", drop_layer=nn.Dropout, rmax=2.0)
    assert type(m.act) is nn.SiLU and type(m.drop) is nn.Dropout and m.rmax == 2.0
    assert type(BatchRenormAct2d(8, apply_act=False).act) is nn.Identity
    assert SwitchableNormAct2d(8, momentum=0.25).momentum == 0.25  # BatchNorm's convention, passed on as it is
    assert SwitchableNormAct2d(8, momentum=None).momentum is None  # cumulative average, as nn.BatchNorm2d
    with pytest.raises(ValueError, match="SwitchableNormAct2d: track_running_stats must be True"):
        SwitchableNormAct2d(8, track_running_stats=False)
    with pytest.raises(ValueError, match="SwitchableNormAct2d: affine must be True"):
        SwitchableNormAct2d(8, affine=False)
    assert GroupNormAct2d(48).num_groups == 24 and GroupNorm1Act2d(48).num_groups == 1
    x = torch.randn(2, 8, 4, 4)
    m = BatchRenormAct2d(8).eval()
    assert torch.equal(m(x), torch.relu(BatchRenorm2d(8).eval()(x)))


def test_missing_timm_is_a_one_line_error(monkeypatch):
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "normlab.integrations.timm")
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module("normlab.integrations.timm")
    assert str(err.value) == "timm is not installed: pip install 'normlab[timm]'" and err.value.name == "timm"


def test_docstring_examples_run(timm_registered):
    import doctest

    import normlab.integrations.timm as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 4


def test_fold_a_model_built_on_batch_renorm_act(timm_registered):
    from normlab.convert import fold_for_inference

    torch.manual_seed(0)
    model = timm.create_model("regnetx_002", pretrained=False, num_classes=4, norm_layer=BatchRenormAct2d)
    model.train()
    with torch.no_grad():
        model(X)  # running statistics away from their init
    model.eval()
    folded = fold_for_inference(model, example_input=X)
    assert not any(isinstance(m, BatchRenorm2d) for m in folded.modules())
    assert acts(folded, nn.Sequential) == acts(model, BatchRenormAct2d)
    with torch.no_grad():
        torch.testing.assert_close(folded(X), model(X), rtol=1e-4, atol=1e-6)


UNTOUCHED = """
import copy, json
import timm
import timm.layers.create_norm_act as factory
tables = lambda: {n: copy.copy(getattr(factory, n)) for n in %r}
before = tables()
import normlab.integrations.timm as na
from normlab.nn import BatchRenorm2d
out = {"import": tables() == before}
timm.create_model("resnet10t", pretrained=False, num_classes=4, norm_layer=BatchRenorm2d)  # takes a bare class
out["build"] = tables() == before
try:
    timm.create_model("regnetx_002", pretrained=False, num_classes=4, norm_layer=na.BatchRenormAct2d)
except AssertionError as e:
    out["refused"] = str(e)
na.register()
once = tables()
na.register()
out["register"] = once != before and once["_NORM_ACT_MAP"]["batchrenorm"] is na.BatchRenormAct2d
out["idempotent"] = tables() == once
print(json.dumps(out))
"""


def test_timm_is_untouched_until_register_is_called():
    """In a fresh process: importing the adapter and building a model with a normlab class change none of timm's
    tables; register() changes them, and calling it again changes nothing more."""
    import json

    result = subprocess.run(
        [sys.executable, "-c", UNTOUCHED % (TABLES,)], capture_output=True, text=True, timeout=300, check=True
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "import": True,
        "build": True,
        "refused": "No equivalent norm_act layer for batchrenormact2d",  # timm's NormAct nets need register()
        "register": True,
        "idempotent": True,
    }


def test_building_with_a_bare_norm_class_changes_no_timm_table():
    before = timm_tables()
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4, norm_layer=BatchRenorm2d)
    assert sum(type(m) is BatchRenorm2d for m in model.modules()) == 14 and timm_tables() == before


def test_documented_timm_install_keeps_torch():
    """docs/integrations.md's commands for the timm extra: torch and the torchvision built for it pinned on the
    lines that install the extra (the Makefile's pins, the release the tests run on), and the --no-deps line names
    pyproject's timm requirement and timm's own non-torch requirements."""
    import re
    from importlib import metadata
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "integrations.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for ln in block.splitlines()]
    pinned = [ln for ln in lines if '".[timm]"' in ln]  # from a checkout: normlab is not on the package index yet
    assert pinned, lines
    make = (root / "Makefile").read_text()
    pins = {k: re.search(rf"^{k}_PIN \?= (\S+)$", make, flags=re.M).group(1) for k in ("TORCH", "TORCHVISION")}
    for line in pinned:  # every line that installs the extra pins torch and its torchvision beside it
        named = [q for q in re.findall(r'"([^"]+)"', line) if not q.startswith(".")]  # the checkout itself aside
        reqs = {r.name: r for r in map(Requirement, named)}
        assert str(reqs["torch"]) == pins["TORCH"] and str(reqs["torchvision"]) == pins["TORCHVISION"], line
    torch_v, vision_v = (str(reqs[n].specifier).removeprefix("==") for n in ("torch", "torchvision"))
    assert vision_v.split(".")[1] == str(int(torch_v.split(".")[1]) + 15)  # torchvision 0.N+15 for torch 2.N
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [Requirement(r).name for r in extras["timm"]] == ["timm"]  # the extra itself pins no torch
    no_deps = next(ln for ln in lines if "--no-deps" in ln)
    assert f'"{extras["timm"][0]}"' in no_deps
    timm_reqs = {Requirement(r).name.lower().replace("_", "-") for r in metadata.requires("timm") or []}
    named = set(no_deps.split("pip install ")[-1].replace("_", "-").split())
    assert named == timm_reqs - {"torch", "torchvision"}, (named, timm_reqs)
    if metadata.version("torchvision").split("+")[0] == vision_v:  # the pinned torchvision asks for that torch
        assert f"torch=={torch_v}" in [str(Requirement(r)).replace(" ", "") for r in metadata.requires("torchvision")]
