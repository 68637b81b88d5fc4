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

Other processes of the test environment import torchvision too (torchmetrics, which Lightning imports, imports it
whenever it is installed; subprocesses and spawned workers do not run conftest). ``python tests/torchvision_cpu.py
--install`` (``make test``'s setup runs it) copies this file into the environment's site-packages with a ``.pth``
line that puts :class:`_PrepareOnImport` on ``sys.meta_path``: at the first ``import torchvision`` of any process it
calls :func:`prepare` and steps aside. Startup stays cheap (torch is imported only when torchvision is).
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import shutil
import sys
import sysconfig

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # kept alive: the definitions last as long as this Library object


def _defined(op: str) -> bool:
    import torch

    try:
        torch._C._dispatch_has_kernel_for_dispatch_key(f"torchvision::{op}", "Meta")
    except RuntimeError:
        return False
    return True


def prepare() -> bool:
    """Define the missing torchvision operator schemas; True if any was defined. Safe to call more than once."""
    global _LIBRARY
    import torch  # here, not at the top: the .pth hook imports this module at every interpreter start

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


class _PrepareOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`prepare` when ``torchvision`` is first imported, then removes itself (finds nothing itself)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            prepare()
        return None


def install_hook() -> None:
    """Put :class:`_PrepareOnImport` first on ``sys.meta_path`` (once), unless torchvision is already imported."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _PrepareOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PrepareOnImport())


def install_into_environment() -> str:
    """Copy this module into the running interpreter's site-packages with a ``.pth`` that calls :func:`install_hook`."""
    site = sysconfig.get_paths()["purelib"]
    shutil.copyfile(__file__, os.path.join(site, "_normlab_torchvision_cpu.py"))
    with open(os.path.join(site, "_normlab_torchvision_cpu.pth"), "w") as f:
        f.write("import _normlab_torchvision_cpu; _normlab_torchvision_cpu.install_hook()\n")
    return site


if __name__ == "__main__" and sys.argv[1:] == ["--install"]:
    print(f"torchvision_cpu: import hook installed in {install_into_environment()}")
