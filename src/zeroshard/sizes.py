"""Memory sizes written by people: ``"2GiB"``, ``"1.5GB"``."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "UNITS"]

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NAMES = "B, kB, KiB, MB, MiB, GB, GiB, TB, TiB (any case)"


def parse_bytes(text: str, *, what: str = "size", zero: bool = False) -> int:
    """``"1.5GiB"`` -> 1610612736; a unit is required (B, kB, KiB, MB, MiB, GB, GiB, TB,
    TiB). ``what`` names the value in the error (an option, a flag); ``zero``: 0 bytes is
    a valid answer (a budget of nothing)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or not m.group(2) or m.group(2).lower() not in UNITS:
        why = ("has no unit" if m and not m.group(2) else
               "has an unknown unit" if m else "is not a memory size")
        raise ValueError(f"{what} {text!r} {why}; write it with a unit, e.g. 1.5GiB "
                         f"(2^30 bytes) or 1.5GB (10^9 bytes); units: {_NAMES}")
    value = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{what} {text!r} must be more than 0 bytes, e.g. 1.5GiB")
    return value
