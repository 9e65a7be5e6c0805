"""Hugging Face mixture-of-experts models under zeroshard: DDP's answer at every stage
(issue #27).

Tiny Mixtral, Qwen2-MoE (routed experts beside a shared expert) and OLMoE configs, random
init, world 2, with per-rank batches so small (4 tokens, top-1 of 4 experts) that in every
step some expert is empty on one rank and busy on the other — recorded from the routers'
choices and asserted, so the tests cannot pass without exercising it. (transformers 5
stores a layer's experts as stacked 3-D parameters, so an expert without tokens leaves
zero rows of a parameter that is used; per-expert modules are tests/test_moe.py's model.)
Reference: torch DDP with ``find_unused_parameters=True`` on the same batches.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

os.environ["HF_HUB_OFFLINE"] = "1"
transformers.logging.set_verbosity_error()

import zeroshard  # noqa: E402
from zeroshard.testing import run_ranks, sweep  # noqa: E402

VOCAB, TOKENS, EXPERTS, STEPS = 64, 4, 4, 3
KINDS = ("mixtral", "qwen2_moe", "olmoe")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=1)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=EXPERTS,
                                         router_jitter_noise=0.0, **common)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=32,
                                          num_experts=EXPERTS, **common)
        return transformers.Qwen2MoeForCausalLM(cfg)
    cfg = transformers.OlmoeConfig(intermediate_size=16, num_experts=EXPERTS, **common)
    return transformers.OlmoeForCausalLM(cfg)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, TOKENS + 1),
                         generator=torch.Generator().manual_seed(100 * step + rank))


def record_routing(model: torch.nn.Module) -> list[set[int]]:
    """Forward hooks on the routers: the experts each layer chose, per forward."""
    seen: list[set[int]] = []

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        index = out[-1] if isinstance(out, tuple) else out.topk(1, dim=-1).indices
        seen.append({int(e) for e in index.flatten()})

    for name, m in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("mlp.router"):
            m.register_forward_hook(hook)
    return seen


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def train(rank: int, world: int, *, kind: str, stage: int | None) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny(kind)
    routing = record_routing(model)
    if stage is None:
        wrapped = DDP(model, find_unused_parameters=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        wrapped, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                         bucket_bytes=4096)
    losses = []
    for step in range(STEPS):
        loss = loss_of(wrapped, batch(rank, step))
        loss.backward()
        losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    if stage is None:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        weights = zeroshard.full_state_dict(wrapped)
    return {"losses": losses, "weights": weights, "routing": routing}


GRID = [{"kind": k, "stage": s} for k in KINDS for s in (None, 0, 1, 2, 3)]


@functools.cache
def _run() -> list[list[dict[str, Any]]]:
    return run_ranks(_all, 2, timeout=400, env=ENV)


def _all(rank: int, world: int) -> list:
    transformers.logging.set_verbosity_error()
    return sweep(functools.partial(train, rank, world), GRID)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_moe_equals_ddp(kind: str) -> None:
    ranks = _run()
    rows = {(p["kind"], p["stage"]): [r[i] for r in ranks] for i, p in enumerate(GRID)}
    ref = rows[kind, None]
    # the data leaves some expert empty on one rank and busy on the other, every step
    r0, r1 = ref[0]["routing"], ref[1]["routing"]
    assert len(r0) == len(r1) == 2 * STEPS
    for step in range(STEPS):
        layers = range(2 * step, 2 * step + 2)
        assert any(r0[i] ^ r1[i] for i in layers), (kind, step, r0, r1)
    worst = []
    for stage in range(4):
        got = rows[kind, stage]
        for rank in range(2):
            assert got[rank]["routing"] == ref[rank]["routing"], (kind, stage)
            for a, b in zip(got[rank]["losses"], ref[rank]["losses"]):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (kind, stage, a, b)
        devs = {k: ((got[0]["weights"][k] - w).norm() / (w.norm() + 1e-12)).item()
                for k, w in ref[0]["weights"].items()}
        worst.append(max(devs.values()))
        for k, dev in devs.items():
            assert dev <= 1e-5, (kind, stage, k, dev)
    print(f"{kind}: worst weight deviation from DDP, stages 0-3: "
          + ", ".join(f"{w:.1e}" for w in worst))
