"""Imported once by the rank server before it forks any rank (see rank_start.py).

Importing this module changes the process's environment: it is meant for the server only.
"""

from __future__ import annotations

import os

# Before torch: the OpenMP runtime reads these when it loads; each rank also sets
# torch.set_num_threads(1) (rank_main.py).
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  DTensor's constructor imports it on first use
import torch.distributed  # noqa: E402,F401

import zeroshard  # noqa: E402,F401
import zeroshard.testing.rank_main  # noqa: E402,F401
