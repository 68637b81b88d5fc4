"""Data sets of the runner: in-memory tensors (digits, mnist1d generated here, cifar10 from its python batches)."""
