"""Stage 3's secondary shard (``reshard_after_forward=k``, ZeRO++'s hpZ): bitwise stage 3,
backward's all-gathers inside the node, 1/k of the weights kept, never stale
([Note: the secondary shard] in engine/secondary.py)."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.checkpointing import apply_checkpointing
from zeroshard.state import load_checkpoint, save_checkpoint
from zeroshard.testing import run_ranks

STEPS = 3


def _build(raf, *, prefetch: int = 1, ckpt: str | None = None, bf16: bool = False,
           hybrid=None, world: int = 4):
    torch.manual_seed(0)
    model = make_model("gpt2-tiny")
    if ckpt:
        apply_checkpointing(model, ckpt)
    return zeroshard.shard(model, torch.optim.AdamW, stage=3, node_size=2, hybrid=hybrid,
                           reshard_after_forward=raf, prefetch=prefetch, lr=1e-2,
                           mixed_precision="bf16" if bf16 else None)


def _weights(model) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


def _train(rank: int, world: int, raf, opts: dict) -> dict:
    model, opt = _build(raf, **opts)
    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(STEPS)]
    losses, inter = [], []
    ledger = zeroshard.engine_of(model).comm.ledger
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        inter.append(ledger.by("phase", ledger.last_step()))
    back = [r for r in ledger.last_step() if r.op == "all_gather" and r.phase == "backward"]
    return {"losses": losses, "weights": _weights(model), "by_phase": inter[-1],
            "backward_gathers": [(r.group, r.intra_wire_bytes, r.inter_wire_bytes)
                                 for r in back]}


@pytest.mark.parametrize("opts", [  # world 4: the variants run under `make slow`
    pytest.param({}, id="plain"),
    pytest.param({"prefetch": 2, "ckpt": "full"}, id="prefetch2-recompute"),
    pytest.param({"bf16": True}, marks=pytest.mark.slow, id="bf16"),
    pytest.param({"hybrid": (1, 4)}, marks=pytest.mark.slow, id="hybrid-1x4"),
])
def test_secondary_shard_is_bitwise_stage3_with_backward_gathers_inside_the_node(
        opts: dict) -> None:
    """World 4 as 2 nodes x 2, k = 2: every step's loss and the final weights equal stage
    3's bit for bit (with prefetch 2 and activation checkpointing's recompute, which
    gathers in backward too; bf16; through hybrid's mesh), every backward all-gather runs
    on the secondary group with no byte leaving the node, and the step's inter-node bytes
    fall by exactly stage 3's backward all-gather share."""
    base = run_ranks(_train, 4, True, opts)
    hpz = run_ranks(_train, 4, 2, opts)
    for b, h in zip(base, hpz):
        assert b["losses"] == h["losses"]
        assert all(torch.equal(x, y) for x, y in zip(b["weights"], h["weights"]))
        assert h["backward_gathers"] and all(
            g == "secondary" and inter == 0 < intra for g, intra, inter in h["backward_gathers"])
        assert sum(i for _, _, i in b["backward_gathers"]) > 0
        saved = b["by_phase"]["backward"]["inter_wire_bytes"] - \
            h["by_phase"]["backward"]["inter_wire_bytes"]
        assert saved == sum(i for _, _, i in b["backward_gathers"])
        assert b["by_phase"]["forward"] == h["by_phase"]["forward"]


def _between_forward_and_backward(rank: int, world: int, raf) -> dict:
    """Bytes of params the tracker sees after a forward with gradients, and the units'
    padded sizes, to compare with 1/k of them."""
    model, opt = _build(raf)
    engine = zeroshard.engine_of(model)
    x, y = loader("gpt2-tiny", rank, world).micro_batches(1)[0]
    tracker = zeroshard.memory_tracker(model, opt)
    with tracker:
        loss = loss_of(model, x, y)
        after_forward = tracker.current()["params"]
        loss.backward()
        after_backward = tracker.current()["params"]
    kept = sum(b.padded_numel * b.full.element_size() for u in engine.units if not u.is_root
               for b in u.buckets)
    return {"forward": after_forward, "backward": after_backward, "units": kept}


def test_secondary_memory_is_one_kth_of_the_units_until_their_backward() -> None:
    """The tracker's params after a forward exceed stage 3's by the units' bytes / k,
    exactly, and the secondaries are gone once backward is over."""
    base = run_ranks(_between_forward_and_backward, 4, True)
    hpz = run_ranks(_between_forward_and_backward, 4, 2)
    for b, h in zip(base, hpz):
        assert h["forward"] - b["forward"] == h["units"] // 2
        assert h["backward"] == b["backward"]
    # the planner's price of it (stage3_moments' secondary term: L blocks x P x ceil(B/k),
    # fp32 here) within 2% of the tracker's
    from zeroshard.memory.analytic import block_params, stage3_moments
    from zeroshard.models import get_preset

    cfg = get_preset("gpt2-tiny")
    block = block_params(cfg)
    kw = dict(block=block, blocks=cfg.n_layers, root=cfg.param_count() - 2 * block, head=0,
              n=4, activations=0, late_activations=0, recipe="fp32-adamw")
    plain, with_k = stage3_moments(**kw), stage3_moments(**kw, secondary=2)
    predicted = with_k[1].buffers - plain[1].buffers  # when backward begins
    measured = hpz[0]["forward"] - base[0]["forward"]
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def _resume(rank: int, world: int, raf, root: str, writer) -> list:
    """Two steps, a checkpoint (written by ``writer``'s run), a third step, then the
    checkpoint loaded and two more steps: the secondaries after the load are built from
    the loaded weights (DeepSpeed's hpZ once kept a stale one across a load)."""
    model, opt = _build(raf)
    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(5)]
    path = os.path.join(root, f"ck-{writer}")
    for i, (x, y) in enumerate(batches[:3]):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if i == 1 and raf == writer:
            save_checkpoint(path, model, opt)
    torch.distributed.barrier()
    load_checkpoint(path, model, opt)
    for x, y in batches[3:]:
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return _weights(model)


def test_resume_from_a_checkpoint_either_way_is_stage3s() -> None:
    """Checkpoints carry no secondary: written with k = 2 or plain stage 3, loaded by
    either after a step past it, the next steps are stage 3's bit for bit."""
    with tempfile.TemporaryDirectory() as root:
        base = run_ranks(_resume, 4, True, root, True)
        for raf, writer in ((2, True), (2, 2), (True, 2)):
            got = run_ranks(_resume, 4, raf, root, writer)
            for b, h in zip(base, got):
                assert all(torch.equal(x, y) for x, y in zip(b, h)), (raf, writer)


def _resolved(rank: int, world: int, raf, node_size: int) -> object:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, _ = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   node_size=node_size, reshard_after_forward=raf, lr=1e-2)
    engine = zeroshard.engine_of(model)
    return (engine.config.reshard_after_forward, engine.secondary is not None,
            [str(w.message) for w in said if "reshard_after_forward" in str(w.message)])


def test_k_is_checked_and_the_trivial_ones_mapped_with_a_word() -> None:
    """k = 1 and k = N run as False / True, saying so and naming the k that would keep a
    secondary shard; a k dividing one of the shard group and node_size but not the other
    is an error listing the choices."""
    k1 = run_ranks(_resolved, 4, 1, 2)[0]
    assert k1[:2] == (False, False) and "runs as reshard_after_forward=False" in k1[2][0]
    k4 = run_ranks(_resolved, 4, 4, 4)[0]
    assert k4[:2] == (True, False) and "runs as reshard_after_forward=True" in k4[2][0]
    assert "secondary shard needs k dividing both 4 and node_size=4, 1 < k < 4: 2" in k4[2][0]
    assert run_ranks(_resolved, 4, 2, 2)[0] == (2, True, [])
    with pytest.raises(Exception, match=r"reshard_after_forward=3 does not divide the shard "
                                        r"group of 4.*choose k among 2"):
        run_ranks(_resolved, 4, 3, 4)
    with pytest.raises(Exception, match=r"reshard_after_forward=2 does not divide "
                                        r"node_size=1.*choose k among none"):
        run_ranks(_resolved, 4, 2, 1)
    with pytest.raises(ValueError, match="reshard_after_forward=0 must be True, False"):
        zeroshard.ShardConfig(stage=3, reshard_after_forward=0)
