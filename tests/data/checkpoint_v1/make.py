"""How tests/data/checkpoint_v1 was written: zeroshard's version-1 checkpoint writer
(1-D flattened ShardedTensor pieces) at commit 83f4139. Kept as a record; the current
writer writes version 2, so running this now writes version-2 checkpoints."""
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset
from zeroshard.state import full_optimizer_state, save_checkpoint
from zeroshard.testing import run_ranks

OUT = Path(__file__).resolve().parent
GPT2 = dataclasses.replace(get_preset("gpt2-tiny"), n_layers=1, hidden=16, n_heads=2,
                           seq_len=16, vocab=37)
LLAMA = dataclasses.replace(get_preset("llama-tiny"), n_layers=1, hidden=16, n_heads=4,
                            n_kv_heads=2, seq_len=16, vocab=37, intermediate=24)
TP_LLAMA = dataclasses.replace(LLAMA, n_kv_heads=4, seq_len=32)


def plain(rank: int, world: int) -> None:
    for name, cfg, stage, freeze in [("gpt2-s2", GPT2, 2, None),
                                     ("llama-frozen-s3", LLAMA, 3, "blocks.0.attn.q_proj.weight")]:
        model = build_model(cfg, seed=0)
        if freeze:
            model.get_parameter(freeze).requires_grad_(False)
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                       weight_decay=0.1)
        data = TokenLoader(SyntheticLanguage(cfg.vocab, 4, seed=1), global_batch=4, rank=rank,
                           world_size=world)
        for _ in range(3):
            x, y = next(data)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            optim.step()
            optim.zero_grad()
        save_checkpoint(OUT / name, model, optim, extra={"data": data.state_dict(), "step": 3})
        full, opt = zeroshard.full_state_dict(model), full_optimizer_state(model, optim)
        if rank == 0:
            torch.save({"model": full, "optim": opt}, OUT / f"{name}.expected.pt")


def tp(rank: int, world: int) -> None:
    sys.path.insert(0, str(OUT.parent.parent))
    from _tp import backward, batch, dp_coordinate, parallelize_llama, tp_loss, tp_mesh

    torch.manual_seed(0)
    model = build_model(TP_LLAMA)
    mesh = tp_mesh("dp2xtp2")
    parallelize_llama(model, mesh["tp"])
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=3, mesh=mesh, lr=1e-2)
    d, dp = dp_coordinate(mesh)
    for step in range(2):
        idx, y = batch(step, TP_LLAMA.vocab)
        per = len(idx) // dp
        backward(tp_loss(model, idx[d * per:(d + 1) * per], y[d * per:(d + 1) * per]))
        optim.step()
        optim.zero_grad()
    save_checkpoint(OUT / "tp-dp2xtp2-s3", model, optim, extra={"step": 2})
    full, opt = zeroshard.full_state_dict(model), full_optimizer_state(model, optim)
    if rank == 0:
        torch.save({"model": full, "optim": opt}, OUT / "tp-dp2xtp2-s3.expected.pt")


if __name__ == "__main__":
    run_ranks(plain, 2, timeout=300)
    run_ranks(tp, 4, timeout=300)
