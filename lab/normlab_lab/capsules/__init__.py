"""The capsule routing experiment (lab/docs/capsules.md): CapsNet models, one cell's training, statistics, report."""
