"""Checks of values shared by every command, bench and options object: argparse types that parse
one flag's text, and :func:`check_int` for values given in Python; each names the bad value in
its error (``kvtier serve --port 0`` -> "a port is 1..65535, got 0")."""

from __future__ import annotations

import argparse

import numpy as np

from kvtier.cache.manager import check_block_size, parse_capacity


def block_size(text: str) -> int:
    try:
        return check_block_size(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(text: str, lo: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (the message names the bad value)."""
    return _int_at_least(text, 0, "a non-negative integer")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the message names the bad value)."""
    return _int_at_least(text, 1, "a positive integer")


def port(text: str) -> int:
    value = non_negative_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {value}")
    return value


def tier_blocks(text: str) -> int | float:
    value = capacity(text)
    if value == 0:
        raise argparse.ArgumentTypeError("the device tier needs at least one block (or inf)")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive number, got 0")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite non-negative number, got {text!r}")
    return value


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1] (``--gpu-memory-utilization 0.9``)."""
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def timeout_pair(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected BASE,PER_1K seconds, e.g. 0.1,0.05; got {text!r}")
    return (non_negative_float(parts[0]), non_negative_float(parts[1]))


def capacity(text: str) -> int | float:
    try:
        return parse_capacity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def json_dest(text: str) -> str:
    """argparse type of ``--json``: ``-`` (standard output) or a path ending in ``.json`` (so that
    ``--json`` put before a positional argument does not take it for its path)."""
    if text != "-" and not text.endswith(".json"):
        raise argparse.ArgumentTypeError(
            f"--json takes a path ending in .json, or - for standard output; got {text!r} "
            "(a bare --json goes after the positional arguments)"
        )
    return text


def add_json_flag(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json [PATH]``, one meaning in every command: write ``what`` as JSON to PATH (the
    table is printed too); bare ``--json`` (or ``--json -``): print the JSON instead of the table."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        type=json_dest,
        metavar="PATH",
        help=f"write {what} as JSON to PATH (.json); bare --json or --json -: print the JSON instead of the table",
    )


def write_json(dest: str | None, payload: object) -> bool:
    """Write ``payload`` where ``--json`` says; True when it went to standard output (the
    caller prints no table then)."""
    import json

    if dest is None:
        return False
    if dest == "-":
        print(json.dumps(payload), flush=True)
        return True
    with open(dest, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return False


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    """ValueError naming ``value`` unless it is an int in ``lo..hi`` (either bound may be None),
    or None when ``optional``. One check for SamplingParams and EngineConfig."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or (lo is not None and value < lo)
        or (hi is not None and value > hi)
    ):
        if lo is not None and hi is not None:
            want = f"an int in {lo}..{hi}"
        else:
            want = "an int" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
        raise ValueError(f"{name} must be {want}{' or None' if optional else ''}, got {value!r}")
