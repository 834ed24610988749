"""Clocks: where scheduling reads the time.

Nothing in scheduling calls ``time`` itself. The engine and the server run on a
``WallClock``; the simulator sets a ``ManualClock`` to simulated time; tests use a
``ManualClock`` (set by hand) or a ``TickClock`` (a fixed step per reading) so that
decisions never depend on how fast the machine is.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic seconds."""

    def now(self) -> float:
        """Seconds on this clock's monotonic scale."""
        ...


class WallClock:
    """The process's monotonic wall clock (``time.perf_counter``)."""

    def now(self) -> float:
        """Seconds from ``time.perf_counter``."""
        return time.perf_counter()


class ManualClock:
    """A clock that moves only when told to (simulated time, fake time in tests)."""

    def __init__(self, t: float = 0.0):
        self.t = float(t)

    def now(self) -> float:
        """The time last set."""
        return self.t

    def set(self, t: float) -> None:
        """Move to ``t`` (never backwards)."""
        if t < self.t:
            raise ValueError(f"clock cannot go back from {self.t} to {t}")
        self.t = float(t)

    def advance(self, dt: float) -> None:
        """Move forward by ``dt`` seconds."""
        self.set(self.t + dt)


class TickClock(ManualClock):
    """A fake clock that moves ``tick_s`` forward after every reading: deterministic
    durations for code that measures itself (the engine's step time) in tests."""

    def __init__(self, tick_s: float = 0.01, t: float = 0.0):
        super().__init__(t)
        if not tick_s > 0:
            raise ValueError("tick_s must be positive")
        self.tick_s = float(tick_s)

    def now(self) -> float:
        """The current time; the clock then moves one tick on."""
        t = self.t
        self.t += self.tick_s
        return t


class PacedClock(ManualClock):
    """A fake clock that each engine pass moves by its modelled time, ``a_ms + b_ms x
    tokens`` (the pass's target tokens), and that a driver sets forward to the next
    arrival when nothing runs.

    The engine calls ``pass_ran`` after every verification pass, so its step times, the
    online correction and admission's measurements all see the modelled time while the
    passes themselves are real: a run on this clock makes the same decisions on a busy
    machine as on an idle one (the deterministic overload test and its replay).
    """

    def __init__(self, a_ms: float, b_ms: float, t: float = 0.0):
        super().__init__(t)
        if not (a_ms > 0 and b_ms >= 0):
            raise ValueError("a pass's modelled time needs a_ms > 0 and b_ms >= 0")
        self.a_ms, self.b_ms = float(a_ms), float(b_ms)

    def pass_ms(self, tokens: int) -> float:
        """The modelled duration of a pass of ``tokens`` target tokens."""
        return self.a_ms + self.b_ms * tokens

    def pass_ran(self, tokens: int) -> None:
        """A pass of ``tokens`` target tokens ran: move on by its modelled time."""
        self.advance(self.pass_ms(tokens) / 1000.0)
