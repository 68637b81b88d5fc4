"""tests/torchvision_cpu.py: torchvision's model definitions and timm import and run beside the CPU torch."""

import torch
import torchvision_cpu
from conftest import needs


def test_torchvision_python_parts_import_and_run():
    torchvision = needs("torchvision")
    models = needs("torchvision.models")
    misc = needs("torchvision.ops.misc")
    assert torchvision.__version__
    model = models.resnet18(num_classes=3).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    frozen = misc.FrozenBatchNorm2d(4)
    assert torch.equal(frozen(torch.zeros(1, 4, 2, 2)), torch.zeros(1, 4, 2, 2))


def test_timm_imports_after_prepare():
    timm = needs("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=2).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 2)


def test_prepare_is_idempotent():
    needs("torchvision")
    assert torchvision_cpu.prepare() is False  # conftest already defined what was missing


def test_a_fresh_interpreter_imports_torchvision():
    """Subprocesses and spawned workers (Lightning's torchmetrics imports torchvision) get the hook from the .pth."""
    import subprocess
    import sys

    needs("torchvision")
    code = "import sys; assert 'torch' not in sys.modules; import torchvision.ops.misc; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
