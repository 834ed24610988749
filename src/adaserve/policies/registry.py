"""Policy names -> policy objects (``policy=`` / ``--policy``)."""

from __future__ import annotations

from typing import Any

from adaserve.core.policy import Policy
from adaserve.errors import InvalidRequestError
from adaserve.policies.static import AUTOREGRESSIVE_POLICIES, StaticSpecPolicy

POLICY_NAMES = (
    "adaserve",
    "ar",
    "ar-chunked",
    "priority",
    "spec-chain:K",
    "spec-tree[:DxW[:N]]",
    "smartspec",
    "dyn-tree",
    "oracle[:DxW][:compose]",
)
# clairvoyant upper bounds: the simulator runs them, the engine refuses them
SIMULATOR_ONLY = ("oracle",)
# adaserve, smartspec and dyn-tree take AdaptiveConfig overrides after the name:
# "adaserve:max_depth=3:slo_margin=0.1"


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (see ``POLICY_NAMES``); ``kwargs`` and any
    ``:key=value`` suffix override a budgeted policy's ``AdaptiveConfig``."""
    head, _, arg = name.partition(":")
    try:
        if head in AUTOREGRESSIVE_POLICIES and not arg:
            return AUTOREGRESSIVE_POLICIES[head]()
        if head == "spec-chain":
            k = int(arg or 4)
            return StaticSpecPolicy(f"spec-chain:{k}", k, 1, None)
        if head == "spec-tree":
            d, w = 5, 3
            n: int | None = 23
            if arg:
                shape, _, cap = arg.partition(":")
                d, w = (int(x) for x in shape.lower().split("x"))
                n = int(cap) if cap else None
            label = "spec-tree" if not arg else f"spec-tree:{arg}"
            return StaticSpecPolicy(label, d, w, n)
        if head == "oracle":
            return _oracle(arg)
        if head in ("adaserve", "smartspec", "dyn-tree"):
            from adaserve.policies.budgeted import make_adaptive

            overrides = _overrides(name, arg)
            try:
                return make_adaptive(head, **kwargs, **overrides)
            except (ValueError, TypeError) as e:  # AdaptiveConfig's validation
                raise InvalidRequestError(f"policy {name!r}: {e}", "policy") from None
    except InvalidRequestError:
        raise
    except (ValueError, TypeError):
        pass
    raise InvalidRequestError(
        f"unknown or malformed policy {name!r}; known: {', '.join(POLICY_NAMES)}", "policy"
    )


def _oracle(arg: str) -> Policy:
    """``oracle`` / ``oracle:DxW`` / ``oracle[:DxW]:compose`` (ValueError for any other
    form). ``compose``: the prefill of adaserve's pass composition instead of FCFS."""
    from adaserve.policies.oracle import ORACLE_DEPTH, ORACLE_WIDTH, OraclePolicy, composed_prefill

    parts = arg.lower().split(":") if arg else []
    compose = bool(parts) and parts[-1] == "compose"
    if compose:
        parts = parts[:-1]
    if len(parts) > 1:
        raise ValueError(arg)
    d, w = ORACLE_DEPTH, ORACLE_WIDTH
    if parts:
        ds, _, ws = parts[0].partition("x")  # "4x4"
        if not (ds.isdigit() and ws.isdigit()):
            raise ValueError(arg)
        d, w = int(ds), int(ws)
    label = "oracle" + (f":{arg.lower()}" if arg else "")
    return OraclePolicy(d, w, prefill=composed_prefill() if compose else None, name=label)


def simulator_only(name: str) -> bool:
    """Whether the policy called ``name`` runs only in the simulator (clairvoyant)."""
    return name.partition(":")[0].strip() in SIMULATOR_ONLY


def check_servable(policy: str | Policy) -> None:
    """Raise InvalidRequestError when ``policy`` (a name or a policy object) cannot run
    on the engine: a clairvoyant policy needs the target's path before verification,
    which only the simulator knows."""
    if isinstance(policy, str):
        bad, label = simulator_only(policy), policy
    else:
        bad, label = bool(policy.clairvoyant), policy.name
    if bad:
        raise InvalidRequestError(
            f"policy {label!r} is clairvoyant (it is told the target's accepted path "
            "before verifying): simulator only; run it with `adaserve simulate`",
            "policy",
        )


def _overrides(name: str, arg: str) -> dict[str, Any]:
    """``key=value:key=value`` -> AdaptiveConfig fields, typed like their defaults."""
    import dataclasses

    from adaserve.policies.budgeted import AdaptiveConfig

    fields = {f.name: f for f in dataclasses.fields(AdaptiveConfig)}
    defaults = AdaptiveConfig()
    out = {}
    for item in filter(None, arg.split(":")):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            raise InvalidRequestError(
                f"policy {name!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}",
                "policy",
            )
        kind = type(getattr(defaults, key))
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                out[key] = raw.lower() in ("true", "1")
            else:
                out[key] = kind(raw)
        except ValueError:
            raise InvalidRequestError(
                f"policy {name!r}: {key} takes a {kind.__name__}, not {raw!r}", "policy"
            ) from None
    return out
