"""Collapse study: which monitor signals warn before a collapse on MNIST-1D ``plain1d``
(lab/docs/monitor_calibration.md).

    python lab/scripts/collapse_study.py collect  [--out runs/collapse_study] [--seeds 100-109] [--workers 2]
                                                  [--widths 0.5]
    python lab/scripts/collapse_study.py analyze  [--out runs/collapse_study]
    python lab/scripts/collapse_study.py evaluate [--out runs/collapse_study] [--widths 0.5]
    python lab/scripts/collapse_study.py guard    [--out runs/collapse_study] [--seeds 100-103]
                                                  [--variant immediate|chance]
    python lab/scripts/collapse_study.py round3   [--out runs/study3_cal]
    python lab/scripts/collapse_study.py round4   [--out runs/study3_cal] [--also runs/study3_report]
    python lab/scripts/collapse_study.py suggest  [--out runs/collapse_study] [--seeds 100-101] [--lrs 0.1,0.2]

``collect`` trains every run of the protocol (norm x width x lr x seed) through the lab's loop
(:func:`normlab_lab.steps.train_steps`) and writes one JSONL per run (first line: the run's header with the layer
list; then one line per step with the loss, the gradient norm and per layer output_var, shift_term, variance_term,
input_sq). A finished run is not rerun. ``analyze`` fits every candidate rule's threshold on one half of the
seeds (seed parity) and reports it on the other, then swaps.
``evaluate`` fits nothing: it scores the rules the library ships, with their default thresholds, on every complete
seed (the held-out width 1.0: lab/docs/monitor_calibration.md), replaying the detector classes on the records.
``guard`` trains runs again under :class:`normlab.monitor.CollapseGuard` (today's: the failure taxonomy, with the
study's snapshots, :data:`GUARD_SNAPSHOTS`, and rescue options, :data:`GUARD_RESCUE`). ``round3`` and ``round4``
choose the guard's settings of their time by replaying that guard (its loss climb) on unguarded runs
(:func:`guard_replay`): they reproduce the record, not today's guard.
``suggest`` trains the plain (norm none) runs with the monitor's defaults and, where the regime warning suggested a
learning rate (the regime warning's ``details["suggested_lr"]``), the same run restarted at that rate.

Seeds 0-99 are never used (kept for independent checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from normlab.monitor import (
    CollapseCriteria,
    CollapseGuard,
    RescueOptions,
    RunCollapsed,
    SnapshotOptions,
    VarianceMonitor,
)
from normlab.monitor.collapse import CollapseTracker, label_collapse
from normlab.monitor.rules import DEFAULT_RULES, CountdownRule, FactorRule, StepContext, context_from_records
from normlab.monitor.rules import replay as replay_rules
from normlab.runner.data.datasets import get_dataset
from normlab.runner.models import build_model
from normlab_lab.steps import train_steps

NORMS = {"none": ("none", "conv"), "bn": ("bn", "conv"), "pws": ("none", "pws")}
LRS = (0.05, 0.1, 0.2)
WIDTHS = (0.5,)  # 1.0 did not fit the compute budget (lab/docs/monitor_calibration.md)
CONTROL_LR = 0.01  # healthy controls: BN at lr 0.01
STEPS = 300
BATCH = 128
NUM_SAMPLES = 8000
LEAD = 5  # a warning counts when it comes >= LEAD steps before the collapse
WARNABLE = 7  # collapses at step <= WARNABLE cannot be warned LEAD steps ahead
FIRST_SEED = 100
# the runs' labels: the failure taxonomy against chance (10 classes)
CRITERIA = CollapseCriteria(chance_loss=math.log(10))


# ---------------------------------------------------------------------------------------------- collection
def configs(seeds, widths=WIDTHS, norms=tuple(NORMS)):
    """The protocol's runs per seed: ``norms`` x ``widths`` x LRS, plus the BN controls at CONTROL_LR when "bn" is
    among ``norms``."""
    out = []
    for seed in seeds:
        for norm in norms:
            for width in widths:
                for lr in LRS:
                    out.append(dict(norm=norm, width=width, lr=lr, seed=seed))
        if "bn" in norms:
            for width in widths:
                out.append(dict(norm="bn", width=width, lr=CONTROL_LR, seed=seed))
    return out


def run_name(cfg) -> str:
    return f"{cfg['norm']}_w{cfg['width']}_lr{cfg['lr']}_s{cfg['seed']}"


def _data():
    train, test, _ = get_dataset("mnist1d", num_samples=NUM_SAMPLES)
    return train.x.float(), train.y, test.x.float(), test.y


def _build(cfg):
    norm, conv = NORMS[cfg["norm"]]
    return build_model("plain1d", norm, conv, 1, 10, (1, 40), cfg["width"])


def _grad_norm(model) -> float:
    gs = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(gs).norm()) if gs else 0.0


LAYER_KEYS = ("output_var", "shift_term", "variance_term", "input_sq", "shift", "shift_scale_free")


def _layer_line(records) -> dict:
    """Per layer the values of LAYER_KEYS (non-finite and absent as None); the last two (the kernel's shift and
    scale-free shift) are what the shipped detectors read besides the first four (``evaluate``)."""
    out = {}
    for r in records:
        d = {k: r.get(k) for k in LAYER_KEYS}
        out[r["layer"]] = [None if (v is None or not math.isfinite(v)) else v for v in d.values()]
    return out


def _accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def _evaluable(model, kind, guard) -> bool:
    """Test accuracy is measured for a run that did not end non-finite; a guarded run is judged by its final model
    (a NaN it rolled back is in its loss history, not in its weights)."""
    if guard is None:
        return kind != "non_finite"
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def rules():
    """The rules the study's monitor ships with (a fresh set per call): the library's defaults. The live monitor and
    :func:`replay` both read this, so a test that patches it changes both."""
    return DEFAULT_RULES()


def _old_detector():
    """The monitor's alarm before the countdown: the factor rule with its defaults, only the output layer exempt."""
    return FactorRule()


def _old_check(old, step, records):
    """The old alarm's event at ``step``: the factor rule told only which layer is the output layer."""
    ctx = context_from_records(step, records)
    return old.check(StepContext(step=step, output_layer=ctx.output_layer), records)


def _regime_dict(event) -> dict | None:
    """The regime rule's warning as a dict: step, layer and its details (shift_term, variance_term, ratio, case,
    suggestion, suggested_lr), or None."""
    return None if event is None else {"step": event.step, "layer": event.layer, **event.details}


def _batches(x, y, seed: int):
    """The study's batches: ``BATCH`` samples drawn with replacement by a generator seeded with the run's seed."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=gen)
        yield x[idx], y[idx]


def train_run(cfg, steps=None, guard_kwargs=None):
    """Train one run; returns (header, step lines, summary). The monitor has the shipped defaults (factor rules,
    countdown alarm, regime warning): ``summary["alarm"]`` and ``summary["risk"]`` are what it raised (they do not
    change the run). ``guard_kwargs``: train under a CollapseGuard (its keyword arguments); else the old alarm
    (:func:`_old_detector`) is replayed on the records."""
    steps = STEPS if steps is None else steps
    torch.manual_seed(cfg["seed"])
    x, y, xt, yt = _data()
    model = _build(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    study = guard_kwargs is None
    mon = VarianceMonitor(model, every=1, rules=rules(), optimizer=opt)
    old, old_alarm = _old_detector(), None
    guard = None if guard_kwargs is None else CollapseGuard(model, opt, mon, **guard_kwargs)
    tracker = CollapseTracker(CRITERIA)
    lines, gave_up = [], None
    kept = []  # guard: the losses of the trajectory the model is on (a rolled-back episode's losses are dropped)

    def step(t, loss):
        gnorm = _grad_norm(model)
        n_rec = len(mon.records)
        lv = float(loss.detach())
        if guard is not None:
            guard.observe_loss(lv)
        opt.step()  # the monitor records it; the guard checks it (and may roll the run back)
        return gnorm, n_rec, lv, guard is None or not guard.rolled_back

    def after(t, loss, result):
        nonlocal kept, old_alarm
        gnorm, n_rec, lv, took = result
        if guard is not None:
            kept = kept + [lv if math.isfinite(lv) else None] if took else kept[: guard.steps]
        if study and old_alarm is None and len(mon.records) > n_rec:
            hit = _old_check(old, t, mon.records[n_rec:])
            old_alarm = None if hit is None else {"step": hit.step, "layer": hit.layer}
        tracker.update(lv if math.isfinite(lv) else None)
        lines.append(
            {
                "t": t,
                "loss": lv if math.isfinite(lv) else None,
                "gnorm": gnorm if math.isfinite(gnorm) else None,
                "L": _layer_line(mon.records[n_rec:]),
            }
        )
        del mon.records[:]
        return not (guard is None and tracker.kind == "non_finite")

    try:
        train_steps(model, opt, _batches(x, y, cfg["seed"]), steps, step, loss_fn=nn.CrossEntropyLoss(), after=after)
    except RunCollapsed as e:
        gave_up = str(e)
    tracker.finish()
    kind = tracker.kind
    layers = [[n, k] for n, _, k in mon.layers]
    forward = mon.state_dict()["order"]  # each layer's place in the forward pass
    order = sorted(forward, key=forward.get)
    header = {"cfg": cfg, "layers": layers, "order": order}
    summary = {
        "kind": kind,
        "collapse_step": tracker.step,
        "steps": len(lines),
        "test_acc": _accuracy(model, xt, yt) if _evaluable(model, kind, guard) else None,
        "alarm": None if mon.alarm is None else {"step": mon.alarm.step, "layer": mon.alarm.layer},
        "old_alarm": old_alarm,
        "risk": _regime_dict(next((e for e in mon.events if e.rule == "regime"), None)),
    }
    if guard is not None:
        summary["rescues"] = [r.to_dict() for r in guard.rescues]
        summary["dismissed"] = [d.to_dict() for d in guard.dismissed]
        summary["gave_up"] = gave_up
        summary["kept_losses"] = kept
        summary["kept_kind"] = label_collapse(kept, CRITERIA).kind
        guard.close()
    mon.close()
    return header, lines, summary


def _collect_one(args):
    cfg, out_dir = args
    torch.set_num_threads(1)
    path = Path(out_dir) / f"{run_name(cfg)}.jsonl"
    if path.is_file():
        with open(path) as f:
            if "old_alarm" in json.loads(f.readline())["summary"]:
                return run_name(cfg), "done before", 0.0
    t0 = time.time()
    header, lines, summary = train_run(cfg)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({**header, "summary": summary}) + "\n")
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, path)
    return run_name(cfg), summary["kind"], time.time() - t0


def parse_seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    if min(seeds) < FIRST_SEED:
        raise SystemExit(f"seeds below {FIRST_SEED} are kept for independent checks, got {text}")
    return seeds


def parse_norms(text: str) -> tuple[str, ...]:
    norms = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in norms if n not in NORMS]
    if not norms or bad:
        raise SystemExit(f"--norms: expected a comma-separated subset of {list(NORMS)}, got {text!r}")
    return norms


def parse_widths(text: str) -> tuple[float, ...]:
    try:
        widths = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise SystemExit(f"--widths: expected comma-separated numbers such as 0.5,1.0, got {text!r}") from None
    if not widths or min(widths) <= 0:
        raise SystemExit(f"--widths: expected widths > 0, got {text!r}")
    return widths


def collect(out_dir: Path, seeds, workers: int, widths=WIDTHS, norms=tuple(NORMS)) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _data()  # generate once so that the workers read the same arrays
    jobs = [(cfg, str(out_dir)) for cfg in configs(seeds, widths, norms)]
    with ProcessPoolExecutor(workers) as ex:
        for name, kind, dt in ex.map(_collect_one, jobs):
            print(f"{name}: {kind} ({dt:.0f} s)", flush=True)


# ---------------------------------------------------------------------------------------------- loading
def load_runs(out_dir: Path) -> list[dict]:
    runs = []
    for path in sorted(out_dir.glob("*.jsonl")):
        with open(path) as f:
            head = json.loads(f.readline())
            head["steps"] = [json.loads(line) for line in f]
        runs.append(head)
    return runs


# ---------------------------------------------------------------------------------------------- analysis
GROWTH_GRID = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
LEVEL_GRID = (3, 5, 10, 15, 30, 100, 300, 1000)
GNORM_GRID = (2, 3, 5, 10, 20, 50, 100)
WINDOW_GRID = (1, 2, 3, 5, 10, 20)
PWS_GRID = (3, 10, 30, 100)
INF = math.inf


def _collapse_step(run) -> int | None:
    """The run's collapse step; a run that never left chance (no step of its own) is dated to the first step after
    the last window whose mean loss was below the taxonomy's at-chance level (where it stays at chance)."""
    s = run["summary"]
    if s["kind"] is None:
        return None
    if s["collapse_step"] is not None:
        return s["collapse_step"]
    losses, w = [x["loss"] for x in run["steps"]], CRITERIA.window
    thr, start = CRITERIA.at_chance * CRITERIA.chance_loss, 0
    for t in range(w - 1, len(losses)):
        if statistics.fmean(losses[t - w + 1 : t + 1]) < thr:
            start = t - w + 2
    return start


def _first(series, thr, start=0) -> float:
    for t in range(start, len(series)):
        if series[t] > thr:
            return t
    return INF


def prepare(run) -> dict:
    """Per-step signal series of one run (the rules read only these)."""
    kinds = dict(run["layers"])
    convs = [n for n in run["order"] if kinds[n] != "norm"]
    hidden = convs[:-1]
    nxt = {n: run["order"][i + 1] for i, n in enumerate(run["order"][:-1])}
    exempt = {n for n in hidden if kinds.get(nxt.get(n)) == "norm"}
    steps = run["steps"]
    v0 = {n: steps[0]["L"][n][0] for n in hidden}
    vt0 = {n: steps[0]["L"][n][2] for n in hidden}
    nonfin, growth, level, gratio, shift_in, pws_ratio, ratios = [], [], [], [], [], [], []
    growth_x, level_x = [], []  # exploratory: only the layers not renormalized downstream
    for t, x in enumerate(steps):
        vs = [x["L"].get(n, [None] * 4) for n in hidden]
        bad = x["loss"] is None or x["gnorm"] is None or any(v[0] is None for v in vs)
        nonfin.append(bad)
        if bad:
            growth.append(INF), level.append(INF), gratio.append(INF), growth_x.append(INF), level_x.append(INF)
            shift_in.append(set(hidden)), pws_ratio.append({n: INF for n in hidden})
            ratios.append({})  # RegimeRule: a non-finite term is not in the regime (its streak ends)
            continue
        prev = steps[t - 2]["L"] if t >= 2 else None
        rates = {n: -INF for n in hidden}
        if prev is not None:
            for n, v in zip(hidden, vs):
                p = prev[n][0]
                rates[n] = INF if not p or p <= 0 or v[0] <= 0 else (math.log(v[0]) - math.log(p)) / 2
        levels = {n: v[0] / v0[n] if v0[n] else INF for n, v in zip(hidden, vs)}
        growth.append(max(rates.values()))
        level.append(max(levels.values()))
        growth_x.append(max([rates[n] for n in hidden if n not in exempt], default=-INF))
        level_x.append(max([levels[n] for n in hidden if n not in exempt], default=-INF))
        past = [s["gnorm"] for s in steps[:t]]
        gratio.append(x["gnorm"] / statistics.median(past) if t >= 5 and statistics.median(past) > 0 else -INF)
        shift_in.append({n for n, v in zip(hidden, vs) if n not in exempt and v[1] is not None and v[1] > v[2]})
        ratios.append({n: v[1] / v[2] for n, v in zip(hidden, vs) if n not in exempt and v[1] is not None and v[2]})
        pws_ratio.append({n: v[2] / vt0[n] if vt0[n] else 0.0 for n, v in zip(hidden, vs) if n not in exempt})
    first_nf = next((t for t, b in enumerate(nonfin) if b), INF)
    standardized = all(abs(steps[0]["L"][n][1] or 0.0) < 1e-12 for n in hidden[1:])
    return dict(
        cfg=run["cfg"],
        kind=run["summary"]["kind"],
        cstep=_collapse_step(run),
        nonfin=first_nf,
        growth=growth,
        level=level,
        gratio=gratio,
        growth_x=growth_x,
        level_x=level_x,
        shift_in=shift_in,
        pws_ratio=pws_ratio,
        ratios=ratios,
        losses=[x["loss"] for x in steps],
        gnorms=[x["gnorm"] for x in steps],
        alarm=_step_or_inf((run["summary"]["alarm"] or {}).get("step")),
        standardized=standardized,
        old=(run["summary"]["old_alarm"] or {}).get("step", INF),
    )


def regime_step(r, w, p) -> float:
    """First step at which some non-exempt hidden layer was in the shift regime (or, PWS case, had its variance
    term above p x its step-0 value) for w consecutive steps."""
    run_len: dict[str, int] = {}
    for t, (inside, ratios) in enumerate(zip(r["shift_in"], r["pws_ratio"])):
        hot = set(inside) | {n for n, q in ratios.items() if r["standardized"] and q > p}
        run_len = {n: run_len.get(n, 0) + 1 for n in hot}
        if any(c >= w for c in run_len.values()):
            return t
    return INF


def countdown_step(r, rule, th, regime=None) -> float:
    if rule == "nonfinite":
        return r["nonfin"]
    if rule == "old":
        return min(r["old"], r["nonfin"])
    if rule == "growth":
        return min(_first(r["growth"], th), r["nonfin"])
    if rule == "level":
        return min(_first(r["level"], th), r["nonfin"])
    if rule == "gnorm":
        return min(_first(r["gratio"], th), r["nonfin"])
    a, b = th
    start = regime if rule == "armed" else 0
    if start == INF:
        return r["nonfin"]
    g, lv = ("growth_x", "level_x") if rule in (EXEMPT_RULE, LIBRARY_RULE) else ("growth", "level")
    level = _first(r[lv], b, start) if rule != LIBRARY_RULE or not r["standardized"] else INF
    return min(_first(r[g], a, start), level, r["nonfin"])


def score_countdown(runs, fire) -> dict:
    warnable = [r for r in runs if r["kind"] is not None and r["cstep"] > WARNABLE]
    healthy = [r for r in runs if r["kind"] is None]
    leads = [r["cstep"] - fire(r) for r in warnable if fire(r) < INF]
    return dict(
        warned=sum(lead >= LEAD for lead in leads),
        warnable=len(warnable),
        median_lead=statistics.median(leads) if leads else None,
        false=sum(fire(r) < INF for r in healthy),
        healthy=len(healthy),
    )


EXEMPT_RULE = "growth|level, not renormalized [exploratory]"
LIBRARY_RULE = "growth|level, not renormalized, no level on standardized kernels [exploratory]"
PAIRS = [(a, b) for a in GROWTH_GRID for b in LEVEL_GRID]
COUNTDOWN_GRIDS = {
    "growth": GROWTH_GRID,
    "level": LEVEL_GRID,
    "gnorm": GNORM_GRID,
    "growth|level": PAIRS,
    EXEMPT_RULE: PAIRS,
    LIBRARY_RULE: PAIRS,
    "nonfinite": [None],
    "old": [None],
}


def _conservative_key(th):
    return th if isinstance(th, tuple) else (th if th is not None else 0,)


def firing(rule, th, regime_of=None):
    """The alarm step of ``rule`` at threshold ``th`` as a function of a prepared run."""
    return lambda r: countdown_step(r, rule, th, regime_of(r) if regime_of else None)


def choose_countdown(runs, rule, regime_of=None) -> object:
    grid = COUNTDOWN_GRIDS["growth|level" if rule == "armed" else rule]
    best, best_key = None, None
    for th in grid:
        s = score_countdown(runs, firing(rule, th, regime_of))
        if s["false"] > 0.1 * s["healthy"]:
            continue
        key = (s["warned"], _conservative_key(th))
        if best_key is None or key > best_key:
            best, best_key = th, key
    return best


def score_regime(runs, w, p) -> dict:
    return score_regime_steps(runs, lambda r: regime_step(r, w, p))


def score_regime_steps(runs, step_of) -> dict:
    """The regime warning's counts over prepared runs; ``step_of(run)``: its warning step (INF: none)."""
    plain = [r for r in runs if r["cfg"]["norm"] == "none"]
    coll = [r for r in plain if r["kind"] is not None]
    leads = [r["cstep"] - step_of(r) for r in coll if step_of(r) < INF]
    pws = [r for r in runs if r["cfg"]["norm"] == "pws"]
    pws_coll = [r for r in pws if r["kind"] is not None]
    return dict(
        recall=sum(step_of(r) <= r["cstep"] for r in coll),
        collapsing=len(coll),
        median_lead=statistics.median(leads) if leads else None,
        healthy_plain_flagged=sum(step_of(r) < INF for r in plain if r["kind"] is None),
        healthy_plain=sum(r["kind"] is None for r in plain),
        bn_healthy_flagged=sum(step_of(r) < INF for r in runs if r["cfg"]["norm"] == "bn" and r["kind"] is None),
        bn_healthy=sum(r["cfg"]["norm"] == "bn" and r["kind"] is None for r in runs),
        pws_recall=sum(step_of(r) <= r["cstep"] for r in pws_coll),
        pws_collapsing=len(pws_coll),
        pws_healthy_flagged=sum(step_of(r) < INF for r in pws if r["kind"] is None),
        pws_healthy=sum(r["kind"] is None for r in pws),
    )


def choose_regime(runs) -> tuple[int, float]:
    best, best_key = None, None
    for w in WINDOW_GRID:
        for p in PWS_GRID:
            s = score_regime(runs, w, p)
            if s["healthy_plain_flagged"] > 0.2 * s["healthy_plain"] or s["bn_healthy_flagged"] > 0:
                continue
            key = (s["recall"] + s["pws_recall"], w, p)
            if best_key is None or key > best_key:
                best, best_key = (w, p), key
    return best or (max(WINDOW_GRID), max(PWS_GRID))


def _fmt(s) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items())


def complete_seeds(raw_runs, widths=WIDTHS) -> list:
    """The runs of the seeds whose every configuration (at ``widths``, of the norms collected: a ``--norms``
    collection has no BN runs) is there (a stopped collection leaves a partial seed); runs at other widths are left
    out."""
    have = {run_name(r["cfg"]) for r in raw_runs}
    seeds = {r["cfg"]["seed"] for r in raw_runs}
    norms = tuple(n for n in NORMS if any(r["cfg"]["norm"] == n for r in raw_runs))  # a --norms collection
    full = {s for s in seeds if all(run_name(c) in have for c in configs([s], widths, norms))}
    wanted = {run_name(c) for c in configs(sorted(full), widths, norms)}
    return [r for r in raw_runs if run_name(r["cfg"]) in wanted]


def analyze(raw_runs) -> str:
    runs = [prepare(r) for r in complete_seeds(raw_runs)]
    out = [
        f"{len(runs)} runs; "
        + ", ".join(f"{k}: {sum(str(r['kind']) == k for r in runs)}" for k in sorted({str(r["kind"]) for r in runs}))
    ]
    for cal_parity, name in (
        (0, "calibrate A (even seeds) -> report B (odd)"),
        (1, "calibrate B (odd seeds) -> report A (even)"),
    ):
        cal = [r for r in runs if r["cfg"]["seed"] % 2 == cal_parity]
        rep = [r for r in runs if r["cfg"]["seed"] % 2 != cal_parity]
        out.append(f"\n## {name}: {len(cal)} calibration runs, {len(rep)} report runs")
        w, p = choose_regime(cal)
        out.append(f"regime w={w} p={p}: cal {_fmt(score_regime(cal, w, p))}")
        out.append(f"regime w={w} p={p}: REPORT {_fmt(score_regime(rep, w, p))}")
        for rule in (
            "nonfinite",
            "old",
            "growth",
            "level",
            "gnorm",
            "growth|level",
            "armed",
            EXEMPT_RULE,
            LIBRARY_RULE,
        ):
            reg = (lambda r, w=w, p=p: regime_step(r, w, p)) if rule == "armed" else None
            th = choose_countdown(cal, rule, reg)
            if th is None and rule not in ("nonfinite", "old"):
                out.append(f"{rule}: no threshold meets the false-alarm limit on the calibration half")
                continue
            s_cal, s_rep = score_countdown(cal, firing(rule, th, reg)), score_countdown(rep, firing(rule, th, reg))
            out.append(f"{rule} th={th}: cal {_fmt(s_cal)} | REPORT {_fmt(s_rep)}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- round 3
RATIO_GRID = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
CONFIRM_GRID = (None, 10, 25, 50, 100)
CLIMB_GRID = (None, 0.9, 0.75, 0.5)
# The study's guard (``guard``), whose rollbacks round3/round4 also replay: a snapshot every 10 of the 300 steps, the
# last 3 kept, the one restored at least 5 steps before the trouble's onset, every step checked (the study
# reads each loss anyway).
GUARD_SNAPSHOTS = SnapshotOptions(every=10, keep=3)
GUARD_RESCUE = RescueOptions(check_every=1, margin=5)
# The trouble test of the guard of rounds 3-5, replayed by guard_replay so that round3 and round4 reproduce the record:
# its loss trend over 10-step means, "learned" below 0.8 x the reference, the loss climb (``loss_climb``), a dead net
# (``chance_loss``) at 0.95 x chance after 40 steps. That guard has since been replaced by one that reads the failure
# taxonomy (normlab.monitor.collapse: no loss climb); these are its values then, and the replay is checked against its
# recorded rollbacks (lab/tests/test_collapse_study_script.py), not against today's guard.
ROUND3_WINDOW, ROUND3_LEARNED, ROUND3_AT_CHANCE, ROUND3_DEAD_AFTER = 10, 0.8, 0.95, 40


def regime3_step(r, ratio, w) -> float:
    """First step at which some non-exempt hidden layer has had shift_term > ratio x variance_term for w
    consecutive steps (a non-finite step is not in the regime, as in RegimeRule)."""
    streak: dict[str, int] = {}
    for t, per_layer in enumerate(r["ratios"]):
        streak = {n: streak.get(n, 0) + 1 for n, q in per_layer.items() if q > ratio}
        if any(c >= w for c in streak.values()):
            return t
    return INF


def choose_regime3(runs) -> tuple[float, int] | None:
    best, best_key = None, None
    for ratio in RATIO_GRID:
        for w in WINDOW_GRID:
            s = score_regime_steps(runs, lambda r, q=ratio, w=w: regime3_step(r, q, w))
            if s["healthy_plain_flagged"] > 0.2 * s["healthy_plain"]:
                continue
            key = (s["recall"], w, ratio)
            if best_key is None or key > best_key:
                best, best_key = (ratio, w), key
    return best


def _trend(losses, t, state, chance=None) -> float | None:
    """The loss trend of the guard of rounds 3-5 at step t, replayed: updates ``state`` (first and best window means,
    learned) and returns the mean of the last ROUND3_WINDOW losses (None before that many)."""
    w = ROUND3_WINDOW
    if t + 1 < w:
        return None
    mean = statistics.fmean(losses[t - w + 1 : t + 1])
    state["first"] = mean if state.get("first") is None else state["first"]
    state["best"] = mean if state.get("best") is None else min(state["best"], mean)
    state["ref"] = state["first"] if chance is None else chance
    state["learned"] = state["best"] < ROUND3_LEARNED * state["ref"]
    return mean


def _climbed(mean, fraction, state) -> bool:
    if mean is None or fraction is None or not state["learned"]:
        return False
    return mean >= state["best"] + fraction * (state["ref"] - state["best"])


def guard_replay(r, confirm, climb, chance=None) -> tuple[int, int] | None:
    """(trouble step, restored snapshot step) of the first rollback the guard of rounds 3-5 (``CollapseGuard(every=10,
    keep=3, margin=5, confirm, loss_climb=climb, chance_loss=chance)`` as it was then) would make on an unguarded run,
    or None. Snapshots: every GUARD_SNAPSHOTS.every steps from step 0 (the last GUARD_SNAPSHOTS.keep kept), plus the
    one pinned by a waiting alarm."""

    def choose(onset, t):
        kept = [s for s in range(0, t + 1, GUARD_SNAPSHOTS.every)][-GUARD_SNAPSHOTS.keep :]
        snaps = sorted(set(kept) | ({pinned} if pinned is not None else set()))
        before = [s for s in snaps if s <= onset - GUARD_RESCUE.margin]
        return before[-1] if before else snaps[0]

    losses, gnorms, alarm = r["losses"], r["gnorms"], r["alarm"]
    state, pinned, armed = {}, None, None
    for t in range(len(losses)):
        onset = None
        mean = None if losses[t] is None or gnorms[t] is None else _trend(losses, t, state, chance)
        if losses[t] is None or gnorms[t] is None:
            onset = t
        elif _climbed(mean, climb, state):
            onset = t - ROUND3_WINDOW + 1
        elif armed is not None and chance is not None and t + 1 >= ROUND3_DEAD_AFTER and not state["learned"]:
            onset = t if mean >= ROUND3_AT_CHANCE * chance else None  # a dead net, as that guard judged it
        if onset is not None:
            if armed is not None:
                onset = min(onset, armed)
            return t, choose(onset, t)
        # the step is taken; then the alarm (raised on step t's records) is seen
        if t == alarm:
            if confirm is None:
                return t, choose(alarm, t)
            armed, pinned = alarm, choose(alarm, t)
        waiting_to_learn = chance is not None and not state.get("learned", False)
        if armed is not None and t + 1 - (armed + 1) >= confirm and not waiting_to_learn:
            armed, pinned = None, None
    return None


def score_guard_replay(runs, confirm, climb, chance=None) -> dict:
    coll = [r for r in runs if r["kind"] is not None]
    healthy = [r for r in runs if r["kind"] is None]
    hits = {run_name(r["cfg"]): guard_replay(r, confirm, climb, chance) for r in runs}
    timely = [r for r in coll if hits[run_name(r["cfg"])] and hits[run_name(r["cfg"])][1] <= (r["cstep"] or 0) - LEAD]
    return dict(
        timely=len(timely),
        rolled_back=sum(hits[run_name(r["cfg"])] is not None for r in coll),
        collapsing=len(coll),
        healthy_rolled_back=sum(hits[run_name(r["cfg"])] is not None for r in healthy),
        healthy=len(healthy),
    )


def choose_guard(runs):
    best, best_key = None, None
    for i, confirm in enumerate(CONFIRM_GRID):
        for j, climb in enumerate(CLIMB_GRID):
            s = score_guard_replay(runs, confirm, climb)
            if s["healthy_rolled_back"] > 0:
                continue
            key = (s["timely"], -i, -j)
            if best_key is None or key > best_key:
                best, best_key = (confirm, climb), key
    return best


def round3(raw_runs) -> str:
    """Round 3's choices on the calibration runs (lab/docs/monitor_calibration.md): the regime rule (ratio,
    window) and the guard's (confirm, loss_climb), with the score of every candidate."""
    runs = [prepare(r) for r in raw_runs]
    out = [f"{len(runs)} calibration runs, seeds {sorted({r['cfg']['seed'] for r in runs})}"]
    out += _outcomes([{**r, "test_acc": None} for r in runs])
    for ratio in RATIO_GRID:
        for w in WINDOW_GRID:
            s = score_regime_steps(runs, lambda r, q=ratio, w=w: regime3_step(r, q, w))
            out.append(f"regime ratio={ratio} w={w}: {_fmt(s)}")
    out.append(f"CHOSEN regime (ratio, window): {choose_regime3(runs)}")
    for confirm in CONFIRM_GRID:
        for climb in CLIMB_GRID:
            out.append(f"guard confirm={confirm} loss_climb={climb}: {_fmt(score_guard_replay(runs, confirm, climb))}")
    out.append(f"CHOSEN guard (confirm, loss_climb): {choose_guard(runs)}")
    return "\n".join(out)


def round4(raw_runs) -> str:
    """Round 4's choice (lab/docs/monitor_calibration.md): the round-3 guard with and without
    ``chance_loss = ln 10`` (the loss climb measured towards chance, and a waiting alarm confirmed by a dead network),
    on the calibration runs."""
    runs = [prepare(r) for r in raw_runs if r["cfg"]["norm"] != "bn"]
    out = [f"{len(runs)} calibration runs (none/pws), seeds {sorted({r['cfg']['seed'] for r in runs})}"]
    scores = {}
    for chance in (None, math.log(10)):
        scores[chance] = score_guard_replay(runs, 10, 0.75, chance)
        out.append(f"guard confirm=10 loss_climb=0.75 chance_loss={chance}: {_fmt(scores[chance])}")
    new, old = scores[math.log(10)], scores[None]
    adopt = new["healthy_rolled_back"] == 0 and new["timely"] >= old["timely"]
    out.append(f"CHOSEN chance_loss: {'ln 10 (adopted)' if adopt else 'None (round 3 kept)'}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- evaluation
def replay_records(run, line) -> list[dict]:
    """The monitor records of one collected step, rebuilt from the run's header (layer kinds, forward order) and the
    step's LAYER_KEYS. A stored None is a non-finite value (nan), as in the monitor's own records; a norm layer has
    only output_var and input_sq."""
    kinds, index = dict(run["layers"]), {n: i for i, n in enumerate(run["order"])}
    out = []
    for name, values in line["L"].items():
        if len(values) != len(LAYER_KEYS):
            raise ValueError(
                f"evaluate: run {run_name(run['cfg'])} was collected without {LAYER_KEYS[len(values) :]} per layer; "
                "collect it again with this script"
            )
        rec = {"step": line["t"], "layer": name, "index": index.get(name, len(index)), "kind": kinds[name]}
        keys = LAYER_KEYS if kinds[name] != "norm" else ("output_var", "input_sq")
        rec.update({k: math.nan if values[LAYER_KEYS.index(k)] is None else values[LAYER_KEYS.index(k)] for k in keys})
        out.append(rec)
    return out


def replay(run) -> dict:
    """First step of the shipped alarm (the first alarm of :func:`rules`, as ``VarianceMonitor`` keeps it), of the
    countdown alone and of the regime warning, replayed on the collected records with the library's
    :func:`~normlab.monitor.rules.replay` (None: never)."""
    steps = []
    for line in run["steps"]:
        recs = replay_records(run, line)
        steps.append((context_from_records(line["t"], recs), recs))
    shipped = replay_rules(rules(), steps)
    countdown = [e for e in replay_rules([r for r in rules() if isinstance(r, CountdownRule)], steps) if e.is_alarm]
    alarms = [e.step for e in shipped if e.is_alarm]
    risk = [e.step for e in shipped if e.rule == "regime"]
    return {
        "alarm": min(alarms) if alarms else None,
        "countdown": countdown[0].step if countdown else None,
        "risk": risk[0] if risk else None,
    }


def _step_or_inf(x) -> float:
    return INF if x is None else x


def evaluated(run) -> dict:
    """One run's labels, the live alarm and regime steps of the shipped monitor and their replay."""
    s = run["summary"]
    again = replay(run)
    return dict(
        cfg=run["cfg"],
        kind=s["kind"],
        cstep=_collapse_step(run),
        test_acc=s.get("test_acc"),
        alarm=_step_or_inf((s["alarm"] or {}).get("step")),
        risk=_step_or_inf((s["risk"] or {}).get("step")),
        old=_step_or_inf((s["old_alarm"] or {}).get("step")),
        countdown=_step_or_inf(again["countdown"]),
        replay_alarm=_step_or_inf(again["alarm"]),
        replay_risk=_step_or_inf(again["risk"]),
    )


def _outcomes(runs) -> list[str]:
    """Per norm and learning rate: how many runs ended each way, and their collapse steps."""
    out = []
    for norm, lr in sorted({(r["cfg"]["norm"], r["cfg"]["lr"]) for r in runs}):
        cell = [r for r in runs if (r["cfg"]["norm"], r["cfg"]["lr"]) == (norm, lr)]
        kinds = sorted({str(r["kind"]) for r in cell})
        parts = []
        for k in kinds:
            steps = sorted(r["cstep"] for r in cell if str(r["kind"]) == k and r["cstep"] is not None)
            parts.append(f"{k} {sum(str(r['kind']) == k for r in cell)}" + (f" (steps {steps})" if steps else ""))
        out.append(f"  {norm} lr {lr}: " + ", ".join(parts))
    return out


def _run_line(r) -> str:
    return (
        f"  {run_name(r['cfg'])}: {r['kind']} at {r['cstep']} acc {r['test_acc']} | alarm {r['alarm']} "
        f"countdown {r['countdown']} old {r['old']} regime {r['risk']}"
    )


def evaluate(raw_runs, widths=WIDTHS) -> str:
    """The shipped rules with their default thresholds on every complete seed at ``widths``: nothing is fitted."""
    runs = [evaluated(r) for r in complete_seeds(raw_runs, widths)]
    seeds = sorted({r["cfg"]["seed"] for r in runs})
    kinds = sorted({str(r["kind"]) for r in runs})
    out = [
        f"{len(runs)} runs, seeds {seeds}; "
        + ", ".join(f"{k}: {sum(str(r['kind']) == k for r in runs)}" for k in kinds)
    ]
    off = [run_name(r["cfg"]) for r in runs if (r["alarm"], r["risk"]) != (r["replay_alarm"], r["replay_risk"])]
    out += _outcomes(runs)
    out.append(f"replay of the shipped detectors differs from the live monitor on {len(off)} runs {off}")
    for rule in ("alarm", "countdown", "old"):
        name = {"alarm": "shipped alarm (mon.alarm)", "countdown": "shipped countdown only", "old": "old factor rules"}
        out.append(f"{name[rule]}: {_fmt(score_countdown(runs, lambda r, k=rule: r[k]))}")
    out.append(f"regime warning (regime rule): {_fmt(score_regime_steps(runs, lambda r: r['risk']))}")
    out.append("per run (step of the collapse / alarm / countdown / old / regime; inf: never):")
    out += [_run_line(r) for r in runs]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- guard
GUARD_VARIANTS = {  # guard --variant: CollapseGuard arguments besides the study's GUARD_SNAPSHOTS and GUARD_RESCUE;
    # the result folder
    "defaults": ({}, "guard"),
    "immediate": ({"rescue": replace(GUARD_RESCUE, confirm=None)}, "guard_immediate"),  # an alarm acted on at once
    "chance": ({"criteria": CRITERIA}, "guard_chance"),  # round 4: chance known (--guard-dead), dead nets confirm
}


def guard_kwargs(variant: str) -> dict:
    """The CollapseGuard keyword arguments of a ``guard --variant``."""
    return {"snapshots": GUARD_SNAPSHOTS, "rescue": GUARD_RESCUE, **GUARD_VARIANTS[variant][0]}


def _guard_one(args):
    cfg, out_dir, steps, variant = args
    torch.set_num_threads(1)
    folder = GUARD_VARIANTS[variant][1]
    path = Path(out_dir) / folder / f"{run_name(cfg)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    kwargs = guard_kwargs(variant)
    _, lines, summary = train_run(cfg, steps, guard_kwargs=kwargs)
    summary["losses"] = [x["loss"] for x in lines]
    lr_end = cfg["lr"] * kwargs["rescue"].lr_factor ** len(summary["rescues"])
    if summary["rescues"]:  # the same run started at the reduced learning rate, unguarded
        _, _, twin = train_run({**cfg, "lr": lr_end}, steps)
        summary["twin"] = {"lr": lr_end, "kind": twin["kind"], "test_acc": twin["test_acc"]}
    out = {"cfg": cfg, **summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def guard_study(
    out_dir: Path, steps: int, parity: int = 0, workers: int = 2, widths=WIDTHS, seeds=None, variant="defaults"
) -> str:
    """Train the collapsing runs (norm none/pws) and the healthy runs of the half with seed parity ``parity`` (or of
    the complete ``seeds``, when given) at ``widths`` under CollapseGuard; report how many end healthy and whether a
    healthy run was changed. Seed by seed; a finished guarded run is not rerun."""
    runs = [r for r in load_runs(out_dir) if (r["cfg"]["seed"] in seeds if seeds else r["cfg"]["seed"] % 2 == parity)]
    runs = [r for r in complete_seeds(runs, widths) if r["cfg"]["norm"] != "bn"]  # bn: healthy, exempt
    runs.sort(key=lambda r: (r["cfg"]["seed"], run_name(r["cfg"])))
    jobs = [(r["cfg"], str(out_dir), steps, variant) for r in runs]
    results = []
    with ProcessPoolExecutor(workers) as ex:
        for g in ex.map(_guard_one, jobs):
            results.append(g)
            print(f"guarded {run_name(g['cfg'])}: {g['kind']}", file=sys.stderr, flush=True)
    before = {run_name(r["cfg"]): r["summary"] for r in runs}
    coll = [g for g in results if before[run_name(g["cfg"])]["kind"] is not None]
    healthy = [g for g in results if before[run_name(g["cfg"])]["kind"] is None]
    ok = [g for g in coll if g["kind"] is None and not g.get("gave_up")]
    ok_kept = [g for g in coll if "kept_kind" in g and g["kept_kind"] is None and not g.get("gave_up")]
    same = [g for g in healthy if g["test_acc"] == before[run_name(g["cfg"])]["test_acc"]]
    where = (f"seeds {seeds}" if seeds else f"seed parity {parity}") + f", guard {variant} {GUARD_VARIANTS[variant][0]}"
    lines = [
        f"guarded collapsing runs (none/pws, {where}): {len(ok_kept)} of {len(coll)} end healthy on the kept "
        f"trajectory; {len(ok)} of {len(coll)} over all losses (rolled-back episodes included)",
        f"healthy runs with a rescue: {sum(bool(g['rescues']) for g in healthy)} of {len(healthy)}; final test "
        f"accuracy equal to the unguarded run's: {len(same)} of {len(healthy)}; alarms dismissed on healthy runs: "
        f"{sum(len(g.get('dismissed', [])) for g in healthy)}",
    ]
    for g in results:
        twin = g.get("twin") or {}
        lines.append(
            f"  {run_name(g['cfg'])}: unguarded {before[run_name(g['cfg'])]['kind']} "
            f"acc {before[run_name(g['cfg'])]['test_acc']} -> guarded {g.get('kept_kind', '?')} (all losses "
            f"{g['kind']}) acc {g['test_acc']} rescues {len(g['rescues'])} lost "
            f"{sum(r['steps_lost'] for r in g['rescues'])} dismissed {len(g.get('dismissed', []))} gave_up "
            f"{bool(g.get('gave_up'))} twin(lr {twin.get('lr')}) {twin.get('kind')} acc {twin.get('test_acc')}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- suggest
def _suggest_one(args):
    cfg, out_dir, steps = args
    torch.set_num_threads(1)
    path = Path(out_dir) / "suggest" / f"{run_name(cfg)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    _, _, first = train_run(cfg, steps)
    out = {"cfg": cfg, "kind": first["kind"], "collapse_step": first["collapse_step"], "test_acc": first["test_acc"]}
    out["risk"] = first["risk"]
    new_lr = (first["risk"] or {}).get("suggested_lr")
    if new_lr is not None:  # the same run (seed, data order) restarted at the suggested rate
        _, _, again = train_run({**cfg, "lr": new_lr}, steps)
        out["restart"] = {k: again[k] for k in ("kind", "collapse_step", "test_acc", "risk")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def suggest_study(out_dir: Path, seeds, lrs, steps: int, workers: int = 2) -> str:
    """Plain runs (norm none, width 0.5) under the default monitor: the regime warning's suggested learning rate,
    and whether the run restarted at it trains without a collapse."""
    jobs = [(dict(norm="none", width=0.5, lr=lr, seed=s), str(out_dir), steps) for s in seeds for lr in lrs]
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(_suggest_one, jobs))
    lines = []
    for r in results:
        risk, again = r["risk"] or {}, r.get("restart") or {}
        lines.append(
            f"{run_name(r['cfg'])}: {r['kind']} (step {r['collapse_step']}, acc {r['test_acc']}); regime warning "
            f"step {risk.get('step')} layer {risk.get('layer')} ratio {risk.get('ratio')} suggested_lr "
            f"{risk.get('suggested_lr')} -> restart {again.get('kind', '-')} (step {again.get('collapse_step')}, "
            f"acc {again.get('test_acc')}, its regime warning at step {(again.get('risk') or {}).get('step')})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=["collect", "analyze", "round3", "round4", "evaluate", "guard", "suggest"])
    p.add_argument("--out", type=Path, default=Path("runs/collapse_study"))
    p.add_argument("--seeds", default=None, help="collect: default 100-103; guard: default the even seeds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--widths", default=",".join(str(w) for w in WIDTHS), help="collect/evaluate: comma-separated")
    p.add_argument("--lrs", default="0.1,0.2", help="suggest: the learning rates of the plain runs")
    p.add_argument("--norms", default=",".join(NORMS), help=f"collect: a comma-separated subset of {list(NORMS)}")
    p.add_argument("--variant", default="defaults", choices=list(GUARD_VARIANTS), help="guard: the guard's settings")
    p.add_argument("--also", type=Path, action="append", default=[], help="round4: more folders of collected runs")
    a = p.parse_args(argv)
    if a.command == "collect":
        collect(a.out, parse_seeds(a.seeds or "100-103"), a.workers, parse_widths(a.widths), parse_norms(a.norms))
    elif a.command == "analyze":
        print(analyze(load_runs(a.out)))
    elif a.command == "round3":
        print(round3(load_runs(a.out)))
    elif a.command == "round4":
        print(round4([r for d in [a.out, *a.also] for r in load_runs(d)]))
    elif a.command == "evaluate":
        print(evaluate(load_runs(a.out), parse_widths(a.widths)))
    elif a.command == "guard":
        seeds = parse_seeds(a.seeds) if a.seeds else None
        widths = parse_widths(a.widths)
        print(guard_study(a.out, a.steps, workers=a.workers, widths=widths, seeds=seeds, variant=a.variant))
    elif a.command == "suggest":
        print(suggest_study(a.out, parse_seeds(a.seeds), [float(x) for x in a.lrs.split(",")], a.steps, a.workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
