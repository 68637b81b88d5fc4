"""Grids of training runs: the spec, the engine that runs any experiment's cells (process pool or Ray), results,
estimate and report."""
