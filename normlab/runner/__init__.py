"""The experiment runner, grouped by job: ``data/`` and ``models`` (what is trained), ``training/`` (one run),
``grid/`` (the engine that runs the cells of any experiment, and the comparison's results and report),
``experiments/`` (compare: a spec plus a training function); ``io``, ``lock`` and ``errors``
under everything.

It imports the library (:mod:`normlab.nn`, :mod:`normlab.monitor`); the library never imports it.
``normlab.cli`` puts it on the command line. What other code may build on (the grid engine, specs, results, report,
training, data sets, models, files and locks) is listed in each module's ``__all__`` and on the API page.
"""
