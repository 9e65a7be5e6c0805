"""The Lightning Trainer with two optimizers (manual optimisation: Muon for the hidden
matrices, AdamW for the rest, from ``configure_optimizers``) on the zeroshard strategy:
the strategy shards the model with both (``shard(model, (muon, adamw))``, see [Note:
several optimizers] in engine/composite.py). World 2: the per-step losses and the final
weights equal Lightning's DDP strategy's with the same module (a sum of two gradients is
order-free: bit for bit), at stages 0 and 3; a sharded checkpoint of the stage-3 run
resumed at stage 3, and converted to Lightning's one-file format and resumed under DDP,
continues as the uninterrupted run. Fabric (``fabric.setup(model, muon, adamw)``): the
same, with ``fabric.save``/``fabric.load``.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from zeroshard.testing import run_ranks

STEPS = 6  # Lightning's global steps: one per optimizer step, 2 per batch


def _module_class():
    import lightning as L
    import torch.nn.functional as F

    from zeroshard.models import build_model

    class TwoOptimizers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model = build_model("llama-tiny", seed=0)
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            x, y = batch[:, :-1], batch[:, 1:]
            loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
            self.losses.append(loss.item())

        def configure_optimizers(self):
            hidden = [p for n, p in self.model.named_parameters()
                      if p.ndim == 2 and not n.startswith(("tok_emb", "lm_head"))]
            rest = [p for p in self.parameters() if not any(p is q for q in hidden)]
            return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]

    return TwoOptimizers


def _fit(strategy: str, root: str, steps: int = STEPS, resume: str | None = None,
         save: bool = False) -> dict:
    import lightning as L

    import zeroshard
    import zeroshard.integrations.lightning_trainer  # noqa: F401  (registers the names)
    from zeroshard.data import SyntheticLanguage
    from zeroshard.models import get_preset

    # 4 rows: one batch of 2 per rank, an epoch per batch, so each checkpoint sits at an
    # epoch's end (Lightning restarts a plain DataLoader's epoch on resume)
    rows = SyntheticLanguage(get_preset("llama-tiny").vocab, 17, seed=1).batch(0, 4)
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
    L.seed_everything(0, verbose=False)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1,
        filename="step-{step}")] if save else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=save, callbacks=callbacks)
    module = _module_class()()
    trainer.fit(module, loader, ckpt_path=resume)
    model = module.model
    weights = (zeroshard.full_state_dict(module)
               if getattr(module, "_zeroshard_engine", None) is not None
               else {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": module.losses, "weights": weights}


def _run(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    out = {"ddp": _fit("ddp", f"{root}/ddp")}
    for stage in (0, 3):
        out[stage] = _fit(f"zeroshard_stage_{stage}", f"{root}/s{stage}", save=stage == 3)
    ckpt = f"{root}/s3/ckpt/step-step=2.ckpt"  # after the first batch
    out["resumed"] = _fit("zeroshard_stage_3", f"{root}/r", resume=ckpt)
    # the same checkpoint as Lightning's one file (an optimizer state per optimizer),
    # resumed under DDP
    one = f"{root}/converted.ckpt"
    if rank == 0:
        from zeroshard.integrations.lightning_checkpoint import to_lightning_checkpoint

        to_lightning_checkpoint(ckpt, one)
    torch.distributed.barrier()
    out["to_ddp"] = _fit("ddp", f"{root}/d", resume=one)
    return out


@functools.cache
def _results() -> dict:
    root = tempfile.mkdtemp(prefix="zs-lt2-")  # one folder for both ranks
    return run_ranks(_run, 2, root, timeout=600)[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_two_optimizers_train_as_under_ddp(stage: int) -> None:
    out = _results()
    assert out[stage]["losses"] == out["ddp"]["losses"]
    for name, w in out["ddp"]["weights"].items():
        assert torch.equal(out[stage]["weights"][name], w), name


@pytest.mark.parametrize("run", ["resumed", "to_ddp"])
def test_checkpoint_resume_continues_the_run(run: str) -> None:
    """The stage-3 run's step-2 checkpoint resumed at stage 3, and (converted to
    Lightning's one file) under DDP: the uninterrupted run's weights."""
    out = _results()
    for name, w in out[3]["weights"].items():
        assert torch.equal(out[run]["weights"][name], w), name


def _fabric(rank: int, world: int, root: str, strategy: str, resume: bool = False) -> dict:
    """Fabric with two optimizers (fabric.setup(model, muon, adamw)): 4 steps, a
    fabric.save of both at step 2; ``resume``: load it and run steps 3-4 instead."""
    import warnings

    import lightning as L
    import torch.nn.functional as F

    import zeroshard
    import zeroshard.integrations.lightning_fabric  # noqa: F401  (registers the names)
    from zeroshard.data import SyntheticLanguage
    from zeroshard.models import build_model, get_preset

    warnings.filterwarnings("ignore")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = build_model("llama-tiny", seed=0)
    hidden = [p for n, p in model.named_parameters()
              if p.ndim == 2 and not n.startswith(("tok_emb", "lm_head"))]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    model, muon, adamw = fabric.setup(model, torch.optim.Muon(hidden, lr=0.02),
                                      torch.optim.AdamW(rest, lr=3e-3))
    rows = SyntheticLanguage(get_preset("llama-tiny").vocab, 17, seed=1).batch(0, 16)
    state = {"model": model, "muon": muon, "adamw": adamw, "step": 0}
    start = 0
    if resume:
        fabric.load(f"{root}/fabric-ckpt", state)
        start = state["step"]
    for step in range(start, 4):
        batch = rows[(2 * step + rank) * 2 : (2 * step + rank) * 2 + 2]
        x, y = batch[:, :-1], batch[:, 1:]
        fabric.backward(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()))
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        if step == 1 and not resume:
            state["step"] = 2
            fabric.save(f"{root}/fabric-ckpt", state)
    module = getattr(model, "module", model)
    if getattr(module, "_zeroshard_engine", None) is not None:
        return zeroshard.full_state_dict(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fabric_all(rank: int, world: int, root: str) -> dict:
    return {"ddp": _fabric(rank, world, root, "ddp"),
            "s3": _fabric(rank, world, root, "zeroshard_stage_3"),
            "resumed": _fabric(rank, world, root, "zeroshard_stage_3", resume=True)}


def test_fabric_with_two_optimizers() -> None:
    """fabric.setup(model, muon, adamw) at stage 3: DDP's weights bit for bit; a
    fabric.save of both optimizers at step 2, loaded, continues the run."""
    root = tempfile.mkdtemp(prefix="zs-fabric2-")
    out = run_ranks(_fabric_all, 2, root, timeout=600)[0]
    for name, w in out["ddp"].items():
        assert torch.equal(out["s3"][name], w), name
        assert torch.equal(out["resumed"][name], w), name
