"""``normlab export``: a trained run as a deployable model (folded for inference, then ONNX and/or TorchScript)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from normlab.runner.errors import UsageError
from normlab.runner.export import export_onnx, export_torchscript, fold_run, load_run_model, require_onnx
from normlab.runner.io import check_dir_option

NAME = "export"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="export a trained run for inference (ONNX, TorchScript)",
        description="Rebuild the model of a normlab run from its checkpoint, fold WS/PWS/weight-norm "
        "kernels and conv -> BatchNorm pairs into plain convs (normlab.convert."
        "fold_for_inference), then write ONNX (checked in onnxruntime) and/or TorchScript. "
        "Inputs have a dynamic batch axis.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a run directory (normlab train --out, or OUT/runs/<cell> of a grid) or its checkpoint.pt",
    )
    p.add_argument(
        "--onnx",
        metavar="PATH",
        default=None,
        help="write the ONNX model here (pip install 'normlab[onnx]'); input 'input', output 'logits'",
    )
    p.add_argument(
        "--torchscript",
        metavar="PATH",
        default=None,
        help="write a traced TorchScript model here (torch.jit.load; deprecated by torch >= 2.9)",
    )
    p.set_defaults(run=run)
    return p


def _check_file_option(path: str, option: str) -> None:
    if not path.strip():
        raise UsageError(f"{option}: expected a file path, got an empty string")
    if os.path.isdir(path):
        raise UsageError(f"{option} {path} is a directory; expected a file path")
    check_dir_option(Path(path).parent, option)


def _check_args(args: argparse.Namespace) -> None:
    if args.onnx is None and args.torchscript is None:
        raise UsageError("expected --onnx PATH and/or --torchscript PATH")
    for option, path in (("--onnx", args.onnx), ("--torchscript", args.torchscript)):
        if path is not None:
            _check_file_option(path, option)
    if (
        args.onnx is not None
        and args.torchscript is not None
        and os.path.realpath(args.onnx) == os.path.realpath(args.torchscript)
    ):
        raise UsageError(
            f"--torchscript {args.torchscript}: expected another path than --onnx (one would overwrite the other)"
        )
    if args.onnx is not None:
        require_onnx()


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    model, cfg, shape = load_run_model(args.checkpoint)
    folded, example = fold_run(model, shape)
    dims = ", ".join(map(str, shape))
    what = f"{cfg.model} ({cfg.norm}/{cfg.conv}, width {cfg.width:g}), inputs (N, {dims}) as for {cfg.dataset}"
    if args.onnx is not None:
        diff = export_onnx(folded, example, args.onnx)
        check = "not checked: pip install onnxruntime" if diff is None else f"onnxruntime matches torch to {diff:.2g}"
        print(f"normlab export: ONNX {args.onnx}: {what}; {check}")
    if args.torchscript is not None:
        diff = export_torchscript(folded, example, args.torchscript)
        print(f"normlab export: TorchScript {args.torchscript}: {what}; the trace matches torch to {diff:.2g}")
    return 0
