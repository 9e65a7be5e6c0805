"""Two torchrun agents on one machine = 2 nodes x 2 ranks, c10d rendezvous on loopback.

This is how zeroshard runs on a real cluster (one agent per node, see docs/hybrid.md);
here both "nodes" are this machine. Hybrid sharding keeps each shard group inside a node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _training import rel_diffs, train_reference

from zeroshard.launch import free_port

HERE = Path(__file__).parent


def test_two_torchrun_agents_hybrid_stage3(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zs-multinode",
           "--max-restarts", "0", str(HERE / "_hybrid_worker.py"), str(tmp_path), "3"]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for _ in range(2)]
    outs = []
    for a in agents:
        try:
            out, _ = a.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
        outs.append(out.decode(errors="replace"))
    assert all(a.returncode == 0 for a in agents), "\n---\n".join(o[-3000:] for o in outs)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    nodes = {r["layout"]["GROUP_RANK"] for r in results}
    assert nodes == {"0", "1"} and all(r["layout"]["LOCAL_WORLD_SIZE"] == "2" for r in results)
    ref = train_reference()
    # the batch summed in as many parts as the 4 ranks sum it (see tests/test_parity.py)
    yard = rel_diffs(train_reference(split=4), ref)
    for r in results:
        for name, dev in rel_diffs(r["state"], ref).items():
            assert dev <= max(1e-5, 3 * yard[name]), (name, dev)
