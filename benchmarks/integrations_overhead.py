"""What a step through each trainer integration costs beyond zeroshard in a plain loop.

    .venv/bin/python benchmarks/integrations_overhead.py [--steps 8] [--rounds 3] [--stage 2]

On 2 CPU ranks (gloo), the same model (gpt2-small from zeroshard.models, AdamW, global
batch 4 x 128 tokens, clipping at norm 1) trains under: a plain zeroshard loop, the HF
``ZeroShardTrainer``, Lightning Fabric and the Lightning Trainer with ``ZeroShardStrategy``.
Each run times its steps (the trainers through their own step callbacks, from one step's
start to the next's); the four run in turn, ``--rounds`` times, in the same processes, so
the machine's drift hits all alike. Prints the median step time of each and its ratio to
the plain loop's (rank 0). Results: benchmarks/integrations-overhead.txt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

MODEL, SEQ, BATCH = "gpt2-small", 128, 2  # per rank


class _LM(torch.nn.Module):
    """input_ids (and labels) -> loss, as the HF Trainer expects of a model."""

    def __init__(self) -> None:
        super().__init__()
        from zeroshard.models import build_model

        self.model = build_model(MODEL, seed=0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.model(input_ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), input_ids[:, 1:].flatten())
        return {"loss": loss}


def _rows(n: int) -> torch.Tensor:
    from zeroshard.data import SyntheticLanguage
    from zeroshard.models import get_preset

    return SyntheticLanguage(get_preset(MODEL).vocab, SEQ + 1, seed=1).batch(0, n)


def plain(rank: int, world: int, steps: int, stage: int) -> list[float]:
    import zeroshard

    model, opt = zeroshard.shard(_LM(), torch.optim.AdamW, stage=stage, lr=1e-4)
    rows = _rows(BATCH * world * (steps + 1))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        x = rows[(i * world + rank) * BATCH:(i * world + rank + 1) * BATCH]
        model(x)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return times[1:]


def hf(rank: int, world: int, steps: int, stage: int) -> list[float]:
    import tempfile

    import transformers

    from zeroshard.integrations.hf_trainer import ZeroShardTrainer

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter())

    rows = _rows(BATCH * world * (steps + 1))
    data = [{"input_ids": r} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=steps + 1, per_device_train_batch_size=BATCH,
        learning_rate=1e-4, max_grad_norm=1.0, logging_steps=10**6, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = ZeroShardTrainer(model=_LM(), args=args, train_dataset=data,
                               zeroshard={"stage": stage}, callbacks=[Clock()])
    trainer.train()
    times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]


def fabric(rank: int, world: int, steps: int, stage: int) -> list[float]:
    import lightning as L

    import zeroshard.integrations.lightning_fabric  # noqa: F401

    f = L.Fabric(accelerator="cpu", devices=world, strategy=f"zeroshard_stage_{stage}")
    f.launch()
    lm = _LM()
    model, opt = f.setup(lm, torch.optim.AdamW(lm.parameters(), lr=1e-4))
    rows = _rows(BATCH * world * (steps + 1))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        x = rows[(i * world + rank) * BATCH:(i * world + rank + 1) * BATCH]
        f.backward(model(x)["loss"])
        f.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return times[1:]


def lightning_trainer(rank: int, world: int, steps: int, stage: int) -> list[float]:
    import lightning as L

    import zeroshard.integrations.lightning_trainer  # noqa: F401

    times: list[float] = []

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = _LM()

        def forward(self, x: torch.Tensor) -> Any:
            return self.lm(x)

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            return self(batch)["loss"]

        def on_train_batch_start(self, *a: Any) -> None:
            times.append(time.perf_counter())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    rows = _rows(BATCH * world * (steps + 1))
    loader = torch.utils.data.DataLoader(list(rows), batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=f"zeroshard_stage_{stage}",
                        max_steps=steps + 1, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Lit(), loader)
    times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]


RUNS = {"plain": plain, "hf": hf, "fabric": fabric, "lightning": lightning_trainer}


def _rank(rank: int, world: int, steps: int, rounds: int, stage: int) -> dict[str, list[float]]:
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    out: dict[str, list[float]] = {k: [] for k in RUNS}
    for r in range(rounds):
        order = list(RUNS) if r % 2 == 0 else list(RUNS)[::-1]
        for name in order:
            out[name] += RUNS[name](rank, world, steps, stage)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stage", type=int, default=2)
    a = p.parse_args()
    from zeroshard.testing import run_ranks

    t = run_ranks(_rank, 2, a.steps, a.rounds, a.stage, timeout=7200,
                  env={"HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"})[0]
    base = statistics.median(t["plain"])
    print(f"{MODEL}, seq {SEQ}, 2 ranks x {BATCH} rows, stage {a.stage}, AdamW, clipping; "
          f"{a.rounds} rounds x {a.steps} steps each, runs alternating (rank 0)")
    for name, v in t.items():
        m = statistics.median(v)
        print(f"  {name:<10} {m * 1e3:8.1f} ms   / plain loop: {m / base:.3f}")


if __name__ == "__main__":
    main()
