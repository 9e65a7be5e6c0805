"""Run by tests/test_multinode.py under two torchrun agents (2 "nodes" x 2 ranks).

Trains the tiny GPT with hybrid sharding (2 replicas x 2 shards, one shard group per
node) and writes rank 0's full state and what the launcher said about the layout.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _training import train_sharded  # noqa: E402


def main(out_dir: str, stage: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = train_sharded(rank, world, stage=stage, hybrid=(2, 2))
    layout = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK",
                                              "LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    torch.save({"state": state, "layout": layout}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
