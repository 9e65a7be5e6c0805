"""Imported once by the rank server that :func:`zeroshard.launch.run_ranks_local` forks
its ranks from (see [Note: forked ranks] in launch.py), before it forks any.

It records the server's environment first: a rank forked from the server starts with
*that* environment, and :func:`restore_parent_env` turns it into what a spawned rank
would have had (the launching process's environment when it launched, plus what torch's
elastic agent set for the rank).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

#: The server's environment before it imported anything, and its pid (a module imported
#: in a rank itself, because some other code started the server, has no record).
SERVER_ENV: dict[str, str] = dict(os.environ)
SERVER_PID = os.getpid()

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  DTensor's constructor imports it on first use
import torch.distributed  # noqa: E402,F401

import zeroshard  # noqa: E402,F401

# More modules to import here once instead of in every rank that uses them
# (comma-separated): the test suite names the integrations its ranks import
# (transformers' Trainer, Lightning, peft, TRL: 2-3 s of CPU per rank each). One that
# fails to import is skipped: the server must start; a rank that needs it fails there.
for _name in filter(None, os.environ.get("ZEROSHARD_RANK_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_name.strip())
    except Exception as exc:
        print(f"zeroshard rank server: not preloading {_name!r}: {exc!r}", file=sys.stderr)

#: What torch's elastic agent sets for each worker (LocalElasticAgent._start_workers, and
#: elastic_launch's TORCHELASTIC_* settings): taken from the rank's own environment.
AGENT_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"})


def _by_agent(key: str) -> bool:
    return key in AGENT_KEYS or key.startswith("TORCHELASTIC_")


def restore_parent_env(parent: dict[str, str]) -> None:
    """Make this rank's environment the launching process's ``parent`` plus the
    variables the elastic agent set for this rank; a variable the server's own imports
    set (not in ``SERVER_ENV``) stays only where ``parent`` lacks it."""
    now = dict(os.environ)
    agent = {k: v for k, v in now.items() if _by_agent(k)}
    forked = os.getpid() != SERVER_PID  # else: some other code's server, no record
    imported = ({k: v for k, v in now.items() if k not in SERVER_ENV and not _by_agent(k)}
                if forked else {})
    os.environ.clear()
    os.environ.update(imported)
    os.environ.update(parent)
    os.environ.update(agent)
    tempfile.tempdir = None  # read TMPDIR again: the server cached its own
