"""Import torchvision's Python parts (model definitions, ``ops.misc``) beside a CPU build of torch.

The registry's torchvision wheel links a CUDA build of torch for its C++ operators (``torchvision/_C.so``). Beside
the CPU torch that ``make test`` installs, that extension does not load, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py``: it registers fake (meta) kernels for ``torchvision::nms`` and
``torchvision::qnms`` with ``torch.library.register_fake``, which needs the operators' schemas, and only the
extension would have defined them ("operator torchvision::nms does not exist").

:func:`prepare` defines those two schemas (the signatures of torchvision's C++ ``nms``/``qnms``) when they do not
exist, before torchvision is imported. Nothing else changes: the model definitions, ``FrozenBatchNorm2d`` and the
other Python layers import and run on the CPU; calling ``torchvision.ops.nms`` itself raises (no kernel), which no
test needs. With a torchvision whose extension loads (a matching build), the schemas exist and this does nothing.
timm imports ``torchvision.ops.misc``, so this must run before ``import timm`` too (``tests/conftest.py`` calls it).
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # kept alive: the definitions last as long as this Library object


def _defined(op: str) -> bool:
    try:
        torch._C._dispatch_has_kernel_for_dispatch_key(f"torchvision::{op}", "Meta")
    except RuntimeError:
        return False
    return True


def prepare() -> bool:
    """Define the missing torchvision operator schemas; True if any was defined. Safe to call more than once."""
    global _LIBRARY
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    # The extension, if it loads, defines the schemas itself: try it first, as torchvision's import would (without
    # importing the package, whose __init__ is what fails).
    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError):
            pass

    missing = [op for op in _SCHEMAS if not _defined(op)]
    if not missing:
        return False
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for op in missing:
        _LIBRARY.define(_SCHEMAS[op])
    return True
