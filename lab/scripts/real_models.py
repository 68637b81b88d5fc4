"""Survey normlab on real model definitions: one row per model, one column per conversion target + fold + monitor.

    PYTHONPATH=$PWD .venv/bin/python lab/scripts/real_models.py --out table.md --json table.json
    .venv/bin/python lab/scripts/real_models.py --models resnet10t,gpt2 --targets bn,pws   # a few cells

Models (built without weights, seed 0, batch 2): 16 timm architectures (``timm.create_model(name,
pretrained=False, num_classes=4)``: plain BatchNorm, timm's BatchNormAct2d, StdConv2d, ScaledStdConv2d,
LayerNorm2d, BatchNorm1d), torchvision's resnet18 (plain and with ``FrozenBatchNorm2d``) and Hugging Face models
from tiny configs (ResNetModel, ConvNextModel, GPT2LMHeadModel, BertModel). Images are 2x3x64x64 (at 32x32
the last stage of stride-32 nets is 1x1, where instance statistics are undefined), token ids 2x16.

Cells (each in its own try/except, its warnings recorded; each model runs in a subprocess with a timeout, so a
crash or a hang costs one row, not the table):

* one column per target of :func:`normlab.convert.convert_norm` (``CONVERT_TARGETS``): convert a copy of the model,
  then take one SGD step on it (train mode). ``ok``; ``noop`` (no layer replaced); ``refused`` (normlab raised a
  deliberate error: the message is in the JSON); ``crash: Type`` (any other exception); after a conversion, the
  step's failure follows a ``;``: ``refused fwd`` / ``crash fwd: Type`` / ``nan loss`` (the step's loss, or the loss
  after it, is not finite); ``sub:44``: 44 of the replaced layers were subclasses of a torch BatchNorm (timm's
  BatchNormAct2d, whose activation is replaced with it). For ``bn`` and
  ``brn`` (which keep BatchNorm's state) the eval-mode outputs are compared with the original's: ``ok 2e-07`` or
  ``WRONG 0.6`` (max |diff| / max |y| above ``TOL``).
* ``fold`` / ``fold pws``: :func:`normlab.convert.fold_for_inference` ``(model.eval(), example_input=x)`` on the
  model and on its pws conversion: ``ok 3e-07 17/20`` (relative output error, BatchNorms folded / BatchNorm-like
  layers, FrozenBatchNorm2d included), ``WRONG 0.6`` (the folded model's outputs differ and fold did not notice),
  ``caught 0.6`` (fold's own output check raised), ``MUTATED`` (the original's outputs changed), ``refused``,
  ``crash: Type``. A trailing ``w2``: two warnings (texts in the JSON).
* ``monitor``: :class:`normlab.monitor.VarianceMonitor` ``(model, every=1, optimizer=opt)`` over one training
  step: weight-applying modules that ran (nn.Linear, nn.ConvNd, nn.ConvTransposeNd, transformers' Conv1D) against
  those with a record of their forward: ``ok 40/40`` or ``MISS 2/50``; ``nonfinite 3``: record values that are NaN/inf.

The functions take the converter, folder and monitor as arguments (lab/tests/test_real_models_script.py feeds broken
ones to check that a wrong result shows as such).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]  # the repository (lab/scripts/real_models.py)
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402  (after the path setup: the repository's normlab, tests/torchvision_cpu.py)
import torch.nn.functional as F  # noqa: E402
import torchvision_cpu  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import normlab  # noqa: E402
from normlab.convert import CONVERT_TARGETS, convert_norm, fold_for_inference  # noqa: E402
from normlab.monitor import VarianceMonitor  # noqa: E402
from normlab.nn import BATCH_RENORM_TYPES  # noqa: E402

torchvision_cpu.prepare()  # before timm / torchvision are imported (lazily, by the builders below)

TOL = 1e-4  # relative output difference above which a cell that should keep the outputs is WRONG
KEEP_TARGETS = ("bn", "brn")  # conversions that keep BatchNorm's state: eval outputs must not change
FOLD_COLUMNS = ("fold", "fold_pws")
MONITOR_COLUMN = "monitor"
BATCH, IMAGE, TOKENS, VOCAB = 2, 64, 16, 100
NORMLAB_DIR = Path(normlab.__file__).resolve().parent


# --------------------------------------------------------------------------------------------------
# the models
# --------------------------------------------------------------------------------------------------
def _images() -> Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))


class ModelSpec(NamedTuple):
    """A model definition: ``build()`` makes it (no weights), ``example()`` a batch of inputs for it."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    example: Callable[[], Tensor] = _images
    note: str = ""


def _tokens() -> Tensor:
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=4, **kw)

    return build


def _torchvision(frozen: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision
        from torchvision.ops.misc import FrozenBatchNorm2d

        kw = {"norm_layer": FrozenBatchNorm2d} if frozen else {}
        return torchvision.models.resnet18(num_classes=4, **kw)

    return build


class HFOutput(nn.Module):
    """A Hugging Face model returning one tensor: ``getattr(model(x), key)`` (pooled features flattened)."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x: Tensor) -> Tensor:
        out = getattr(self.model(x), self.key)
        return out.flatten(1) if self.key == "pooler_output" else out


def _hf(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers as tf

        small = dict(hidden_sizes=[16, 32], depths=[1, 1], num_channels=3)
        if kind == "resnet":
            return HFOutput(
                tf.ResNetModel(tf.ResNetConfig(embedding_size=16, layer_type="basic", **small)), "pooler_output"
            )
        if kind == "convnext":
            return HFOutput(tf.ConvNextModel(tf.ConvNextConfig(num_stages=2, **small)), "pooler_output")
        text = dict(vocab_size=VOCAB)
        if kind == "gpt2":
            cfg = tf.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=TOKENS, **text)
            return HFOutput(tf.GPT2LMHeadModel(cfg), "logits")
        cfg = tf.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=TOKENS,
            **text,
        )
        return HFOutput(tf.BertModel(cfg), "last_hidden_state")

    return build


def _timm_specs() -> list[ModelSpec]:
    rows = [  # (name, what it covers)
        ("resnet10t", "plain BatchNorm2d"),
        ("regnetx_002", "BatchNormAct2d (ConvNormAct)"),
        ("efficientnet_b0", "BatchNormAct2d, SE, depthwise"),
        ("mobilenetv3_small_050", "BatchNormAct2d, hard-swish"),
        ("densenet121", "BatchNormAct2d before the conv (pre-activation)"),
        ("cs3darknet_s", "CSPNet, BatchNormAct2d"),
        ("resnext26ts", "ResNeXt (byobnet), BatchNormAct2d"),
        ("dpn48b", "DPN, BnActConv2d"),
        ("resnetv2_50x1_bit", "BiT: StdConv2d + GroupNormAct"),
        ("nf_resnet26", "NF-ResNet: ScaledStdConv2d, no norm"),
        ("nf_regnet_b0", "NF-RegNet: ScaledStdConv2d + plain convs"),
        ("convnext_atto", "LayerNorm2d"),
        ("repvgg_a0", "RepVGG: parallel conv/BN branches"),
        ("ghostnet_050", "GhostNet: plain BatchNorm2d"),
        ("levit_128s", "LeViT: BatchNorm1d after Linear"),
        ("mobilevit_xxs", "MobileViT: BatchNormAct2d + LayerNorm"),
    ]
    extra = {"levit_128s": {"img_size": IMAGE}}
    return [ModelSpec(n, "timm", _timm(n, **extra.get(n, {})), note=note) for n, note in rows]


def model_specs() -> dict[str, ModelSpec]:
    """Every model of the survey, by name (the ``--models`` names)."""
    specs = _timm_specs() + [
        ModelSpec("tv_resnet18", "torchvision", _torchvision(False), note="torchvision resnet18"),
        ModelSpec("tv_resnet18_frozenbn", "torchvision", _torchvision(True), note="norm_layer=FrozenBatchNorm2d"),
        ModelSpec("hf_resnet", "transformers", _hf("resnet"), note="ResNetModel, tiny config"),
        ModelSpec("hf_convnext", "transformers", _hf("convnext"), note="ConvNextModel, tiny config"),
        ModelSpec("hf_gpt2", "transformers", _hf("gpt2"), _tokens, note="GPT2LMHeadModel (Conv1D), tiny config"),
        ModelSpec("hf_bert", "transformers", _hf("bert"), _tokens, note="BertModel, tiny config"),
    ]
    return {s.name: s for s in specs}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def rel_diff(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want| (float64); inf when the shapes differ."""
    if got.shape != want.shape:
        return math.inf
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _deliberate(e: BaseException) -> bool:
    """True when normlab raised ``e`` itself (a ``raise`` statement in the package): a refusal, not a crash."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    inside = Path(last.filename).resolve().is_relative_to(NORMLAB_DIR)
    return inside and (last.line or "").lstrip().startswith("raise")


def _error(e: BaseException, where: str = "") -> dict:
    status = "refused" if _deliberate(e) else "crash"
    tb = traceback.extract_tb(e.__traceback__)
    at = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return {"status": status, "where": where, "error": type(e).__name__, "message": _first_line(e), "at": at}


@contextlib.contextmanager
def _captured():
    """Record every warning raised inside (as 'Category: first line') into the yielded list."""
    out: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield out
        finally:
            out.extend(f"{w.category.__name__}: {str(w.message).strip()[:500]}" for w in caught)


def _loss(out: Tensor) -> Tensor:
    """Cross-entropy for (N, C) outputs (labels 0, 1, ...), mean square otherwise."""
    out = out.float()
    if out.dim() == 2:
        return F.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1])
    return out.square().mean()


@torch.no_grad()
def _eval_output(model: nn.Module, x: Tensor) -> Tensor:
    was = model.training
    out = model.eval()(x)
    model.train(was)
    return out


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules(remove_duplicate=False))


_TORCH_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _replaced(before: dict[str, nn.Module], model: nn.Module) -> tuple[Counter, int]:
    """'Old -> New' type counts of the outermost modules that are no longer the same object, and how many of
    them were subclasses of a torch BatchNorm (timm's BatchNormAct2d: its activation goes with it)."""
    after = _modules(model)
    out: Counter = Counter()
    gone: list[str] = []
    subclasses = 0
    for name, old in before.items():
        new = after.get(name)
        if new is old or any(name.startswith(g + ".") for g in gone):
            continue
        gone.append(name)
        out[f"{type(old).__name__} -> {type(new).__name__ if new is not None else 'removed'}"] += 1
        subclasses += isinstance(old, nn.modules.batchnorm._BatchNorm) and type(old) not in _TORCH_BN
    return out, subclasses


def _sgd_step(model: nn.Module, x: Tensor) -> dict:
    """One SGD step in train mode: the loss before and after it."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01) if params else None
    loss = _loss(model(x))
    loss.backward()
    if opt is not None:
        opt.step()
    with torch.no_grad():
        after = _loss(model(x)).item()
    return {"loss": loss.item(), "loss_after": after, "trainable": len(params)}


# --------------------------------------------------------------------------------------------------
# the cells
# --------------------------------------------------------------------------------------------------
def convert_cell(base: nn.Module, x: Tensor, target: str, reference: Tensor, convert=convert_norm) -> dict:
    """Convert a copy of ``base`` to ``target``, compare eval outputs (keep targets), take one SGD step."""
    model = copy.deepcopy(base).train()
    before = _modules(model)
    cell: dict = {}
    with _captured() as cell["warnings"]:
        try:
            model = convert(model, to=target)
        except Exception as e:  # noqa: BLE001 - the cell reports every failure
            cell.update(_error(e, "convert"))
            return cell
        replaced, cell["bn_subclasses"] = _replaced(before, model)
        cell["replaced"] = dict(replaced)
        cell["status"] = "ok" if cell["replaced"] else "noop"
        try:
            if target in KEEP_TARGETS:
                cell["keep_diff"] = rel_diff(_eval_output(model, x), reference)
                if not cell["keep_diff"] <= TOL:
                    cell["status"] = "WRONG"
            cell.update(_sgd_step(model, x))
            if not (math.isfinite(cell["loss"]) and math.isfinite(cell["loss_after"])):
                cell["train"] = "nan loss"
        except Exception as e:  # noqa: BLE001
            cell["train_error"] = _error(e, "train")
            kind = cell["train_error"]["status"]
            cell["train"] = f"{kind} fwd" + (f": {type(e).__name__}" if kind == "crash" else "")
    return cell


def _bn_like(model: nn.Module) -> int:
    return sum(
        isinstance(m, (nn.modules.batchnorm._BatchNorm, *BATCH_RENORM_TYPES)) or type(m).__name__ == "FrozenBatchNorm2d"
        for m in model.modules()
    )


def fold_cell(model: nn.Module, x: Tensor, fold=fold_for_inference) -> dict:
    """``fold(model.eval(), example_input=x)``: relative output error, BatchNorms folded, warnings."""
    model = model.eval()
    reference = _eval_output(model, x)
    cell: dict = {"bn_like": _bn_like(model)}
    with _captured() as cell["warnings"]:
        try:
            folded = fold(model.eval(), example_input=x)
        except Exception as e:  # noqa: BLE001
            cell.update(_error(e, "fold"))
            if "differs from the original" not in cell["message"]:
                return cell
            cell["status"] = "caught"  # fold's own output check: measure how far off it was
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    folded = fold(model.eval(), example_input=x, rtol=math.inf)
                except Exception:  # noqa: BLE001
                    return cell
        cell.setdefault("status", "ok")
        cell["error_rel"] = rel_diff(_eval_output(folded, x), reference)
        cell["bn_folded"] = cell["bn_like"] - _bn_like(folded)
        cell["original_diff"] = rel_diff(_eval_output(model, x), reference)
    if cell["status"] == "ok" and not cell["error_rel"] <= TOL:
        cell["status"] = "WRONG"
    if not cell["original_diff"] <= TOL:
        cell["status"] = "MUTATED"
    return cell


def weight_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that apply a weight to their input: nn.Linear, nn.ConvNd, nn.ConvTransposeNd, transformers Conv1D."""
    types: tuple[type, ...] = (nn.Linear, nn.modules.conv._ConvNd)
    if "transformers" in sys.modules:  # a transformers model imported it (importing it here costs seconds)
        from transformers.pytorch_utils import Conv1D

        types += (Conv1D,)
    return {n or type(m).__name__: m for n, m in model.named_modules() if isinstance(m, types)}


def monitor_cell(base: nn.Module, x: Tensor, monitor_cls=VarianceMonitor) -> dict:
    """One training step under ``monitor_cls(model, every=1, optimizer=opt)``: weight modules that ran vs those
    recorded."""
    model = copy.deepcopy(base).train()
    mods = weight_modules(model)
    ran: set[str] = set()
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: ran.add(n)) for n, m in mods.items()]
    cell: dict = {"weight_modules": len(mods)}
    with _captured() as cell["warnings"]:
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            mon = monitor_cls(model, every=1, optimizer=opt)
            _loss(model(x)).backward()
            opt.step()  # the monitor records the step
            mon.close()
        except Exception as e:  # noqa: BLE001
            cell.update(_error(e, "monitor"))
            return cell
        finally:
            for h in handles:
                h.remove()
    recorded = {r["layer"] for r in mon.records if r.get("kind") != "norm" and "output_var" in r}
    bad = [(r["layer"], k) for r in mon.records for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    missing = sorted(ran - recorded)
    cell.update(
        status="ok" if not missing else "MISS",
        ran=len(ran),
        recorded=len(ran & recorded),
        records=len(mon.records),
        nonfinite=len(bad),
        nonfinite_keys=dict(Counter(k for _, k in bad)),
        nonfinite_first=bad[:10],
        missing_first=[f"{n} ({type(mods[n]).__name__})" for n in missing[:10]],
        missing_types=dict(Counter(type(mods[n]).__name__ for n in missing)),
    )
    return cell


# --------------------------------------------------------------------------------------------------
# one model
# --------------------------------------------------------------------------------------------------
def _build(spec: ModelSpec) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = spec.build().train()
    x = spec.example()
    return model, x, _eval_output(model, x)


def survey_model(
    spec: ModelSpec,
    targets: Iterable[str],
    emit: Callable[[str, dict], None],
    *,
    convert=convert_norm,
    fold=fold_for_inference,
    monitor_cls=VarianceMonitor,
) -> None:
    """Run every cell of ``spec``'s row, calling ``emit(column, cell)`` as each is done ("model" first)."""
    t = time.perf_counter()
    try:
        base, x, reference = _build(spec)
    except Exception as e:  # noqa: BLE001
        emit("model", _error(e, "build"))
        return
    emit(
        "model",
        {
            "status": "ok",
            "params": sum(p.numel() for p in base.parameters()),
            "input": list(x.shape),
            "seconds": round(time.perf_counter() - t, 3),
        },
    )

    def timed(column: str, fn, *args) -> None:
        start = time.perf_counter()
        cell = fn(*args)
        cell["seconds"] = round(time.perf_counter() - start, 3)
        emit(column, cell)

    for target in targets:
        timed(target, convert_cell, base, x, target, reference, convert)
    timed("fold", fold_cell, copy.deepcopy(base), x, fold)
    timed("fold_pws", _fold_converted, base, x, convert, fold)
    timed(MONITOR_COLUMN, monitor_cell, base, x, monitor_cls)


def _fold_converted(base: nn.Module, x: Tensor, convert, fold) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = convert(copy.deepcopy(base).train(), to="pws")
    except Exception as e:  # noqa: BLE001
        return _error(e, "convert pws")
    return fold_cell(model, x, fold)


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------
def _num(v: float) -> str:
    return f"{v:.1g}"


def _warn_suffix(cell: dict) -> str:
    n = len(cell.get("warnings") or [])
    return f" w{n}" if n else ""


def cell_text(column: str, cell: dict | None) -> str:
    """The short text of one cell ("ok", "ok 2e-07", "refused", "WRONG 0.6", "crash: TypeError", ...)."""
    if cell is None:
        return "-"
    status = cell.get("status", "?")
    if status in ("crash", "refused", "timeout", "died"):
        where = cell.get("where", "")
        kind = f"crash {where}" if status == "crash" and where not in ("", "convert", "fold", "monitor") else status
        return f"{kind}: {cell['error']}" if status == "crash" else kind
    if column == MONITOR_COLUMN:
        text = f"{status} {cell['recorded']}/{cell['ran']}"
        return text + (f" nonfinite {cell['nonfinite']}" if cell["nonfinite"] else "") + _warn_suffix(cell)
    if column in FOLD_COLUMNS:
        text = status if status == "MUTATED" else f"{status} {_num(cell['error_rel'])}"
        return f"{text} {cell['bn_folded']}/{cell['bn_like']}" + _warn_suffix(cell)
    text = status + (f" {_num(cell['keep_diff'])}" if "keep_diff" in cell else "")
    if cell.get("bn_subclasses"):
        text += f" sub:{cell['bn_subclasses']}"
    if cell.get("train"):
        text += f"; {cell['train']}"
    return text + _warn_suffix(cell)


def columns(targets: Iterable[str]) -> list[str]:
    return [*targets, *FOLD_COLUMNS, MONITOR_COLUMN]


def markdown(rows: list[dict], targets: list[str], seconds: float | None = None) -> str:
    """The Markdown table: one row per model, one column per target + fold, fold pws, monitor."""
    cols = columns(targets)
    head = ["model", *(c.replace("_", " ") for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        build = row["cells"].get("model") or {}
        if build.get("status") not in (None, "ok"):
            texts = [cell_text("model", build)] * len(cols)
        else:
            texts = [cell_text(c, row["cells"].get(c)) for c in cols]
        lines.append("| " + " | ".join([f"`{row['model']}`", *texts]) + " |")
    legend = (
        f"Cells: see lab/scripts/real_models.py. Keep/fold tolerance: relative output difference {TOL:g}. "
        "fold cells: relative error, BatchNorms folded / BatchNorm-like layers; monitor: recorded/ran; "
        "sub:N: N replaced layers were subclasses of a torch BatchNorm (timm's BatchNormAct2d: its activation "
        "is replaced too); wN: N warnings (texts in the JSON)."
    )
    timing = f" Whole run: {seconds:.0f} s." if seconds is not None else ""
    return "\n".join(lines) + "\n\n" + legend + timing + "\n"


# --------------------------------------------------------------------------------------------------
# running: in this process or one subprocess per model
# --------------------------------------------------------------------------------------------------
def _row(spec: ModelSpec, cells: dict, seconds: float) -> dict:
    return {"model": spec.name, "family": spec.family, "note": spec.note, "seconds": round(seconds, 2), "cells": cells}


def _rows_inline(specs: list[ModelSpec], targets: list[str], on_row, **fns) -> None:
    for spec in specs:
        t = time.perf_counter()
        cells: dict[str, dict] = {}
        survey_model(spec, targets, cells.__setitem__, **fns)
        on_row(_row(spec, cells, time.perf_counter() - t))


class _Worker:
    """A subprocess running ``--worker a,b,...``: it writes one JSON line per cell to a file, which is read as it
    grows; a model that takes longer than ``timeout`` s is killed with its worker."""

    def __init__(self, names: list[str], targets: list[str], threads: int, tmp: Path) -> None:
        self.out, self.err = tmp / "cells.jsonl", tmp / "stderr.txt"
        self.out.touch()
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            ",".join(names),
            "--targets",
            ",".join(targets),
            "--threads",
            str(threads),
            "--cells-out",
            str(self.out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        with open(self.err, "w") as ferr:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=ferr, env=env, cwd=ROOT)
        self._offset, self._buffer = 0, ""

    def records(self) -> list[dict]:
        """The complete lines written since the last call."""
        with open(self.out) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split("\n")
        return [json.loads(line) for line in lines if line.strip()]

    def stderr_tail(self) -> str:
        return self.err.read_text(errors="replace")[-2000:]


def _run_worker(specs: list[ModelSpec], targets: list[str], threads: int, timeout: float, on_row) -> int:
    """Run the models of ``specs`` in one worker until it ends or one model fails; returns how many have a row."""
    done, cells, started = 0, {}, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        worker = _Worker([s.name for s in specs], targets, threads, Path(tmp))
        rc: int | None = None
        while True:
            finished = worker.proc.poll() is not None
            for rec in worker.records():
                if rec["column"] == "start":
                    cells, started = {}, time.monotonic()
                elif rec["column"] == "end":
                    on_row(_row(specs[done], cells, rec["cell"]["seconds"]))
                    done += 1
                else:
                    cells[rec["column"]] = rec["cell"]
            if finished:
                rc = worker.proc.returncode
                break
            if time.monotonic() - started > timeout:
                worker.proc.kill()
                worker.proc.wait()
                break
            time.sleep(0.05)
        tail = worker.stderr_tail()
    if done < len(specs):  # the model in progress crashed the worker or hung
        _fill_missing(cells, targets, rc, timeout, tail)
        on_row(_row(specs[done], cells, time.monotonic() - started))
        done += 1
    return done


def _fill_missing(cells: dict, targets: list[str], rc: int | None, timeout: float, tail: str) -> None:
    """Cells the worker did not write: ``timeout`` (killed after ``timeout`` s) or ``died`` (exit code rc)."""
    if rc is None:
        missing = {"status": "timeout", "message": f"worker killed after {timeout:g} s"}
    else:
        missing = {"status": "died", "message": f"worker exited with code {rc}", "stderr_tail": tail}
    for col in ["model", *columns(targets)]:
        cells.setdefault(col, dict(missing))


def _summary(row: dict, targets: list[str]) -> str:
    cells = row["cells"]
    texts = {c: cell_text(c, cells.get(c)) for c in columns(targets)}
    bad = [f"{c}={t}" for c, t in texts.items() if not t.startswith(("ok", "noop")) or ";" in t or "nonfinite" in t]
    return ", ".join(bad) if bad else "all ok"


def survey(
    models: Iterable[str | ModelSpec],
    targets: Iterable[str] = CONVERT_TARGETS,
    *,
    isolate: bool = True,
    threads: int = 1,
    timeout: float = 180.0,
    progress: bool = True,
    **fns,
) -> list[dict]:
    """Rows of the survey for ``models`` (names of :func:`model_specs` or ModelSpec objects).

    ``isolate``: run the models in a worker subprocess (one import for all); a model that crashes it or runs
    longer than ``timeout`` s gets ``died``/``timeout`` cells and a new worker takes the rest. Otherwise in this
    process, where ``convert``/``fold``/``monitor_cls`` in ``fns`` replace normlab's (a worker uses normlab's).
    ``progress``: one line per model on stderr."""
    targets, known = list(targets), model_specs()
    specs = [m if isinstance(m, ModelSpec) else known[m] for m in models]
    if isolate and (fns or any(known.get(s.name) is not s for s in specs)):
        raise ValueError("survey: custom converters/models run only with isolate=False (a worker rebuilds by name)")
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        if progress:
            print(
                f"[{len(rows)}/{len(specs)}] {row['model']} {row['seconds']:.1f}s: {_summary(row, targets)}",
                file=sys.stderr,
                flush=True,
            )

    if not isolate:
        _rows_inline(specs, targets, on_row, **fns)
    while len(rows) < len(specs):
        _run_worker(specs[len(rows) :], targets, threads, timeout, on_row)
    return rows


def _worker(names: list[str], targets: list[str], cells_out: str) -> int:
    specs = model_specs()
    with open(cells_out, "a") as f:

        def emit(column: str, cell: dict) -> None:
            f.write(json.dumps({"column": column, "cell": cell}, default=str) + "\n")
            f.flush()

        for name in names:
            t = time.perf_counter()
            emit("start", {"model": name})
            survey_model(specs[name], targets, emit)
            emit("end", {"seconds": round(time.perf_counter() - t, 2)})
    return 0


def _csv(value: str, valid: Iterable[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in valid]
    if unknown or not items:
        raise SystemExit(
            f"real_models: unknown {what} {', '.join(unknown) or '(none given)'}; expected some of {', '.join(valid)}"
        )
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(model_specs()), help="comma-separated names (default: all)")
    p.add_argument("--targets", default=",".join(CONVERT_TARGETS), help="convert_norm targets (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per model (default 1)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per model before its worker is killed")
    p.add_argument("--out", help="Markdown table file (default: stdout)")
    p.add_argument("--json", help="JSON file with every cell's details")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cells-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.worker:
        return _worker(args.worker.split(","), targets, args.cells_out)
    models = _csv(args.models, model_specs(), "model")
    targets = _csv(args.targets, CONVERT_TARGETS, "target")
    start = time.perf_counter()
    rows = survey(models, targets, threads=args.threads, timeout=args.timeout)
    seconds = time.perf_counter() - start
    table = markdown(rows, targets, seconds)
    if args.out:
        Path(args.out).write_text(table)
    else:
        sys.stdout.write(table)
    if args.json:
        doc = {
            "targets": targets,
            "tolerance": TOL,
            "threads": args.threads,
            "seconds": round(seconds, 1),
            "torch": torch.__version__,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"real_models: {len(rows)} models in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
