"""What the command lines share: the parser class (one-line errors) and the value types
of their flags (byte sizes with suffixes, ports, bounded numbers).

Every ``adaserve`` subcommand is built from ``Parser``, so a bad flag value ends as one
line on stderr (``adaserve serve: error: argument --port: ...``) and exit status 2,
never a traceback or a usage dump.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``prog: error: message``,
    then ``--help`` for the usage) with exit status 2. Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_byte_size(text: str) -> int:
    """Bytes of a size written as ``268435456``, ``512M``, ``512MiB``, ``512MB``, ``2G``,
    ``1.5GiB`` (K, M, G, T are powers of 1024, as the kernel's and vLLM's byte sizes;
    case and a trailing ``B``/``iB`` do not matter). ValueError for anything else, or
    for a size below one byte."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r} (e.g. 268435456, 512M, 2GiB)")
    n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(n) or n < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return int(n)


def byte_size(text: str) -> int:
    """argparse type of a byte size (``parse_byte_size``)."""
    try:
        return parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def port(text: str) -> int:
    """argparse type of a TCP port: an integer in [0, 65535] (0 = any free port)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port {v} is not in [0, 65535]")
    return v


def int_at_least(lo: int):
    """argparse type of an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def human_int(text: str) -> int:
    """argparse type of a positive token count as vLLM's ``--max-model-len`` takes it:
    ``4096``, ``1k`` (1000), ``1K`` (1024), ``25.6k``, ``1m``/``1M``."""
    m = re.match(r"^\s*(\d+(?:\.\d*)?)\s*([kKmMgG]?)\s*$", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4096, 4k, 4K)")
    unit = m.group(2)
    base = 1000 if unit.islower() else 1024
    exp = {"": 0, "k": 1, "m": 2, "g": 3}[unit.lower()]
    v = float(m.group(1)) * base**exp
    if v != int(v) and exp == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return int(v)


def positive_float(text: str) -> float:
    """argparse type of a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type of a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    """argparse type of a share in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def quiet_broken_pipe() -> None:
    """After stdout's reader went away (``adaserve ... | head``): send what is left of
    stdout to /dev/null, so the interpreter's final flush does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
