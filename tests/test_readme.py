"""The Python examples of the README and of docs/integrations.md run as written (in a temporary directory: some
write runs/...); no README line is longer than 120 characters. (The README's table of claims is the lab's record:
lab/tests/test_records.py checks it.)"""

import os
import re
from pathlib import Path

from conftest import timm_tables_kept

README = Path(__file__).resolve().parents[1] / "README.md"
INTEGRATIONS = README.parent / "docs" / "integrations.md"  # the integrations' examples, moved out of the README
EXTRAS = ("lightning", "tensorboard", "ray", "onnx", "onnxruntime", "onnxscript", "timm")


def test_readme_python_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    blocks += re.findall(r"```python\n(.*?)```", INTEGRATIONS.read_text(), flags=re.S)
    for code in blocks:
        try:
            with timm_tables_kept():  # the timm example registers normlab's NormAct classes with timm
                exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
        except ModuleNotFoundError as e:  # an integration's example without its extra (make test has them all)
            if (e.name or "").split(".")[0] not in EXTRAS or os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
                raise
    assert "None" in capsys.readouterr().out  # the examples print mon.alarm, None on a healthy step
    assert (tmp_path / "runs" / "resnet10t" / "results.md").is_file()  # the comparison on a timm model wrote its report
    if (tmp_path / "runs" / "tb").is_dir():  # the TensorBoard example wrote its event file
        assert list((tmp_path / "runs" / "tb").glob("events.out.tfevents.*"))


def test_readme_lines_fit_120_columns_and_its_first_screen_says_how_to_start():
    lines = README.read_text().splitlines()
    assert all(len(line) <= 120 for line in lines), [i + 1 for i, line in enumerate(lines) if len(line) > 120]
    first = "\n".join(lines[:45])
    for needed in ("not on the package index yet", "--index-url", "make demo", "make test", "minutes"):
        assert needed in first, needed
    # its first command works from a checkout: until a release there is no `pip install normlab` to copy
    first_block = re.search(r"```bash\n(.*?)```", first, flags=re.S).group(1)
    assert first_block.splitlines()[0].startswith("pip install -e . "), first_block
    assert "pip install normlab" not in README.read_text()
    text = "\n".join(lines)
    assert text.count("How to read its report") + text.count("Reading the demo's report") == 0


def test_the_ten_lines_are_ten_lines():
    """The "Ten lines" example has ten lines of code (blank lines aside); it had 13."""
    text = README.read_text()
    block = re.search(r"## Ten lines\n\n```python\n(.*?)```", text, flags=re.S).group(1)
    assert len([line for line in block.splitlines() if line.strip()]) == 10, block
    assert "[Ten lines](#ten-lines)" in text
