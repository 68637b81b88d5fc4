"""Experiments: each is a spec plus a training function, run by the grid engine (:mod:`normlab.runner.grid.execute`)."""
