"""The argument checks every benchmarks command shares: a parser whose errors are one line and exit status 2, bounded
number types, byte sizes, output paths probed before the run, optional libraries asked for before the run.

Importable without vLLM or torch (the GPU benchmarks run on machines with neither)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

MAX_CPU_BYTES = 2**50  # 1 PiB; the tiers allocate host slots lazily, so this is a sanity bound


class ArgError(Exception):
    """A bad argument found after parsing (a combination, a file, a path, a missing library): one line."""


def one_line(text: Any, limit: int = 600) -> str:
    """`text` as one printable line: control characters escaped, over-long text cut."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


def fail(prog: str, message: Any) -> int:
    """argparse's error() format, one line on stderr; the exit status for a bad argument."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return 2


def write_failed(prog: str, err: OSError) -> int:
    """One line on stderr for results that could not be written after the run (the output was checked before it; the
    disk filled up or the directory went away since); the exit status of a run that failed, not of a bad argument."""
    print(f"{prog}: error: {one_line(f'cannot write the results ({err})')}", file=sys.stderr, flush=True)
    return 1


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): `PROG: error: MESSAGE`, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def check_output(self, flag: str, path: str | os.PathLike[str] | None) -> None:
        """Before the run: the file `flag` names can be written (`check_output_path`), else one line, exit 2."""
        try:
            check_output_path(flag, None if path is None else os.fspath(path))
        except ArgError as err:
            self.exit(2, f"{self.prog}: error: {one_line(err)}\n")


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (allowed: {lo:,} to {hi:,})") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value:,} is out of range (allowed: {lo:,} to {hi:,})")
        return value

    parse.__name__ = "int"
    return parse


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    """argparse type: a finite number in [lo, hi] (NaN and infinity rejected)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (allowed: {lo:g} to {hi:g})") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite (allowed: {lo:g} to {hi:g})")
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range (allowed: {lo:g} to {hi:g})")
        return value

    parse.__name__ = "float"
    return parse


def parse_bytes(text: str) -> int:
    """A byte size from 1 B to 1 PiB, read as `cpu_bytes` is (vLLM's suffixes: 64g = 64e9, 64G = 64GiB = 64 x 2^30)."""
    from offload_connector.config import ConfigError, parse_byte_size
    try:
        value = parse_byte_size("cpu_bytes", text.strip())
    except ConfigError:
        value = None
    if value is None or not 1 <= value <= MAX_CPU_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size from 1 B to 1 PiB (e.g. 40GiB, 64g, 512Mi, "
                                         f"1000000; suffixes as vLLM's: lower case decimal, upper case binary)")
    return value


def check_output_path(flag: str, path: str | None) -> None:
    """Before the run: `path`'s directory exists and a file can be written there (probed, then removed)."""
    if path is None:
        return
    if not path.strip():
        raise ArgError(f"{flag}: empty path")
    p = Path(path)
    try:
        if p.is_dir():
            raise ArgError(f"{flag} {path!r}: is a directory; give a file name")
        parent = p.parent
        if not parent.is_dir():
            raise ArgError(f"{flag} {path!r}: directory {str(parent)!r} does not exist" if not parent.exists()
                           else f"{flag} {path!r}: {str(parent)!r} is not a directory")
        existed = p.exists() or p.is_symlink()
        # O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) instead of blocking the command.
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
        os.close(fd)
        if not existed:
            p.unlink()
    except OSError as err:
        raise ArgError(f"{flag} {path!r}: cannot write there ({err.strerror or err})") from None


def require_module(name: str, why: str, instead: str = "") -> Any:
    """Import an optional library before the run, or say what to do without it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ArgError(f"{why} needs {name}, which is not installed (pip install {name.split('.')[0]}{instead})"
                       ) from None
    except Exception as err:  # installed but broken: still a one-line answer before the run
        raise ArgError(f"{why} needs {name}, which fails to import ({type(err).__name__}: {err})") from None


def check_output_dir(flag: str, path: str) -> Path:
    """Before the run: `path` is a directory, or can be made one, and a file can be written in it (probed)."""
    if not path.strip():
        raise ArgError(f"{flag}: empty path")
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise ArgError(f"{flag} {path!r}: exists and is not a directory")
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-probe"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as err:
        raise ArgError(f"{flag} {path!r}: cannot write there ({err.strerror or err})") from None
    return p


def int_list_in(lo: int, hi: int) -> Callable[[str], list[int]]:
    """argparse type: comma-separated integers, each in [lo, hi], at least one."""
    one = int_in(lo, hi)

    def parse(text: str) -> list[int]:
        out = [one(x.strip()) for x in text.split(",") if x.strip()]
        if not out:
            raise argparse.ArgumentTypeError(f"none given (comma-separated integers, {lo:,} to {hi:,})")
        return out

    parse.__name__ = "list"
    return parse


def add_copy_layout_args(p: argparse.ArgumentParser, total_mib: int, repeats: int) -> None:
    """The copy benchmarks' layout: page sizes, bytes per call, tensors per group, row padding, repeats, seed."""
    p.add_argument("--pages", type=int_list_in(1, 1 << 30), default=[16384, 65536, 262144, 2621440],
                   help="page sizes in bytes, comma separated")
    p.add_argument("--total-mib", type=int_in(1, 1 << 16), default=total_mib, help="bytes per copy call (MiB)")
    p.add_argument("--tensors", type=int_in(1, 1024), default=4, help="KV tensors in the group (pages per block)")
    p.add_argument("--pad", type=int_in(0, 1 << 20), default=256, help="device row stride minus page bytes")
    p.add_argument("--repeats", type=int_in(1, 1000), default=repeats)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
