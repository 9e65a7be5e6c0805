"""Generation at stage 3: milliseconds per generated token, interleaved call by call, on
2 CPU ranks (gloo). A Hugging Face GPT-2 with zeroshard's gpt2-small preset's shape
(8 layers, hidden 512, 8 heads, vocab 256: 9 units with the root), random weights,
prompt 32 tokens, 64 new tokens, greedy, batch 2 per rank. Rows:

* ``stage 0``            — whole weights on every rank (DDP's memory);
* ``s3 per token``       — stage 3, ``generate_budget=0``: every unit gathered per token;
* ``s3 gathered``        — stage 3, the default: every unit gathered once per call;
* ``s3 half budget``     — stage 3, ``generate_budget`` = half the gathered model: the
  units that fit are gathered once, the rest per token.

Prints rank 0's median ms per token per row, its ratio to stage 0, the all-gathers per
call, and the tracker's peak parameter bytes (shards + gathered) during a call
(benchmarks/generate.txt). Every row must produce stage 0's tokens (checked).

Then RL: TRL's GRPOTrainer (examples/integrations/trl_grpo.py: generation, a reward, a
reference model with ``beta`` 0.1 soft-updated every step), ``GRPO_STEPS`` steps per run,
DDP and zeroshard stage 3 alternating in the same two ranks for ``GRPO_ROUNDS`` rounds:
the median seconds per step of each, the median of the per-round ratios, and the
reference model's bytes per rank — on the example's tiny Llama (2 x 64: latency-bound)
and on a Llama of the gpt2-small preset's shape (8 x 512); stage 3 as it comes, and with
``reshard_after_forward=False`` (FSDP2's setting: units stay gathered from a forward to
its backward, and after the scoring's no_grad forwards, until the step). Every stage-3 run must log DDP's losses (checked,
within 1e-5).

    .venv/bin/python benchmarks/generate.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from zeroshard.testing import run_ranks

PROMPT, NEW, BATCH, ROUNDS = 32, 64, 2, 3
GRPO_STEPS, GRPO_ROUNDS = 6, 5
ROWS = ("stage 0", "s3 per token", "s3 gathered", "s3 half budget")


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=8, n_embd=512, n_head=8, vocab_size=256,
                                  n_positions=256, bos_token_id=0, eos_token_id=0,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _rows() -> dict:
    import zeroshard

    out = {}
    half = None
    for row in ROWS:
        stage = 0 if row == "stage 0" else 3
        opts = {"generate_budget": 0} if row == "s3 per token" else {}
        model, _ = zeroshard.shard(_model(), torch.optim.SGD, stage=stage, lr=0.0, **opts)
        model.eval()
        if row == "s3 half budget":
            engine = zeroshard.engine_of(model)
            half = sum(u.unsharded_bytes for u in engine.units) // 2
            zeroshard.register_forward_method(model, "generate", budget=half)
        out[row] = model
    return out, half


def _bench(rank: int, world: int) -> dict:
    import zeroshard

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    models, half = _rows()
    prompt = torch.randint(1, 256, (BATCH, PROMPT),
                           generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(prompt)
    times: dict[str, list[float]] = {r: [] for r in ROWS}
    gathers: dict[str, int] = {}
    peaks: dict[str, int] = {}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(ROUNDS):
        for row in ROWS:  # interleaved: one call per row per round
            model = models[row]
            ledger = zeroshard.engine_of(model).comm.ledger
            tracker = zeroshard.memory_tracker(model)
            ledger.windows.pop("generate", None)  # generate()'s records (CommLedger.window)
            with tracker:
                t0 = time.perf_counter()
                out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                times[row].append((time.perf_counter() - t0) * 1e3 / NEW)
            gathers[row] = sum(1 for r in ledger.windows.get("generate", ())
                               if r.op == "all_gather")
            peaks[row] = tracker.peak().get("params", 0)
            tokens[row] = out
    same = all(torch.equal(tokens[r], tokens["stage 0"]) for r in ROWS)
    return {"ms": {r: statistics.median(v) for r, v in times.items()}, "gathers": gathers,
            "peaks": peaks, "same": same, "half": half}


def _grpo(rank: int, world: int, root: str, shape: tuple[int, int]) -> dict:
    """GRPO on DDP and at stage 3, alternating run by run (each run a new trainer), on a
    Llama of ``shape`` (blocks, width)."""
    import sys

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples", "integrations"))
    from trl_grpo import main as grpo

    per_step: dict[str, list[float]] = {m: [] for m in GRPO_MODES}
    losses: dict[str, list] = {}
    ref_bytes: dict[str, int] = {}
    for i in range(GRPO_ROUNDS):
        for mode in GRPO_MODES if i % 2 == 0 else GRPO_MODES[::-1]:
            args = ["--out", os.path.join(root, f"{mode.replace(' ', '')}-{shape[0]}-{i}"),
                    "--steps", str(GRPO_STEPS), "--layers", str(shape[0]),
                    "--hidden", str(shape[1])]
            logs = grpo(args + {"ddp": ["--ddp"], "stage 3": ["--stage", "3"],
                                "s3 no reshard": ["--stage", "3", "--no-reshard"]}[mode])
            per_step[mode].append(logs[-1]["train seconds"] / GRPO_STEPS)
            losses[mode] = [h["loss"] for h in logs]
            ref_bytes[mode] = logs[-1]["reference bytes"]
    ratios = {m: [z / d for z, d in zip(per_step[m], per_step["ddp"])] for m in GRPO_MODES}
    return {"s": {m: statistics.median(v) for m, v in per_step.items()},
            "ratio": {m: statistics.median(r) for m, r in ratios.items()}, "ratios": ratios,
            "ref": ref_bytes,
            "same": all(abs(a - b) <= 1e-5 for m in GRPO_MODES
                        for a, b in zip(losses["ddp"], losses[m]))}


#: (blocks, width) of the GRPO policy: the example's tiny Llama (every collective's
#: latency shows), and one of the gpt2-small preset's shape (compute shows).
GRPO_SHAPES = ((2, 64), (8, 512))
#: DDP; stage 3; stage 3 with reshard_after_forward=False (units gathered from a forward
#: to its backward, and kept after the no_grad forwards of the rollout's scoring).
GRPO_MODES = ("ddp", "stage 3", "s3 no reshard")


def grpo_lines(root: str) -> tuple[list[str], bool]:
    lines = ["", f"GRPO (TRL GRPOTrainer, examples/integrations/trl_grpo.py: 4 generations of "
             f"8 tokens, beta 0.1, sync_ref_model every step), {GRPO_STEPS} steps per run, "
             f"DDP and stage 3 alternating over {GRPO_ROUNDS} rounds; median seconds per step",
             "", f"{'policy':<16} {'row':<14} {'s/step':>9} {'x ddp':>7} "
             f"{'median x ddp':>13} {'reference bytes/rank':>21}"]
    same = True
    for shape in GRPO_SHAPES:
        g = run_ranks(_grpo, 2, root, shape, timeout=1800)[0]
        name = f"Llama {shape[0]}x{shape[1]}"
        for mode in GRPO_MODES:
            lines.append(f"{name:<16} {mode:<14} {g['s'][mode]:>9.3f} "
                         f"{g['s'][mode] / g['s']['ddp']:>7.2f} {g['ratio'][mode]:>13.2f} "
                         f"{g['ref'][mode]:>21,}")
        lines.append(f"{'':<16} per round, s3 / ddp: "
                     + ", ".join(f"{x:.2f}" for x in g["ratios"]["stage 3"])
                     + "; no reshard / ddp: "
                     + ", ".join(f"{x:.2f}" for x in g["ratios"]["s3 no reshard"])
                     + f"; DDP's losses: {g['same']}")
        same = same and g["same"]
    return lines, same


def main() -> None:
    import tempfile

    r = run_ranks(_bench, 2, timeout=1800)[0]
    base = r["ms"]["stage 0"]
    lines = [f"generation, 2 CPU ranks (gloo), HF GPT-2 8x512 (gpt2-small preset shape), "
             f"prompt {PROMPT}, {NEW} new tokens, batch {BATCH}, greedy; median of {ROUNDS} "
             "interleaved calls", "",
             f"{'row':<16} {'ms/token':>9} {'x stage 0':>10} {'gathers/call':>13} "
             f"{'peak params MiB':>16}"]
    for row in ROWS:
        lines.append(f"{row:<16} {r['ms'][row]:>9.1f} {r['ms'][row] / base:>10.2f} "
                     f"{r['gathers'][row]:>13} {r['peaks'][row] / 2**20:>16.1f}")
    lines += ["", f"half budget: {r['half'] / 2**20:.1f} MiB of gathered weights; "
              f"every row gave stage 0's tokens: {r['same']}"]
    with tempfile.TemporaryDirectory() as root:
        more, same = grpo_lines(root)
    print("\n".join(lines + more))
    if not r["same"]:
        raise SystemExit("a row generated other tokens than stage 0")
    if not same:
        raise SystemExit("GRPO at stage 3 logged other losses than DDP")


if __name__ == "__main__":
    main()
