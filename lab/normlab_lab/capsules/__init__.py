"""The capsule routing experiment (docs/capsules.md): CapsNet models, one cell's training, statistics, report."""
