"""Start ranks the way torchrun does, from inside a command — or reuse torchrun's.

Without ``RANK``/``WORLD_SIZE`` in the environment, :func:`run_ranks_local` does what
``torchrun --standalone --nproc-per-node N`` does, in-process: torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``) with a c10d rendezvous on a free
local port spawns N ranks running ``fn(*args)`` and returns rank 0's result. Under
torchrun the current process *is* a rank and runs ``fn`` directly. ``fn`` initialises
its own process group from the environment (``init_process_group(backend)``).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "run_ranks_local", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks_local(fn: Callable[..., Any], world_size: int, *args: Any,
                    name: str = "zeroshard") -> Any:
    """Rank 0's ``fn(*args)`` (None on other torchrun ranks)."""
    if under_torchrun():
        return fn(*args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # The ranks share this machine's cores; one OpenMP pool per rank would oversubscribe.
    threads = max(1, (os.cpu_count() or 1) // world_size)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = old or str(threads)
    try:
        results = elastic_launch(config, fn)(*args)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results[0]
