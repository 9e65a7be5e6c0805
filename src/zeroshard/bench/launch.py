"""Start the benchmark's ranks (see :mod:`zeroshard.launch`)."""

from __future__ import annotations

from typing import Any

from zeroshard.bench.configs import BenchSettings
from zeroshard.launch import run_ranks_local

__all__ = ["launch"]


def launch(settings: BenchSettings, *, progress: bool = True) -> dict[str, Any] | None:
    """Run the benchmark on every rank; rank 0's result (None on other torchrun ranks)."""
    from zeroshard.bench.worker import rank_main

    return run_ranks_local(rank_main, settings.world_size, settings, progress,
                           name="zeroshard-bench")
