"""The checks of :func:`~normlab.nn.register_norm` and :func:`~normlab.nn.register_conv`: each refusal is one line
naming the call, the argument and what was expected, raised before the registry changes."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping

from torch import nn

__all__ = ["check_name", "check_classes", "check_signature", "check_optional_class", "check_options", "STATISTICS"]

#: What one statistic of a norm is computed over (:class:`~normlab.nn.registry.NormEntry`'s ``statistics``).
STATISTICS = ("batch", "instance", "group", "layer", "none")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_OPTION_TYPES = (bool, int, float, str)


def check_name(call: str, name, taken: dict[str, str]) -> str:
    """``name`` lower-case ``[a-z][a-z0-9_]*`` (comparison names join names with ``+`` and options with ``:``) and
    not in ``taken`` (name -> what holds it)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{call}: name must be lower-case letters, digits and '_' starting with a letter, got {name!r}"
        )
    if name in taken:
        raise ValueError(f"{call}: name {name!r} is taken by {taken[name]}")
    return name


def check_classes(call: str, layer, dims: tuple[int, ...]) -> dict[int, type]:
    """``layer`` as {dim: class}: one ``nn.Module`` subclass for every dim, or a mapping from some of ``dims``."""
    what = "an nn.Module subclass (used for every dim) or {dim: class} with dims in 1, 2, 3"
    if isinstance(layer, Mapping):
        classes = dict(layer)
        if not classes or any(d not in dims for d in classes):
            raise ValueError(f"{call}: layer must be {what}, got a mapping with keys {sorted(classes, key=str)}")
    else:
        classes = {d: layer for d in dims}
    for cls in classes.values():
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
            got = f"{type(cls).__name__} {getattr(cls, '__qualname__', cls)!r}"
            hint = " (a factory: register a subclass whose __init__ calls it)" if callable(cls) else ""
            raise TypeError(f"{call}: layer must be {what}, got {got}{hint}")
    return classes


def check_signature(call: str, cls: type, expected: str, *args, **kwargs) -> None:
    """``cls(*args, **kwargs)`` binds to ``cls``'s constructor (the call normlab makes, described by ``expected``)."""
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{call}: {cls.__qualname__}'s constructor must take {expected} ({e})") from None
    except ValueError:  # a constructor without a signature (a C type): accepted, its call errors name it
        pass


def check_optional_class(call: str, arg: str, value, allow_str: bool = False) -> None:
    """``value`` None, an ``nn.Module`` subclass or (``allow_str``) ``"module:attribute"``."""
    if value is None or (inspect.isclass(value) and issubclass(value, nn.Module)):
        return
    if allow_str and isinstance(value, str) and value.count(":") == 1 and all(value.split(":")):
        return
    expected = "None, an nn.Module subclass" + (" or 'module:attribute'" if allow_str else "")
    raise TypeError(f"{call}: {arg} must be {expected}, got {type(value).__name__} {value!r}")


def check_options(call: str, options) -> dict[str, type]:
    """``options``: {constructor argument: bool, int, float or str} (what a comparison name may set after ``:``)."""
    options = dict(options or {})
    bad = {k: v for k, v in options.items() if not isinstance(k, str) or v not in _OPTION_TYPES}
    if bad:
        raise TypeError(f"{call}: options must map argument names to bool, int, float or str, got {bad!r}")
    return options
