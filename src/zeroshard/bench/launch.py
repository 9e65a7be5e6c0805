"""Start the ranks: reuse torchrun's when launched by it, else start local ones ourselves.

Without ``RANK``/``WORLD_SIZE`` in the environment, :func:`launch` does what ``torchrun
--standalone --nproc-per-node N`` does, in-process: torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``) with a c10d rendezvous on a free
local port spawns N ranks running :func:`~zeroshard.bench.worker.rank_main`, and returns
rank 0's result. Under torchrun the current process *is* a rank and runs it directly.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from zeroshard.bench.configs import BenchSettings

__all__ = ["free_port", "launch", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(settings: BenchSettings, *, progress: bool = True) -> dict[str, Any] | None:
    """Run the benchmark on every rank; rank 0's result (None on other torchrun ranks)."""
    from zeroshard.bench.worker import rank_main

    if under_torchrun():
        return rank_main(settings, progress)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=settings.world_size,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        run_id=f"zeroshard-bench-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # The ranks share this machine's cores; one OpenMP pool per rank would oversubscribe.
    threads = max(1, (os.cpu_count() or 1) // settings.world_size)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = old or str(threads)
    try:
        results = elastic_launch(config, rank_main)(settings, progress)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results[0]
