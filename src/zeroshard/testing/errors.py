"""What the multi-process harness raises in the test process."""

from __future__ import annotations

__all__ = ["RankError", "RankTimeout", "SweepError"]


class RankError(RuntimeError):
    """A rank raised, crashed or exited early. ``rank`` is the one blamed first."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError):
    """The group did not finish in time. ``unfinished`` lists the ranks still running."""

    def __init__(self, message: str, unfinished: list[int]) -> None:
        super().__init__(message, unfinished[0] if unfinished else -1)
        self.unfinished = unfinished


class SweepError(RuntimeError):
    """A grid point of :func:`~zeroshard.testing.sweep` failed; the original exception is
    ``__cause__``."""
