"""Walking a module tree: names, unique modules, swapping modules under every name that holds them, the one
warning about hooks a replacement does not carry, and the one-line lists of layers in warnings and errors
(:func:`name_list`, :func:`grouped`: each reason once, the first few names and the count of the rest). Used by
:mod:`normlab.convert` and by :meth:`normlab.nn.SyncBatchRenorm.convert_sync_batchrenorm`."""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["module_names", "unique_modules", "swap_modules", "warn_lost_hooks", "name_list", "grouped"]

#: How many names a one-line list shows before "and N more".
FIRST = 3


def module_names(model: nn.Module) -> dict[int, str]:
    """Module id -> its first name in ``model`` (``"<model>"`` for the root), aliases included."""
    out: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out.setdefault(id(m), name or "<model>")
    return out


def unique_modules(model: nn.Module, keep) -> list[nn.Module]:
    """The modules of ``model`` for which ``keep`` holds, each once however many names it has."""
    return list({id(m): m for m in model.modules() if keep(m)}.values())


def swap_modules(model: nn.Module, new: dict[int, nn.Module]) -> nn.Module:
    """Put ``new[id(old)]`` under every name and parent that holds ``old`` (aliases and shared modules stay
    shared); returns the new root if ``model`` itself is replaced."""
    parents = unique_modules(model, lambda _: True)
    for parent in parents:
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                parent._modules[name] = new[id(child)]
    return new.get(id(model), model)


_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def warn_lost_hooks(modules, names: dict, where: str) -> None:
    """One ``UserWarning`` naming each of ``modules`` (being replaced) that has module hooks (forward, backward,
    state-dict): a hook may change what the layer computes or saves, and its replacement does not carry it (nor
    does torch's ``SyncBatchNorm.convert_sync_batchnorm``)."""
    hooked = [f"{names[id(m)]} ({type(m).__name__})" for m in modules if any(getattr(m, h, None) for h in _HOOKS)]
    if hooked:
        warnings.warn(
            f"{where}: the hooks on these layers are not carried over to their replacements (register them again "
            f"on the converted model): {name_list(hooked)}",
            UserWarning,
            stacklevel=4,
        )


def name_list(labels: list[str], first: int = FIRST) -> str:
    """``"a, b, c"``, or ``"a, b, c and 18 more (21)"`` past ``first`` labels: a list that stays one readable line."""
    if len(labels) <= first:
        return ", ".join(labels)
    return f"{', '.join(labels[:first])} and {len(labels) - first} more ({len(labels)})"


def grouped(items: list[tuple[str, str]], first: int = FIRST) -> str:
    """``(label, reason)`` pairs as one line that gives each reason once, in the order they first appear, after its
    labels (:func:`name_list`): ``"a, b, c and 18 more (21): reason; d: other reason"``."""
    by_reason: dict[str, list[str]] = {}
    for label, reason in items:
        by_reason.setdefault(reason, []).append(label)
    return "; ".join(f"{name_list(labels, first)}: {reason}" for reason, labels in by_reason.items())
