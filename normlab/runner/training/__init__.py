"""One training run: its config, the training loop, evaluation, collapse detection, the feasibility checks."""
