"""Shared pytest setup. Multi-process tests use :func:`zeroshard.testing.run_ranks`."""

from __future__ import annotations

import atexit
import getpass
import os
import shutil
import tempfile

from _timing import TimingPlugin

# 2 cores shared by the test process and up to 4 ranks: one OpenMP thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The rank server (zeroshard/testing/rank_start.py) imports the integrations once, so the
# ranks of the HF, TRL, peft and Lightning tests fork with them loaded instead of each
# importing them again (2-3 s of CPU per rank). The hub is offline and transformers quiet
# for every process of the run: the server reads both when it imports them.
os.environ.setdefault("ZEROSHARD_RANK_PRELOAD",
                      "transformers.trainer,peft,lightning.pytorch,accelerate,trl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# torch.compile's kernel cache stays where it was (it lives in the temp folder by default):
# the inductor tests would otherwise compile from scratch on every run.
try:
    _USER = getpass.getuser()
except (KeyError, OSError):  # a uid with no passwd entry (some containers)
    _USER = str(os.getuid())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{_USER}"))
# Every temporary file of the session (module-level caches' folders, torchrun's
# torchelastic_* log folders, ranks' scratch) goes under one folder removed at exit: a
# run used to leave ~200 MB in /tmp (trainer and Lightning checkpoints). Short on
# purpose: multiprocessing's forkserver puts a unix socket (<= 107 bytes) under it.
# Under pytest-xdist the workers inherit the controller's folder and nest their own.
_SCRATCH = tempfile.mkdtemp(prefix="zs-tests-")
os.environ["TMPDIR"] = _SCRATCH
tempfile.tempdir = None  # tempfile caches its folder: read TMPDIR again
atexit.register(shutil.rmtree, _SCRATCH, True)


def pytest_configure(config) -> None:
    # Each test's wall and CPU time, and the run's worst waits: tests/_timing.py.
    config.pluginmanager.register(TimingPlugin(worker=hasattr(config, "workerinput")),
                                  "zeroshard-timing")
