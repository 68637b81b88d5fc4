"""The full reproduction on MNIST-1D: the demo's sections (a)-(d), every run trained to its plateau.

:data:`FULL_PROTOCOL` is the demo's :class:`~normlab_lab.demo.experiment.DemoProtocol` with epochs
instead of step caps, an lr schedule (x0.1 after 40 % and after 60 % of each section's epochs: the paper's steps,
placed so that the last two fifths of every run, which the plateau criterion compares, both lie in the final
phase) and the report seeds 300-302. It was chosen from pilots on seeds 200-202 (lab/docs/reproduction.md, "Full
reproduction"), in which the slowest cells of each section (BN at batch 128, PWS at batches 4 and 2, the
unnormalized net, WN and GN at the lowest learning rate) met the report's plateau criterion
(:func:`~normlab_lab.demo.claims.plateau_check`); BN at batch 2 met it once the criterion took the
noise of a two-sample loss into account (a fourth pilot, seed 203; lab/docs/reproduction.md). Section (a) trains 5
epochs since a fifth pilot (seeds 206-207), in which every norm of (a) at learning rates 0.02 and 0.1 met the
criterion in 5.

Section (b) keeps every training sample but caps an epoch at :attr:`batch_max_steps` steps: batch 128 trains
``batch_epochs`` full epochs, batches 4 and 2 the same number of capped epochs (random batches of the whole set,
``batch_epochs x batch_max_steps`` steps). With the lr scaled linearly from batch 128, batch 2 would need as many
epochs as batch 128 to reach its plateau (64x the steps, about 10x this whole budget), so the learning rate is
scaled with the square root of the batch size instead. The claims compare each batch size at its plateau.

:data:`SMOKE_PROTOCOL` is a seconds-long version of the same pipeline (the tests run it end to end).
"""

from __future__ import annotations

import dataclasses

from normlab_lab.demo.experiment import QUICK_PROTOCOL, DemoProtocol

__all__ = ["FULL_PROTOCOL", "SMOKE_PROTOCOL", "REPORT_SEEDS", "PILOT_SEEDS"]

REPORT_SEEDS = (300, 301, 302)  # the full record's seeds (0-2: the demo; 3-99: reserved; 100-199: earlier pilots)
PILOT_SEEDS = (200, 201, 202, 203, 204, 205, 206, 207)  # the protocol's pilots (204: started, stopped)

FULL_PROTOCOL = DemoProtocol(
    seeds=REPORT_SEEDS,
    guard_seeds=REPORT_SEEDS,
    lr_steps=0,
    lr_epochs=5,  # 10 until the fifth pilot (seeds 206-207: every run of (a) at its plateau in 5)
    lr_evals=1,
    collapse_steps=200,  # the monitor records every step of the first 200, then every monitor_every
    collapse_epochs=5,
    batch_num_train=0,
    batch_max_steps=1000,
    batch_epochs=20,
    batch_lr_scaling="sqrt",
    batch_monitor_every=200,
    milestones=(0.4, 0.6),
)

SMOKE_PROTOCOL = dataclasses.replace(
    QUICK_PROTOCOL,
    seeds=(300,),
    guard_seeds=(300,),
    lr_steps=4,
    lr_epochs=2,
    collapse_steps=3,
    collapse_epochs=2,
    batch_max_steps=4,
    batch_epochs=2,
    batch_num_train=0,
    batch_lr_scaling="sqrt",
    milestones=(0.5,),
)
