"""normlab._checks: the one number validator against its definition (type, finiteness, open and closed bounds,
None), and the one wording of a refusal."""

import math

import pytest

from normlab._checks import check_number, is_int, is_number, number_problem
from normlab.runner.training.config import GROUPS, TrainConfig

VALUES = [0, 1, 2, -1, 0.5, 1.0, 16, 16.5, True, False, math.nan, math.inf, -math.inf, None, "1", 1e300]


def _accepts(v, integer, low, high, low_open, high_open, finite, optional):
    """The definition, written out."""
    if v is None:
        return optional
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        return False
    if finite and not math.isfinite(v):
        return False
    if low is not None and not (v > low if low_open else v >= low):
        return False
    return high is None or (v < high if high_open else v <= high)


BOUNDS = [
    dict(integer=True, low=1, high=None, low_open=False, high_open=False, finite=True, optional=False),
    dict(integer=False, low=0, high=None, low_open=True, high_open=False, finite=True, optional=False),
    dict(integer=False, low=0, high=16, low_open=True, high_open=False, finite=True, optional=False),
    dict(integer=False, low=0, high=1, low_open=False, high_open=True, finite=True, optional=True),
    dict(integer=False, low=0, high=None, low_open=False, high_open=False, finite=False, optional=False),
    dict(integer=True, low=None, high=None, low_open=False, high_open=False, finite=True, optional=True),
]


@pytest.mark.parametrize("bounds", BOUNDS)
def test_number_problem_is_its_definition(bounds):
    for v in VALUES:
        assert (number_problem(v, **bounds) is None) == _accepts(v, **bounds), (v, bounds)


def test_the_words_of_what_was_expected():
    assert number_problem(0, integer=True, low=1) == "an int >= 1"
    assert number_problem(0, low=0, low_open=True) == "a finite number > 0"
    assert number_problem(17, low=0, high=16, low_open=True) == "a number in (0, 16]"
    assert number_problem(1.0, low=0, high=1, high_open=True, optional=True) == "a number in [0, 1) or None"
    with pytest.raises(ValueError, match=r"^BatchRenorm2d: eps must be a finite number > 0, got nan$"):
        check_number("BatchRenorm2d", "eps", math.nan, low=0, low_open=True)
    assert is_int(3) and not is_int(True) and is_number(math.inf) and not is_number(math.inf, finite=True)


def test_every_config_field_is_in_one_group():
    names = [f for group in GROUPS.values() for f in group]
    assert sorted(names) == sorted(TrainConfig.__dataclass_fields__) and len(names) == len(set(names))
