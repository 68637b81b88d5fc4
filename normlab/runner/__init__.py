"""The experiment runner, grouped by job: ``data/`` and ``models`` (what is trained), ``training/`` (one run:
config, setup, task, train), ``grid/`` (the engine that runs the cells of any experiment, and the comparison's
results and report), ``experiments/`` (compare: a spec plus a training function), the one resolver of models,
data, losses and metrics by name (``factories``); ``io``, ``lock`` and ``errors`` under everything.

``from normlab.runner import compare``: compare normalizations on your own model and data
(:func:`normlab.runner.experiments.compare.compare`).

It imports the library (:mod:`normlab.nn`, :mod:`normlab.monitor`); the library never imports it.
``normlab.cli`` puts it on the command line. What other code may build on (the grid engine, specs, results, report,
training, data sets, models, files and locks) is listed in each module's ``__all__`` and on the API page.
"""

from normlab.runner.experiments.compare import compare

__all__ = ["compare"]
