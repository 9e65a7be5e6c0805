"""How tests/data/checkpoint_53083dd was written: zeroshard at commit 53083dd (the main
before torch's DCP API answered with DTensor shards and before async saves), world 2:

* ``zs-s3``: ``zeroshard.save_checkpoint`` of a tiny GPT-2 at stage 3 after 3 AdamW steps;
* ``dcp-s3``: the same model's ``get_state_dict`` + ``dcp.save`` (at 53083dd every rank's
  values were whole tensors);

each with ``<name>.expected.pt``: the whole weights and optimizer state when saved.
Run with that commit's source first on the path:

    git worktree add /tmp/main53 53083dd
    PYTHONPATH=/tmp/main53/src python tests/data/checkpoint_53083dd/make.py
"""
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset
from zeroshard.state import full_optimizer_state, save_checkpoint
from zeroshard.testing import run_ranks

OUT = Path(__file__).resolve().parent
GPT2 = dataclasses.replace(get_preset("gpt2-tiny"), n_layers=2, hidden=16, n_heads=2,
                           seq_len=16, vocab=37)


def write(rank: int, world: int) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = zeroshard.shard(build_model(GPT2, seed=0), torch.optim.AdamW, stage=3,
                                   lr=1e-2, weight_decay=0.1)
    data = TokenLoader(SyntheticLanguage(GPT2.vocab, 4, seed=1), global_batch=4, rank=rank,
                       world_size=world)
    for _ in range(3):
        x, y = next(data)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optim.step()
        optim.zero_grad()
    save_checkpoint(OUT / "zs-s3", model, optim, extra={"step": 3})
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(OUT / "dcp-s3"))
    full, opt = zeroshard.full_state_dict(model), full_optimizer_state(model, optim)
    if rank == 0:
        for name in ("zs-s3", "dcp-s3"):
            torch.save({"model": full, "optim": opt}, OUT / f"{name}.expected.pt")
    return zeroshard.__file__


if __name__ == "__main__":
    print(run_ranks(write, 2, timeout=300))
