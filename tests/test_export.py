"""Deployment, for real: folded plain, ResNet and PWS models export with torch.onnx.export and run in onnxruntime
with torch's outputs (rtol 1e-4); ``normlab export`` does fold + ONNX + TorchScript for a runner checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import needs

from normlab.cli import main
from normlab.convert import fold_for_inference
from normlab.runner.data.datasets import get_dataset
from normlab.runner.export import INPUT_SHAPES, load_run_model
from normlab.runner.models import build_model
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import train

ort = needs("onnxruntime")
needs("onnxscript")

MODELS = [  # (model, norm, conv, per-sample shape, extra arguments)
    ("plain", "bn", "conv", (3, 16, 16), {}),
    ("plain", "none", "pws", (3, 16, 16), {}),
    ("resnet", "bn", "conv", (3, 16, 16), {"blocks": 1}),
    ("resnet_pws", "none", "pws", (3, 16, 16), {"blocks": 1}),
    ("cnn1d", "gn", "ws", (1, 40), {}),
]


def _rel(got, want: torch.Tensor) -> float:
    want = want.detach().double()
    return float((torch.as_tensor(got).detach().double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name,norm,conv,shape,kw", MODELS, ids=lambda v: v if isinstance(v, str) else None)
def test_folded_model_runs_in_onnxruntime_as_in_torch(name, norm, conv, shape, kw, one_thread):
    torch.manual_seed(0)
    model = build_model(name, norm, conv, shape[0], 10, shape, width=0.125, **kw)
    with torch.no_grad():  # running statistics away from their initial values, so folding them matters
        for _ in range(3):
            model(3 * torch.randn(8, *shape) + 1)
    model.eval()
    x = torch.randn(2, *shape)
    folded = fold_for_inference(model, x)
    program = torch.onnx.export(
        folded,
        (x,),
        dynamo=True,
        input_names=["input"],
        output_names=["logits"],
        dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},),
        verbose=False,
    )
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (2, 5):  # any batch size
        xs = torch.randn(n, *shape)
        (got,) = session.run(None, {"input": xs.numpy()})
        with torch.no_grad():
            assert _rel(got, model(xs)) < 1e-4


def test_input_shapes_are_the_data_sets():
    assert get_dataset("digits")[2]["input_shape"] == INPUT_SHAPES["digits"]


def test_export_command_writes_onnx_and_torchscript_of_a_run(tmp_path, capsys):
    cfg = TrainConfig(norm="none", conv="pws", width=0.125, batch_size=16, epochs=1, max_steps_per_epoch=2)
    train(cfg, tmp_path / "run", progress=False)
    onnx_path, ts_path = tmp_path / "out" / "model.onnx", tmp_path / "out" / "model.ts"
    assert main(["export", str(tmp_path / "run"), "--onnx", str(onnx_path), "--torchscript", str(ts_path)]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime matches torch" in out and "TorchScript" in out
    model, saved, shape = load_run_model(tmp_path / "run" / "checkpoint.pt")
    assert saved.to_dict() == json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    x = get_dataset("digits")[1].x[:7]  # real test images
    with torch.no_grad():
        want = model(x)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    assert _rel(session.run(None, {"input": x.numpy()})[0], want) < 1e-4
    assert _rel(torch.jit.load(str(ts_path))(x), want) < 1e-4
    assert np.argmax(session.run(None, {"input": x.numpy()})[0], 1).tolist() == want.argmax(1).tolist()


def test_export_refusals(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for argv, words in (
        ([str(tmp_path)], "expected --onnx PATH and/or --torchscript PATH"),
        ([str(tmp_path / "nowhere"), "--onnx", str(tmp_path / "m.onnx")], "expected a normlab run"),
        ([str(tmp_path / "junk.pt"), "--onnx", str(tmp_path / "m.onnx")], "is corrupt or unreadable"),
        ([str(tmp_path / "junk.pt"), "--onnx", str(tmp_path)], "--onnx"),
    ):
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "m.onnx").exists()


def test_without_the_onnx_extra_the_error_names_it(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # not installed
    assert main(["export", str(tmp_path), "--onnx", str(tmp_path / "m.onnx")]) == 2
    assert "pip install 'normlab[onnx]'" in capsys.readouterr().err


def test_export_refuses_a_checkpoint_whose_weights_do_not_fit_and_one_path_twice(tmp_path, capsys):
    cfg = TrainConfig(norm="bn", width=0.125, batch_size=16, epochs=1, max_steps_per_epoch=1)
    train(cfg, tmp_path / "run", progress=False)
    ck_path = tmp_path / "run" / "checkpoint.pt"
    same = str(tmp_path / "m.out")
    assert main(["export", str(tmp_path / "run"), "--onnx", same, "--torchscript", same]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--torchscript" in err[0] and "another path than --onnx" in err[0], err
    ck = torch.load(ck_path, weights_only=True)
    ck["model"].pop(next(iter(ck["model"])))  # a checkpoint of another model version
    torch.save(ck, ck_path)
    assert main(["export", str(tmp_path / "run"), "--onnx", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not fit the model" in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "m.out").exists()
