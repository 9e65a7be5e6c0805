"""Test helpers: run code on several CPU ranks (see :mod:`zeroshard.testing.multiprocess`)."""

from __future__ import annotations

from zeroshard.testing.multiprocess import RankError, RankTimeout, SweepError, run_ranks, sweep

__all__ = ["RankError", "RankTimeout", "SweepError", "run_ranks", "sweep"]
