"""Imported once by the rank server before it forks any rank (see rank_start.py).

Importing this module changes the process's environment: it is meant for the server only.

``ZEROSHARD_RANK_PRELOAD`` (comma-separated module names) adds modules to import here,
once, instead of in every rank that uses them: the test suite names the integrations its
ranks import (transformers' Trainer, Lightning, peft, TRL: 2-3 s of CPU per rank each).
A module that is not installed is skipped; a rank that needs it fails there, as without.
"""

from __future__ import annotations

import importlib
import os
import sys

# Before torch: the OpenMP runtime reads these when it loads; each rank also sets
# torch.set_num_threads(1) (rank_main.py).
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

# torch, DTensor's dynamo and zeroshard, recording this environment first (the launcher's
# preload, zeroshard/launch.py: a `zeroshard bench` run inside a test forks its ranks
# from this same server).
import zeroshard.launch_preload  # noqa: E402,F401
import zeroshard.testing.rank_main  # noqa: E402,F401

for _name in filter(None, os.environ.get("ZEROSHARD_RANK_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_name.strip())
    except Exception as exc:  # the server must start: a rank that needs it fails there
        print(f"zeroshard rank server: not preloading {_name!r}: {exc!r}", file=sys.stderr)
