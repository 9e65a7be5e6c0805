"""Train a small GPT with the Lightning Trainer, on zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/lightning_trainer.py --strategy zeroshard_stage_3 --out /tmp/lt
    torchrun --nproc-per-node 2 examples/integrations/lightning_trainer.py --strategy ddp --out /tmp/lt-ddp

The one line that changes is the Trainer's ``strategy=`` (after ``import
zeroshard.integrations.lightning_trainer``, which registers the names). The run
accumulates 2 batches per step, clips at norm 1, decays the learning rate, checkpoints
with ModelCheckpoint at step 3 and resumes from it with ``--resume`` (or from any
checkpoint, another strategy's too, with ``--resume-from``); rank 0 writes each step's loss
and gradient norm (the global one) to ``--out/logs.json``. ``--test-from CKPT`` only
tests the model a checkpoint holds. A zeroshard checkpoint (a directory) becomes the
one-file ``.ckpt`` that ``--strategy ddp`` and ``LitGPT.load_from_checkpoint`` read with
``zeroshard consolidate DIR OUT.ckpt --lightning``.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F

import zeroshard.integrations.lightning_trainer  # noqa: F401  (registers "zeroshard...")
from zeroshard.data import SyntheticLanguage
from zeroshard.models import build_model, get_preset


class Tokens(torch.utils.data.Dataset):
    """24 rows: per rank 12, in batches of 2 accumulated by 2: an epoch is 3 optimizer steps,
    so the step-3 checkpoint sits at an epoch's end (Lightning restarts a plain DataLoader's
    epoch on resume: a checkpoint mid-epoch would see the epoch's first batches again)."""

    def __init__(self, n: int = 24, seq: int = 17) -> None:
        self.rows = SyntheticLanguage(get_preset("gpt2-tiny").vocab, seq, seed=1).batch(0, n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("gpt2-tiny", seed=0)
        self.history: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        self._loss = loss.detach()
        return loss

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        self.log("test_loss", loss, sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor: global
        self.history.append({"step": self.global_step + 1, "loss": self._loss.item(),
                             "grad_norm": norm.item()})

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def init_inner(module: L.LightningModule, names: list[str]) -> None:
    """``param_init`` for LitGPT on the meta device: the GPT's own init, by name."""
    from zeroshard.models import init_weights

    init_weights(module.model, 0, [n.removeprefix("model.") for n in names])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="zeroshard_stage_2")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="resume from the step-3 checkpoint")
    p.add_argument("--resume-from", metavar="CKPT",
                   help="resume from this checkpoint (another strategy's too: DDP's .ckpt)")
    p.add_argument("--test-from", metavar="CKPT",
                   help="no training: trainer.test(ckpt_path=CKPT); returns the metrics")
    p.add_argument("--state-dict-type", default="sharded", choices=("sharded", "full"))
    p.add_argument("--empty-init", action="store_true",
                   help="build the model on the meta device (stage 3: materialised per unit)")
    a = p.parse_args(argv)
    strategy: object = a.strategy
    if a.strategy.startswith("zeroshard") and (a.state_dict_type == "full" or a.empty_init):
        from zeroshard.integrations.lightning_trainer import ZeroShardStrategy

        # a model built on the meta device is initialised unit by unit: here with the init
        # of zeroshard's reference GPT (the LightningModule holds it as .model)
        strategy = ZeroShardStrategy(stage=int(a.strategy[-1]), state_dict_type=a.state_dict_type,
                                     param_init=init_inner if a.empty_init else None)
    L.seed_everything(0, verbose=False)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{a.out}/ckpt", every_n_train_steps=3,
                                              save_top_k=-1, filename="step-{step}")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        precision=a.precision, max_steps=a.steps, accumulate_grad_batches=2,
                        gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt],
                        use_distributed_sampler=True)
    with trainer.init_module(empty_init=a.empty_init):
        module = LitGPT()
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    if a.test_from:
        return trainer.test(module, loader, ckpt_path=a.test_from, verbose=False)
    resume = a.resume_from or (f"{a.out}/ckpt/step-step=3.ckpt" if a.resume else None)
    trainer.fit(module, loader, ckpt_path=resume)
    if trainer.is_global_zero:
        with open(f"{a.out}/logs.json", "w") as f:
            json.dump(module.history, f)
    return module.history


if __name__ == "__main__":
    main()
