"""The demo's figures read on a slide: type of at least 9 points, a legend that names only the marks drawn, caveats
on the figure itself (points not at their plateau), no sideways shift of the accuracy curves, the collapse figure
on runs that collapsed with one colour per layer in every panel and no empty panels."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.text import Text  # noqa: E402

from normlab.runner.grid import plots as grid_plots  # noqa: E402
from normlab.runner.grid.palette import NORM_ORDER, norm_color, norm_order  # noqa: E402
from normlab_lab.demo import diagnosis, plots, twins  # noqa: E402
from normlab_lab.demo.report import diagnosis_picks  # noqa: E402
from normlab_lab.demo.twins import plot_twins, step_axis, twin_pairs  # noqa: E402

from .test_demo_report import _demo  # noqa: E402
from .test_demo_twins import ALARM, _records, _twin_demo  # noqa: E402

MIN_POINTS = 9


def saved_keep(figures: list):
    """A stand-in for atomic_savefig that draws the figure (so tick labels exist) and keeps it in ``figures``."""

    def keep(fig, path, dpi=100, **kw):
        fig.canvas.draw()
        figures.append(fig)
        return Path(path)

    return keep


@pytest.fixture
def saved(monkeypatch):
    """The figures the plot functions save (drawn, so tick labels exist), instead of their files."""
    figures = []
    keep = saved_keep(figures)
    monkeypatch.setattr(plots, "atomic_savefig", keep)
    monkeypatch.setattr(diagnosis, "atomic_savefig", keep)
    monkeypatch.setattr(twins, "atomic_savefig", keep)
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


def _grids() -> tuple[dict, dict]:
    """Sections (a) and (b) of a demo record, as grid results the grid report can also draw."""
    demo = _demo()
    for section in demo["sections"].values():
        section["spec"].update(dataset="mnist1d", model="plain1d")
    return demo["sections"]["lr_sweep"], demo["sections"]["batch_size"]


def _norm_colours(fig, names: list[str]) -> dict[str, str]:
    """norm -> the colour a figure gives it: its legend entry (a figure with one legend entry per norm), else the
    title of its panel (one panel per norm, in the figure's order)."""
    from matplotlib.colors import to_hex

    out = {}
    for legend in fig.legends:
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            if text.get_text() in names:
                out[text.get_text()] = to_hex(handle.get_color())
    if not out:
        panels = [ax for ax in fig.axes if ax.get_visible()]
        for ax, name in zip(panels, norm_order(names)):
            out[name] = to_hex(ax.title.get_color())
    return out


def test_a_norm_has_one_colour_and_one_place_in_every_figure_that_draws_norms(saved, monkeypatch, tmp_path):
    from matplotlib.colors import to_hex

    monkeypatch.setattr(grid_plots, "atomic_savefig", saved_keep(saved))
    a, b = _grids()
    b["spec"]["norms"] = list(reversed(b["spec"]["norms"]))  # a grid may list its norms in any order
    seen: dict[str, set[str]] = {}
    figures = [
        (plots.lr_plot, (a, tmp_path / "a.png"), a),
        (plots.loss_curves_plot, (a, _traces(tmp_path, a, {}), tmp_path / "l.png"), a),
        (plots.batch_plot, (b, tmp_path / "b.png"), b),
        (grid_plots.metric_lr_plot, (a, tmp_path / "g.png"), a),
        (grid_plots.metric_batch_plot, (b, tmp_path / "h.png"), b),
    ]
    for draw, args, results in figures:
        draw(*args)
        colours = _norm_colours(saved[-1], results["spec"]["norms"])
        assert set(colours) == set(results["spec"]["norms"]), (draw.__name__, colours)
        for name, colour in colours.items():
            seen.setdefault(name, set()).add(colour)
        labels = [t for t in _legend(saved[-1]) if t in colours]
        assert not labels or labels == norm_order(labels), labels  # listed in the one fixed order
    assert all(c == {to_hex(norm_color(n))} for n, c in seen.items()), seen
    assert {"bn", "pws", "none"} <= set(seen)


def test_the_palette_gives_every_known_norm_its_own_colour_and_a_fixed_order():
    from matplotlib.colors import to_hex

    assert len({to_hex(norm_color(n)) for n in NORM_ORDER}) == len(NORM_ORDER)
    assert norm_order(["pws:gamma=0.01", "x", "bn", "none", "pws"]) == ["none", "bn", "pws", "pws:gamma=0.01", "x"]
    assert norm_color("gn:groups=8") == norm_color("gn:groups=8")  # a name without an entry: the same every time


def _bimodal(results: dict, name: str, x_key: str, x: float, accs: tuple[float, ...]) -> dict:
    """``results`` with the seeds of (``name``, ``x``) at ``accs`` (two clusters: mean +- std passes 0 % or 100 %)."""
    results = copy.deepcopy(results)
    cells = [c for c in results["cells"] if c["name"] == name and float(c[x_key]) == x]
    for c, acc in zip(cells, accs, strict=True):
        c["final_test_acc"] = c["final_test_acc_train_mode"] = acc
    mean = sum(accs) / len(accs)
    std = (sum((v - mean) ** 2 for v in accs) / (len(accs) - 1)) ** 0.5
    for g in results["groups"]:
        if g["name"] == name and float(g[x_key]) == x:
            g.update(final_mean=mean, final_std=std, train_mode_mean=mean)
    return results


def _bars(fig) -> list[tuple[float, float, float]]:
    """(x, bottom, top) of every error bar drawn."""
    from matplotlib.collections import LineCollection

    return [
        (seg[0][0], min(seg[0][1], seg[1][1]), max(seg[0][1], seg[1][1]))
        for ax in fig.axes
        for coll in ax.collections
        if isinstance(coll, LineCollection)
        for seg in coll.get_segments()
        if len(seg) == 2 and seg[0][0] == seg[1][0]
    ]


@pytest.mark.parametrize("high", [False, True])
def test_accuracy_bars_span_the_seeds_and_stay_between_0_and_100_percent(saved, monkeypatch, tmp_path, high):
    monkeypatch.setattr(grid_plots, "atomic_savefig", saved_keep(saved))
    accs = (0.99, 0.99, 0.05) if high else (0.01, 0.95, 0.96)  # mean +- std above 100 % / below 0 %
    a, b = _grids()
    a = _bimodal(a, "bn", "lr", 0.1, accs)
    b = _bimodal(b, "bn", "batch_size", 2, accs)
    for draw, args, x in (
        (plots.lr_plot, (a, tmp_path / "a.png"), 0.1),
        (plots.batch_plot, (b, tmp_path / "b.png"), 2),
        (grid_plots.metric_lr_plot, (a, tmp_path / "g.png"), 0.1),
        (grid_plots.metric_batch_plot, (b, tmp_path / "h.png"), 2),
    ):
        draw(*args)
        bars = _bars(saved[-1])
        assert bars and all(0 <= lo <= hi <= 100 for _, lo, hi in bars), (draw.__name__, bars)
        spans = {(round(lo, 6), round(hi, 6)) for bx, lo, hi in bars if abs(bx / x - 1) < 0.2}
        assert (round(100 * min(accs), 6), round(100 * max(accs), 6)) in spans, (draw.__name__, spans)
        text = " ".join(_legend(saved[-1]) + [t.get_text() for t in saved[-1].texts])
        assert "lowest to highest seed" in text and "std" not in text  # the figure says what a bar is


def test_twins_are_drawn_against_the_optimizer_steps_taken(saved, tmp_path):
    demo, out = _twin_demo(tmp_path)
    pairs = [p for p in twin_pairs(demo, demo["evidence"]) if p["guarded"]["rescues"]]
    plot_twins(pairs, out, tmp_path / "t.png")
    ax = saved[-1].axes[0]
    (rescue,) = pairs[0]["guarded"]["rescues"]
    plain, guarded = ax.lines[0], ax.lines[1]
    gx = [x for x in guarded.get_xdata() if x == x]
    assert list(plain.get_xdata()) == list(range(1, len(plain.get_xdata()) + 1))  # unguarded: every step kept
    assert max(gx) == len(gx) + rescue["steps_lost"]  # the guarded run took its lost steps too, on the same batches
    assert min(gx) == rescue["step"] + 1  # restored to step 0: the guarded run goes on from the next batch
    vertical = {(ln.get_color(), ln.get_xdata()[0]) for ln in ax.lines[2:] if len(set(ln.get_xdata())) == 1}
    assert ("r", rescue["step"]) in vertical and ("tab:green", rescue["restored_step"]) in vertical
    assert "optimizer step" in ax.get_xlabel()
    from matplotlib.colors import to_hex

    assert to_hex(guarded.get_color()) == to_hex(norm_color(pairs[0]["name"]))  # the norm's colour, as elsewhere


def test_a_second_rescue_is_marked_at_its_optimizer_step_and_named_with_the_guards_step(saved, tmp_path):
    demo, out = _twin_demo(tmp_path)
    pairs = [p for p in twin_pairs(demo, demo["evidence"]) if p["guarded"]["rescues"]]
    second = {**pairs[0]["guarded"]["rescues"][0], "step": 20, "restored_step": 0, "steps_lost": 20}
    pairs[0]["guarded"]["rescues"] = [*pairs[0]["guarded"]["rescues"], second]  # 31 steps, then 20 more, lost
    plot_twins(pairs, out, tmp_path / "t.png")
    ax = saved[-1].axes[0]
    vertical = {(ln.get_color(), ln.get_xdata()[0]) for ln in ax.lines[2:] if len(set(ln.get_xdata())) == 1}
    assert ("r", 31 + 20) in vertical  # the guard's step 20 came after the 31 steps the first rollback threw away
    assert "trouble at step 51 (its step 20 after the rollbacks before)" in " ".join(t.get_text() for t in ax.texts)


@pytest.mark.parametrize(
    ("kept", "rescues", "xs", "marks"),
    [
        (3, [], [1, 2, 3], []),
        (5, [{"step": 4, "restored_step": 2}], [1, 2, 5, 6, 7], [(4, 2)]),
        # a second rescue on the trajectory after the first: its steps are counted from the taken steps
        (4, [{"step": 3, "restored_step": 1}, {"step": 3, "restored_step": 2}], [1, 4, 6, 7], [(3, 1), (5, 4)]),
        (2, [{"step": 2, "restored_step": 0}], [3, 4], [(2, 0)]),
    ],
)
def test_step_axis_places_kept_steps_and_rescues_on_the_steps_taken(kept, rescues, xs, marks):
    assert step_axis(kept, rescues) == (xs, marks)


def test_seed_bars_of_equal_seeds_are_drawn_although_their_mean_rounds_past_them(saved, monkeypatch, tmp_path):
    """Three seeds at 99.03 % have a mean of 99.03000000000002 %: the bar's upper length would be negative and
    matplotlib refuses the figure (the full reproduction's report crashed on it). Every figure with seed bars draws."""
    assert sum([99.03] * 3) / 3 > 99.03  # the rounding this test is about
    assert grid_plots.seed_range_bar(sum([99.03] * 3) / 3, [99.03] * 3) == (pytest.approx(0.0), 0.0)
    assert grid_plots.seed_range_bar(50.0, [40.0, 70.0]) == (10.0, 20.0)
    assert grid_plots.seed_range_bar(50.0, []) == (0.0, 0.0)
    monkeypatch.setattr(grid_plots, "atomic_savefig", saved_keep(saved))
    a, b = _grids()
    for section in (a, b):
        for c in section["cells"]:
            c["final_test_acc"] = 0.9903
        for g in section["groups"]:
            g["final_mean"] = sum([0.9903] * 3) / 3
    plots.lr_plot(a, tmp_path / "a.png")
    plots.batch_plot(b, tmp_path / "b.png")
    grid_plots.metric_lr_plot(a, tmp_path / "g.png")
    grid_plots.metric_batch_plot(b, tmp_path / "h.png")
    assert len(saved) == 4


SLIDE_PX = 1280  # a figure shown across a slide 1280 pixels wide


def _slide_readable(fig, min_px: float = 9.0) -> None:
    """Every text at least ``min_px`` pixels tall once the figure is scaled to a slide's width, and no strip: a
    figure at least a fifth as tall as it is wide."""
    px = SLIDE_PX / fig.get_figwidth() / 72  # pixels per point on the slide
    small = {t.get_text()[:30]: round(t.get_fontsize() * px, 1) for t in _texts(fig) if t.get_fontsize() * px < min_px}
    assert not small, small
    assert fig.get_figheight() >= 0.2 * fig.get_figwidth(), fig.get_size_inches()


def test_the_collapse_figure_of_one_run_reads_on_a_slide(saved, tmp_path):
    """One run's row was a 1680 x 288 strip (21 x 3.6 inches, 9-point notes: 7.6 pixels on the slide)."""
    demo, out = _twin_demo(tmp_path)
    diagnosis.plot_diagnosis([("none seed 0", out / "collapse/runs/none_s0")], tmp_path / "c.png")
    _slide_readable(saved[-1])


def test_the_update_ratio_is_drawn_on_a_log_axis_where_it_spans_decades(saved, tmp_path):
    from normlab.monitor import write_monitor_log

    demo, out = _twin_demo(tmp_path)
    runs = [("none seed 0", out / "collapse/runs/none_s0"), ("none seed 1", out / "collapse/runs/none_s1")]
    diagnosis.plot_diagnosis(runs, tmp_path / "c.png")  # ratios near 1: a linear axis shows them
    assert [ax.get_yscale() for ax in saved[-1].axes[1:10:5]] == ["linear", "linear"]
    records = _records(40)
    for r in records:  # the collapse: the ratio climbs by three decades over its last steps
        r["update_ratio_mean"] = 1.01 if r["step"] < 30 else 1.01 * 10 ** (r["step"] - 29) / 10
    write_monitor_log(runs[0][1] / "monitor.jsonl", records, ALARM)
    diagnosis.plot_diagnosis(runs, tmp_path / "c.png")
    column = saved[-1].axes[1:10:5]  # Fig. 1(a) of both rows: one log scale, the healthy row's too
    assert [ax.get_yscale() for ax in column] == ["log", "log"] and column[0].get_ylim() == column[1].get_ylim()
