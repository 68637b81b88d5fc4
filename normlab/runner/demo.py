"""The grid of ``normlab demo`` (what ``make demo`` runs)."""

from __future__ import annotations

from .grid import DEFAULT_NORMS, GridSpec

__all__ = ["demo_spec"]


def demo_spec(quick: bool = False) -> GridSpec:
    """The default comparison of ``normlab demo`` on digits.

    Plain net at width 0.25, 2 epochs, seeds 0 and 1, layout "cross": a learning-rate sweep 0.01 / 0.03 / 0.1 at
    batch size 64 and batch sizes 64 and 2 at lr 0.01, for none, BN, BRN, GN, SN, WN, WS and PWS.
    ``quick=True`` is a seconds-long version that only checks the pipeline.
    """
    if quick:
        return GridSpec(norms=("none", "bn", "gn", "pws"), lrs=(0.01, 0.1), batch_sizes=(64, 8), seeds=(0,),
                        epochs=1, width=0.125, layout="cross", max_steps_per_epoch=5)
    return GridSpec(norms=DEFAULT_NORMS, lrs=(0.01, 0.03, 0.1), batch_sizes=(64, 2), seeds=(0, 1), epochs=2,
                    width=0.25, layout="cross", target_acc=0.9)
