"""The README's Python examples run as written (in a temporary directory: some write runs/...)."""

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
EXTRAS = ("lightning", "tensorboard", "ray", "onnx", "onnxruntime", "onnxscript")


def test_readme_python_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        try:
            exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
        except ModuleNotFoundError as e:  # an integration's example without its extra (make test has them all)
            if (e.name or "").split(".")[0] not in EXTRAS or os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
                raise
    assert "None" in capsys.readouterr().out  # the examples print mon.alarm, None on a healthy step
    if (tmp_path / "runs" / "tb").is_dir():  # the TensorBoard example wrote its event file
        assert list((tmp_path / "runs" / "tb").glob("events.out.tfevents.*"))
