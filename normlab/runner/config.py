"""Old import path of :mod:`normlab.runner.training.config`, kept for code outside the runner that still uses it."""

from normlab.runner.training.config import BRN_SCHEDULES, RESUME_FREE, TrainConfig, resolve_device

__all__ = ["TrainConfig", "RESUME_FREE", "BRN_SCHEDULES", "resolve_device"]
