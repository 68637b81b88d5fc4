"""``normlab-lab reproduce``: the demo's sections trained to their plateau (``mnist1d``) and the PWS paper's CIFAR-10
classification table (``cifar10-pws``)."""
