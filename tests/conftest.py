"""Shared pytest setup. Multi-process tests use :func:`zeroshard.testing.run_ranks`."""

from __future__ import annotations

import os

# 2 cores shared by the test process and up to 4 ranks: one OpenMP thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
