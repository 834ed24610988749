"""Session workloads, where prompts share prefixes: multi-turn chat and agent loops.

``--dataset multiturn[:KEY=VALUE...]``: conversations that share one system prompt. Turn
k's prompt is the system prompt, then every earlier user message and reply, then the
new user message; its output is the next reply.

``--dataset agent[:KEY=VALUE...]``: tool loops that share one long preamble (system
prompt plus tool schemas). Step k's prompt is the preamble, the task, then every earlier
tool call and tool result; its output is the next tool call.

The histories are scripted (as replayed chat logs are): the replies in a history are
the recorded ones, not the model's output, so a request's own output is never found in
the cache, while everything its predecessor sent is. Turns of one session are open-loop:
turn k + 1 arrives ``think`` seconds (exponential, mean ``think``) plus its reply's
nominal duration (``reply_s`` per output token) after turn k. Sessions start as a
Poisson process at ``request_rate / mean turns`` per second, from the longest session span
before 0 (only requests from 0 on are kept), so the request rate is the spec's from
the start. A session ends at its turn count, or before a prompt would pass ``ctx`` tokens.

Keys (defaults for multiturn / agent): ``system`` shared prefix tokens (384 / 768),
``turns`` LO-HI turns or steps a session (2-6 / 3-8), ``user`` LO-HI tokens a user
message or a tool result adds (16-64 / 48-160), ``think`` seconds (4 / 0.5), ``reply_s``
(0.03), ``ctx`` (1536). Reply lengths are the spec's output lengths per class; a session
keeps its class. Token ids come from held-out standard-library text (the tokenizer's, or
the bytes mapped into the vocabulary): the same seed gives the same tokens, so the
simulator (``prompt_ids`` name its KV blocks) and the engine see the same workload.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaserve.bench.datasets import _ids_from_text, heldout_stdlib_files
from adaserve.bench.workload_spec import (
    FALLBACK_OUTPUT,
    LengthDist,
    WorkItem,
    WorkloadError,
    WorkloadSpec,
)

KINDS = ("multiturn", "agent")


@dataclass(frozen=True)
class SessionShape:
    """The shape of a session workload (``--dataset KIND:KEY=VALUE:...``)."""

    kind: str = "multiturn"
    system: int = 384
    turns: tuple[int, int] = (2, 6)
    user: tuple[int, int] = (16, 64)
    think: float = 4.0
    reply_s: float = 0.03
    ctx: int = 1536

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WorkloadError(f"unknown session workload {self.kind!r}")
        lo, hi = self.turns
        ulo, uhi = self.user
        if not (1 <= lo <= hi and 1 <= ulo <= uhi and self.system >= 1):
            raise WorkloadError(f"bad session workload {self.spec()!r}")
        if not (self.think >= 0 and self.reply_s >= 0 and self.ctx > self.system + uhi):
            raise WorkloadError(f"bad session workload {self.spec()!r}")

    def spec(self) -> str:
        return (
            f"{self.kind}:system={self.system}:turns={self.turns[0]}-{self.turns[1]}"
            f":user={self.user[0]}-{self.user[1]}:think={self.think:g}"
            f":reply_s={self.reply_s:g}:ctx={self.ctx}"
        )


_DEFAULTS = {
    "multiturn": SessionShape("multiturn"),
    "agent": SessionShape("agent", 768, (3, 8), (48, 160), 0.5),
}


def is_session_dataset(name: str) -> bool:
    return name.split(":", 1)[0] in KINDS


def parse_session(name: str) -> SessionShape:
    """``multiturn`` | ``agent``, then ``:KEY=VALUE`` overrides (see the module)."""
    kind, *parts = name.split(":")
    if kind not in _DEFAULTS:
        raise WorkloadError(f"unknown session workload {kind!r}; known: {', '.join(KINDS)}")
    base = _DEFAULTS[kind]
    kw: dict = {}
    for part in parts:
        key, sep, val = part.partition("=")
        try:
            if key in ("turns", "user"):
                lo, _, hi = val.partition("-")
                kw[key] = (int(lo), int(hi or lo))
            elif key in ("system", "ctx"):
                kw[key] = int(val)
            elif key in ("think", "reply_s"):
                kw[key] = float(val)
            else:
                raise KeyError(key)
        except (KeyError, ValueError):
            raise WorkloadError(
                f"bad session option {part!r}: use system=N, turns=LO-HI, user=LO-HI, "
                "think=S, reply_s=S or ctx=N"
            ) from None
        if not sep:
            raise WorkloadError(f"bad session option {part!r}: KEY=VALUE")
    return SessionShape(**{**base.__dict__, **kw})


class _Text:
    """Token ids from held-out stdlib text: consecutive slices of one long stream."""

    def __init__(self, rng: np.random.Generator, tokenizer, vocab_size: int | None):
        files = heldout_stdlib_files()
        order = rng.permutation(len(files))
        self.text = "\n".join(files[int(i)][1] for i in order[:40])
        self.tok, self.vocab = tokenizer, vocab_size
        self.rng = rng
        self._ids: list[int] | None = None

    def ids(self, n: int) -> list[int]:
        if self._ids is None:
            if self.tok is not None:
                self._ids = list(self.tok.encode(self.text))
            else:
                self._ids = _ids_from_text(self.text, len(self.text), self.vocab or 32000)
        src = self._ids
        start = int(self.rng.integers(0, max(1, len(src) - n)))
        out = src[start : start + n]
        while len(out) < n:
            out = out + src[: n - len(out)]
        return list(out)


def build_sessions(spec: WorkloadSpec, tokenizer=None, vocab_size: int | None = None):
    """The items of a session workload in arrival order (deterministic in the seed)."""
    shape = parse_session(spec.dataset)
    if spec.duration_s is None:
        raise WorkloadError("a session workload needs a duration")
    ss = np.random.SeedSequence(spec.seed)
    r_arr, r_len, r_txt = (np.random.default_rng(s) for s in ss.spawn(3))
    text = _Text(r_txt, tokenizer, vocab_size)
    system = text.ids(shape.system)
    names = [c for c, _ in spec.class_mix]
    shares = np.array([w for _, w in spec.class_mix], dtype=float)
    shares = shares / shares.sum()
    out_len = dict(spec.output_len)

    def session(rng: np.random.Generator, ids) -> tuple[str, list[tuple[float, list, int]]]:
        """One session's class and turns: (seconds after its start, prompt, reply)."""
        cls = names[int(rng.choice(len(names), p=shares))]
        reply_d: LengthDist = out_len.get(cls, out_len.get("*", FALLBACK_OUTPUT))
        history, at, turns = list(system), 0.0, []
        for _ in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            user = ids(int(rng.integers(shape.user[0], shape.user[1] + 1)))
            reply = max(1, int(reply_d.sample(rng, 1)[0]))
            prompt = history + user
            if len(prompt) + reply > shape.ctx:
                break
            turns.append((at, prompt, reply))
            history = prompt + ids(reply)  # the recorded reply
            at += float(rng.exponential(shape.think)) if shape.think else 0.0
            at += reply * shape.reply_s
        return cls, turns

    # the mean turns a session really has (its context cuts it) and its mean span, from
    # sessions drawn on a stream of their own: sessions start at request_rate / turns
    # per second, from the longest span before 0, so the request rate is steady from 0
    probe = np.random.default_rng(ss.spawn(1)[0])
    drawn = [session(probe, lambda n: [0] * n)[1] for _ in range(64)]
    mean_turns = max(1.0, float(np.mean([len(t) for t in drawn])))
    span = max(t[-1][0] if t else 0.0 for t in drawn)
    rate = spec.request_rate / mean_turns
    finite = math.isfinite(rate)
    t = -span if finite else 0.0
    raw: list[Any] = []
    for s in itertools.count():
        t += float(r_arr.exponential(1.0 / rate)) if finite else 0.0
        if t > spec.duration_s or (spec.num_prompts and len(raw) >= spec.num_prompts):
            break
        cls, turns = session(r_len, text.ids)
        for k, (dt, prompt, reply) in enumerate(turns):
            if 0 <= t + dt <= spec.duration_s:
                raw.append((t + dt, cls, prompt, reply, {"session": s, "turn": k}))
    raw.sort(key=lambda x: x[0])
    items = []
    for i, (at, cls, prompt, reply, meta) in enumerate(raw):
        items.append(
            WorkItem(
                idx=i,
                arrival_s=at,
                cls=cls,
                prompt=tokenizer.decode(prompt) if tokenizer is not None else None,
                prompt_ids=prompt,
                prompt_len=len(prompt),
                max_tokens=reply,
                meta=meta,
            )
        )
    return items
