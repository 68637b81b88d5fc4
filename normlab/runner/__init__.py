"""The experiment runner: data, models, one training loop, grids, results, reports.

It imports the library (:mod:`normlab.nn`, :mod:`normlab.monitor`); the library never imports it.
``normlab.cli`` puts it on the command line.
"""
