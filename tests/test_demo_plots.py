"""The demo's figures read on a slide: type of at least 9 points, a legend that names only the marks drawn, caveats
on the figure itself (points not at their plateau), no sideways shift of the accuracy curves, the collapse figure
on runs that collapsed with one colour per layer in every panel and no empty panels."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.text import Text  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_demo_report import _demo  # noqa: E402
from test_demo_twins import _twin_demo  # noqa: E402

from normlab.runner.experiments.demo import diagnosis, plots  # noqa: E402
from normlab.runner.experiments.demo.report import diagnosis_picks  # noqa: E402
from normlab.runner.experiments.demo.twins import plot_twins, twin_pairs  # noqa: E402

MIN_POINTS = 9


@pytest.fixture
def saved(monkeypatch):
    """The figures the plot functions save (drawn, so tick labels exist), instead of their files."""
    figures = []

    def keep(fig, path, dpi=100, **kw):
        fig.canvas.draw()
        figures.append(fig)
        return Path(path)

    monkeypatch.setattr(plots, "atomic_savefig", keep)
    monkeypatch.setattr(diagnosis, "atomic_savefig", keep)
    monkeypatch.setattr("normlab.runner.io.atomic_savefig", keep)  # twins imports it when it draws
    return figures


def _texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _legend(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def _readable(fig) -> None:
    small = {t.get_text()[:30]: t.get_fontsize() for t in _texts(fig) if t.get_fontsize() < MIN_POINTS}
    assert not small, small


def test_accuracy_vs_lr_small_multiples_at_the_true_rates_and_only_drawn_marks(saved, tmp_path):
    a = _demo()["sections"]["lr_sweep"]
    plots.lr_plot(a, tmp_path / "a.png")
    (fig,) = saved
    _readable(fig)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == len(a["spec"]["norms"])  # one panel per norm: norms never hide each other
    for ax in panels:  # the means stand at the learning rates themselves (no sideways shift)
        bold = [ln for ln in ax.lines if ln.get_linewidth() > 2]
        assert bold and sorted(bold[0].get_xdata()) == sorted(a["spec"]["lrs"])
    assert not any("collapsed" in x for x in _legend(fig))  # no seed collapsed: no x in the legend
    a = copy.deepcopy(a)
    a["cells"][0]["collapsed"] = True
    plots.lr_plot(a, tmp_path / "a.png")
    assert any("collapsed" in x for x in _legend(saved[-1]))


def _traces(tmp_path: Path, results: dict, bad: dict[str, list]) -> Path:
    for c in results["cells"]:
        run = tmp_path / "lr_sweep" / "runs" / c["cell"]
        run.mkdir(parents=True)
        losses = bad.get(c["cell"], [2.3 - 0.01 * s for s in range(50)])
        (run / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": losses}))
    return tmp_path / "lr_sweep"


def test_loss_curves_legend_names_only_the_marks_drawn_and_marks_stay_clear_of_titles(saved, tmp_path):
    a = _demo()["sections"]["lr_sweep"]
    plots.loss_curves_plot(a, _traces(tmp_path / "healthy", a, {}), tmp_path / "l.png")
    fig = saved[-1]
    _readable(fig)
    assert not any("diverged" in x or "non-finite" in x for x in _legend(fig))
    diverged = [2.3, 5.0, 30.0, 80.0, None, None]  # crosses the axis' loss ceiling, then non-finite
    plots.loss_curves_plot(a, _traces(tmp_path / "bad", a, {a["cells"][0]["cell"]: diverged}), tmp_path / "l.png")
    fig = saved[-1]
    labels = _legend(fig)
    assert any("diverged" in x for x in labels) and any("non-finite" in x for x in labels)
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_marker() in ("^", "X"):  # inside the panel, below its top (where the title sits)
                assert max(line.get_ydata()) < ax.get_ylim()[1]


def test_batch_plot_marks_the_points_not_at_their_plateau_on_the_figure(saved, tmp_path):
    demo = _demo(plateau=False)  # batch 128 not at its plateau
    b, plateau = demo["sections"]["batch_size"], demo["evidence"]["plateau"]
    plots.batch_plot(b, tmp_path / "b.png", plateau)
    fig = saved[-1]
    _readable(fig)
    note = fig._supxlabel.get_text() if fig._supxlabel else ""
    assert "did not reach their plateau (batch 128)" in note  # only batch 128 is short of its plateau here
    assert "Equal epochs: batch 128 trains 15 steps, batch 2 1000" in note  # why batch 128 sits low
    rings = [ln for ax in fig.axes for ln in ax.lines if ln.get_markerfacecolor() == "none"]
    assert rings and all(100 < ln.get_xdata()[0] < 160 for ln in rings)  # at batch 128 only
    assert any("plateau" in x for x in _legend(fig))
    demo = _demo(plateau=True)
    plots.batch_plot(demo["sections"]["batch_size"], tmp_path / "b.png", demo["evidence"]["plateau"])
    fig = saved[-1]
    assert not [ln for ax in fig.axes for ln in ax.lines if ln.get_markerfacecolor() == "none"]
    assert "plateau" not in fig._supxlabel.get_text() and not any("plateau" in x for x in _legend(fig))
    assert "Equal epochs" in fig._supxlabel.get_text()


def test_the_collapse_figure_shows_a_collapsed_seed_of_each_norm_and_one_healthy_reference(tmp_path):
    cells = [{"cell": f"{n}_s{s}", "name": n, "seed": s} for n in ("none", "bn", "pws") for s in (0, 1, 2)]
    diag = {c["cell"]: {"collapsed": False, "collapse_reason": None} for c in cells}
    diag["none_s1"] = {"collapsed": True, "collapse_reason": "never_left_chance", "collapse_step": None}
    diag["pws_s2"] = {"collapsed": True, "collapse_reason": "non_finite_loss", "collapse_step": 12}
    picks = diagnosis_picks(tmp_path, cells, diag)
    assert [p.name for _, p in picks] == ["none_s1", "pws_s2", "bn_s0"]  # seed 0 of pws did not collapse
    assert [label for label, _ in picks] == [
        "none seed 1: dead (never learned)",
        "pws seed 2: non-finite loss at step 12",
        "bn seed 0: did not collapse",
    ]


def test_the_collapse_figure_is_readable_with_one_colour_per_layer_and_no_empty_panel(saved, tmp_path):
    demo, out = _twin_demo(tmp_path)
    runs = [("none seed 0", out / "collapse/runs/none_s0"), ("none seed 1", out / "collapse/runs/none_s1")]
    diagnosis.plot_diagnosis(runs, tmp_path / "c.png")
    fig = saved[-1]
    _readable(fig)
    colour = {}
    for ax in fig.axes:
        assert ax.lines or not ax.axison  # a panel with nothing drawn is replaced by its note
        for line in ax.lines:
            if not line.get_label().startswith("_"):
                assert colour.setdefault(line.get_label(), line.get_color()) == line.get_color()  # same in every panel
    assert len(set(map(str, colour.values()))) == len(colour) >= 2  # layers apart
    labels = _legend(fig)
    assert any("countdown alarm" in x for x in labels) and any("regime warning" in x for x in labels)
    diagnosis.plot_diagnosis(runs[1:], tmp_path / "c.png")  # a healthy run: no alarm, no warning drawn
    labels = _legend(saved[-1])
    assert not any("countdown alarm" in x or "regime warning" in x for x in labels), labels


def test_the_twins_figure_keeps_coinciding_curves_visible_and_names_only_drawn_marks(saved, tmp_path):
    demo, out = _twin_demo(tmp_path)
    pairs = twin_pairs(demo, demo["evidence"])
    plot_twins(pairs, out, tmp_path / "t.png")
    fig = saved[-1]
    _readable(fig)
    for ax in fig.axes:  # the unguarded run a wide band under the guarded line: both visible where they coincide
        widths = [ln.get_linewidth() for ln in ax.lines[:2]]
        assert widths[0] > 2 * widths[1]
    assert any("trouble" in x for x in _legend(fig))
    healthy = [p for p in pairs if not p["guarded"]["rescues"]]
    plot_twins(healthy, out, tmp_path / "t.png")
    labels = _legend(saved[-1])
    assert not any("trouble" in x or "rolled back" in x for x in labels), labels
