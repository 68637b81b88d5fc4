"""The demo: the normalization comparison on MNIST-1D, its protocol and its report."""
