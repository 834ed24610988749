"""Policy names -> policy objects (``policy=`` / ``--policy``)."""

from __future__ import annotations

from adaserve.errors import InvalidRequestError
from adaserve.sched.base import Policy
from adaserve.sched.static import AutoregressivePolicy, StaticSpecPolicy

POLICY_NAMES = (
    "adaserve",
    "ar",
    "ar-chunked",
    "priority",
    "spec-chain:K",
    "spec-tree[:DxW[:N]]",
    "smartspec",
    "dyn-tree",
)


def make_policy(name: str, **kwargs) -> Policy:
    """Build the policy called ``name`` (see ``POLICY_NAMES``)."""
    head, _, arg = name.partition(":")
    try:
        if head in ("ar", "ar-chunked", "priority") and not arg:
            return AutoregressivePolicy(head)
        if head == "spec-chain":
            k = int(arg or 4)
            return StaticSpecPolicy(f"spec-chain:{k}", k, 1, None)
        if head == "spec-tree":
            d, w, n = 5, 3, 23
            if arg:
                shape, _, cap = arg.partition(":")
                d, w = (int(x) for x in shape.lower().split("x"))
                n = int(cap) if cap else None
            label = "spec-tree" if not arg else f"spec-tree:{arg}"
            return StaticSpecPolicy(label, d, w, n)
        if head in ("adaserve", "smartspec", "dyn-tree") and not arg:
            from adaserve.sched.adaptive import make_adaptive

            return make_adaptive(head, **kwargs)
    except (ValueError, TypeError):
        pass
    raise InvalidRequestError(
        f"unknown or malformed policy {name!r}; known: {', '.join(POLICY_NAMES)}", "policy"
    )
