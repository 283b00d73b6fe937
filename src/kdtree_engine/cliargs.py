"""What every ``kdtree`` subcommand shares: one-line errors, range-checked argument types and
output path checks.

A user error (a bad value, an unwritable output, a missing input file, no CUDA when asked for)
prints ONE line on stderr, ``kdtree: error: <argument>: <what is wrong, with the value>``, and
exits with status 2; a traceback means a bug. Ranges are checked when the arguments are parsed
(the ``type=`` functions below), output paths before any work (:func:`prepare_output_dir`,
:func:`prepare_output_file`).

This module imports no kernel, so the ``kdtree`` command, ``kdtree bench`` and ``kdtree demo`` use
it before the backend is chosen.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .backend import BackendError

__all__ = [
    "UsageError",
    "ArgumentParser",
    "guarded",
    "int_in",
    "float_above",
    "int_list",
    "existing_file",
    "existing_dir",
    "prepare_output_dir",
    "prepare_output_file",
]

EXIT_USAGE = 2


class UsageError(Exception):
    """A user error found after parsing; :func:`guarded` prints it as one line and exits 2."""


def _error_line(message: str) -> str:
    return "kdtree: error: " + " ".join(str(message).split())


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``kdtree: error: ...``, exit 2
    (argparse's own prints the usage first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, _error_line(message) + "\n")


def guarded(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a subcommand's ``main(argv)``: :class:`UsageError` and
    :class:`~kdtree_engine.backend.BackendError` become one stderr line and exit status 2."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (UsageError, BackendError) as e:
            print(_error_line(e), file=sys.stderr)
            return EXIT_USAGE

    return run


# ----------------------------------------------------------------------------------------------
# argument types (argparse reports their ArgumentTypeError as "argument --x: <message>")


def _range_text(lo, hi) -> str:
    return f"{lo}..{hi}" if hi is not None else f">= {lo}"


def _int(text: str) -> int:
    """``"16"`` -> 16, ``"16k"`` -> 16384."""
    t = text.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        return int(t.removesuffix("k")) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``lo..hi`` (``hi=None``: no upper bound); a ``k`` suffix multiplies by 1024."""

    def parse(text: str) -> int:
        v = _int(text)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_range_text(lo, hi)}, got {text!r}")
        return v

    parse.__name__ = f"int {_range_text(lo, hi)}"
    return parse


def float_above(lo: float, *, inclusive: bool = False, hi: float | None = None) -> Callable[[str], float]:
    """A finite float ``> lo`` (``>= lo`` with ``inclusive``), at most ``hi`` if given."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = (v >= lo if inclusive else v > lo) and (hi is None or v <= hi) and v == v and abs(v) != float("inf")
        if not ok:
            bound = f"{'>=' if inclusive else '>'} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return v

    return parse


def int_list(lo: int, hi: int | None = None) -> Callable[[str], list[int]]:
    """A comma list of integers in ``lo..hi`` (``"1,2,16k"`` -> ``[1, 2, 16384]``)."""
    one = int_in(lo, hi)

    def parse(text: str) -> list[int]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        out = []
        for p in parts:
            try:
                out.append(one(p))
            except argparse.ArgumentTypeError as e:
                where = f" (in {text!r})" if len(parts) > 1 else ""
                raise argparse.ArgumentTypeError(f"{e}{where}") from None
        return out

    return parse


def existing_file(text: str) -> Path:
    """A path that is an existing regular file."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"not a regular file: {text!r}")
    return p


def existing_dir(text: str) -> Path:
    """A path that is an existing directory."""
    p = Path(text)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return p


# ----------------------------------------------------------------------------------------------
# output paths, checked before any work


def prepare_output_dir(path: str | Path, arg: str) -> Path:
    """Create directory ``path`` if needed and prove it writable (a probe file), before any work.
    Raises :class:`UsageError` naming ``arg`` and the path otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"argument {arg}: {str(path)!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise UsageError(f"argument {arg}: cannot write into {str(path)!r}: {e.strerror or e}") from None
    return p


def prepare_output_file(path: str | Path, arg: str) -> Path:
    """Check that file ``path`` can be written (its directory is created if needed) before any
    work. Raises :class:`UsageError` naming ``arg`` and the path otherwise."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"argument {arg}: {str(path)!r} is a directory, expected a file path")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"argument {arg}: {str(path)!r} is not writable")
    prepare_output_dir(p.parent, arg)
    return p

