"""Imported once by the rank server before it forks any rank (see rank_start.py).

Importing this module changes the process's environment: it is meant for the server only.

``ZEROSHARD_RANK_PRELOAD`` (comma-separated module names) adds modules to import once
here (see zeroshard/launch_preload.py, which imports them: whichever of the harness and
the launcher starts the server first, both get them).
"""

from __future__ import annotations

import os

# Before torch: the OpenMP runtime reads these when it loads; each rank also sets
# torch.set_num_threads(1) (rank_main.py).
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

# torch, DTensor's dynamo and zeroshard, recording this environment first (the launcher's
# preload, zeroshard/launch.py: a `zeroshard bench` run inside a test forks its ranks
# from this same server).
import zeroshard.launch_preload  # noqa: E402,F401
import zeroshard.testing.rank_main  # noqa: E402,F401
