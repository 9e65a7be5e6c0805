"""Test helpers: run code on several CPU ranks (see :mod:`zeroshard.testing.multiprocess`)."""

from __future__ import annotations

from zeroshard.testing.errors import RankError, RankTimeout, SweepError
from zeroshard.testing.multiprocess import run_ranks, sweep
from zeroshard.testing.rank_pool import kept_processes
from zeroshard.testing.supervise import rank_cpu_seconds

__all__ = ["RankError", "RankTimeout", "SweepError", "kept_processes", "rank_cpu_seconds",
           "run_ranks", "sweep"]
