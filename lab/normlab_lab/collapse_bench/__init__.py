"""Collapse benchmark: does a detector warn before a training run collapses, and how often does it cry wolf?

    normlab-lab collapse-bench all      --out runs/collapse_bench --seeds 300-302 --workers 2  # the three below
    normlab-lab collapse-bench collect  --out runs/collapse_bench --seeds 300-302 --workers 2
    normlab-lab collapse-bench evaluate --out runs/collapse_bench --seeds 300-302 [--json table.json]
    normlab-lab collapse-bench guard    --out runs/collapse_bench --seeds 300-302 --guard-healthy 3

``collect`` (:mod:`~normlab_lab.collapse_bench.collect`) trains every run of the protocol (set-up x learning rate x
seed, :mod:`~normlab_lab.collapse_bench.protocol`; the set-ups are in :mod:`~normlab_lab.collapse_bench.setups`) and
writes one JSONL per run: a header line (set-up, lr, seed, chance loss), then one line per optimizer step with the
training loss, the gradient norm before the step, the learning rates, the monitor's per-layer records of that step
(the monitor records every step, with no rule) and the probes' values (:mod:`normlab.monitor.probes`). A finished run
is not rerun. Nothing reads an alarm during collection.

``evaluate`` (:mod:`~normlab_lab.collapse_bench.evaluate`) labels each run from its losses alone with
:func:`normlab.monitor.collapse.label_collapse` (the library's one collapse definition, fixed before any alarm was
read) and replays every detector over the same recorded runs (:func:`normlab.monitor.rules.replay`), so detectors are
compared on identical data. Per detector:

- *warned*: warnable collapses whose first alarm came >= ``LEAD`` steps before the collapse step. A collapse is
  *warnable* when its step is >= ``LEAD`` steps after the first recorded step (step 0), i.e. step >= ``LEAD``;
  collapses without a step (a net that never learned) are not warnable and are counted apart;
- *median lead*: the median of (collapse step - alarm step) over the warned collapses;
- *false alarms per 10 healthy runs*: healthy runs with any alarm, per 10 healthy runs.

The monitor's records are replayed every ``--every`` steps (default 10, the monitor's default recording interval);
rules with ``every_step = True`` see every step's scalars (loss, gradient norm). ``guard``
(:mod:`~normlab_lab.collapse_bench.guard`) trains runs again under the default :class:`normlab.monitor.CollapseGuard`.
Pilot seeds are 200-209 (set-up grids and rule parameters were fixed on them), report seeds 300-302, 310-312 and
320-322 (rounds 1-3, lab/docs/monitor_benchmark.md); seeds below 100 are never used. ``--setups`` defaults to the
report's set-ups; the pilot-only ones (``setups.PILOT_SETUPS``) run when named.

The stages import :mod:`~normlab_lab.collapse_bench.protocol` and the set-ups, never each other's command: ``evaluate``
and ``guard`` read what ``collect`` wrote.
"""
