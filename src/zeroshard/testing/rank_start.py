"""How rank processes start: forked from a server that imported torch once.

Starting a rank with the *spawn* method costs an interpreter plus ``import torch``,
``torch._dynamo`` (DTensor's constructor imports it) and zeroshard: ~7 s of CPU on our
2-core machines, more than most distributed tests run, and every fresh rank, every pool
and every pool evicted and started again paid it. The harness uses multiprocessing's
*forkserver* instead: one server process, started on the first call, imports those
modules once (:mod:`zeroshard.testing.rank_preload`), and every rank is forked from it in
~0.1 s, sharing the imported pages copy-on-write.

Forking from the test process itself would copy pytest's state, torch thread pools and
locks held by other threads; the server is a clean single-purpose process that has only
imported modules and never run an op, so its children start as a spawned rank would. What
is read at import time by torch and zeroshard comes from the environment the server
started with (the test process's, with one OpenMP thread); a call's ``env`` is set in the
rank before the call runs, so modules it imports later (transformers) read it there.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

__all__ = ["rank_context"]

_PRELOAD = ["zeroshard.testing.rank_preload"]


def rank_context() -> BaseContext:
    """The multiprocessing context every rank process is started with."""
    ctx = mp.get_context("forkserver")
    # Takes effect when the server starts (the first rank); a server some other code
    # started earlier keeps its own preload list, and its ranks import torch themselves.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx
