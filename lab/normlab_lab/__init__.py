"""normlab's lab: the paper's reproduction and the research record behind normlab's defaults.

A separate package beside ``normlab`` (as torchvision keeps ``references/`` outside torchvision), written on
normlab's public API only:

- :mod:`normlab_lab.demo`: the demo (``make demo``), the paper's claims judged on MNIST-1D, its report;
- :mod:`normlab_lab.reproduce`: the demo's sections trained to their plateau, and the PWS paper's CIFAR-10 table;
- :mod:`normlab_lab.capsules`: the capsule routing experiment (stop_gradient x routing iterations);
- :mod:`normlab_lab.verdicts`: the paper's headline effects, judged from a grid's results;
- :mod:`normlab_lab.collapse_bench`: the collapse benchmark (does a detector warn before a run collapses?);
- :mod:`normlab_lab.steps`: the one step-by-step training loop of the collapse studies;
- ``normlab-lab`` (:mod:`normlab_lab.cli`): ``demo | reproduce | capsules | report | collapse-bench``.

The scripts that produced the research record are in ``lab/scripts/``, the record itself in ``lab/docs/``.
"""

__version__ = "0.1.0"

#: The lab's command, the prefix of every line it prints.
PROG = "normlab-lab"
#: How long the demo (``make demo``) takes on 2 idle CPU cores once ``.venv`` is set up, in minutes: what the
#: README, the lab's README and every help text say (lab/tests/test_lab_cli.py compares them; 266 s measured).
DEMO_MINUTES = 4.5
