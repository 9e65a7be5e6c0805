"""Bytes by category: now, at the moment their total was highest, and each category's own
maximum. The tracker keeps one for all memory and one per location (device, host; see
[Note: device and host] in tracker.py)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["Tally"]


class Tally:
    """Running byte counts by key, with the breakdown at the peak of their total.

    The peak is a whole breakdown taken at one moment (what coexisted), the maxima are
    per key and may come from different moments (see [Note: categories are resolved
    late] in tracker.py)."""

    __slots__ = ("now", "total", "peak", "peak_total", "max")

    def __init__(self, keys: Iterable[Hashable]) -> None:
        self.now = dict.fromkeys(keys, 0)
        self.total = 0
        self.peak, self.peak_total = dict(self.now), 0
        self.max = dict(self.now)

    def add(self, key: Hashable, delta: int) -> None:
        self.now[key] += delta
        self.total += delta

    def update_peak(self) -> None:
        if self.total > self.peak_total:
            self.peak_total, self.peak = self.total, dict(self.now)

    def update_max(self) -> None:
        for key, v in self.now.items():
            if v > self.max[key]:
                self.max[key] = v

    def reset_peak(self) -> None:
        """Peak from now on; maxima restart from zero."""
        self.peak, self.peak_total = dict(self.now), self.total
        self.max = dict.fromkeys(self.now, 0)
