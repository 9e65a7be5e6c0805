"""Imported once by the rank server that :func:`zeroshard.launch.run_ranks_local` forks
its ranks from (see [Note: forked ranks] in launch.py), before it forks any.

It records the server's environment first: a rank forked from the server starts with
*that* environment, and :func:`restore_parent_env` turns it into what a spawned rank
would have had (the launching process's environment when it launched, plus what torch's
elastic agent set for the rank).
"""

from __future__ import annotations

import os

#: The server's environment when it started, and its pid (a module imported in a rank
#: itself, because some other code started the server, has nothing to compare against).
SERVER_ENV: dict[str, str] = dict(os.environ)
SERVER_PID = os.getpid()

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  DTensor's constructor imports it on first use
import torch.distributed  # noqa: E402,F401

import zeroshard  # noqa: E402,F401


def restore_parent_env(parent: dict[str, str]) -> None:
    """Make this rank's environment the launching process's ``parent``, plus the variables
    the elastic agent set for this rank (those that differ from the server's)."""
    if os.getpid() == SERVER_PID:  # not forked from a server that imported this module
        for key, value in parent.items():
            os.environ.setdefault(key, value)
        return
    agent = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(parent)
    os.environ.update(agent)
