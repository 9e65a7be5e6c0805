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

    .venv/bin/python benchmarks/generate.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from zeroshard.testing import run_ranks

PROMPT, NEW, BATCH, ROUNDS = 32, 64, 2, 3
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


def main() -> None:
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
    print("\n".join(lines))
    if not r["same"]:
        raise SystemExit("a row generated other tokens than stage 0")


if __name__ == "__main__":
    main()
