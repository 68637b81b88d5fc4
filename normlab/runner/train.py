"""Old import path of :mod:`normlab.runner.training.train`, kept for code outside the runner that still uses it."""

from normlab.runner.training.train import Trainer, read_checkpoint, seed_everything, train

__all__ = ["Trainer", "train", "read_checkpoint", "seed_everything"]
