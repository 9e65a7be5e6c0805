"""Stage 3's quantised weight all-gathers (``quantize_weights=``, ZeRO++'s qwZ; [Note:
quantised weights] in engine/quantize.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _training import loader, loss_of, make_model
from torch import nn

import zeroshard
from zeroshard.engine.quantize import BLOCK, dequantize, packed_numel, quantize
from zeroshard.testing import run_ranks


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 1000])
def test_round_trip_bounds_sizes_and_dtypes(kind: str, n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-3, 2, n)  # blocks of very different magnitudes
    x[: min(n, 3)] = 0
    packed = quantize(x, kind)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(n, kind)
    assert packed.numel() == n + 4 * -(-n // BLOCK)  # a byte per element + scales, no padding
    back = dequantize(packed, kind, n, torch.float32)
    pad = torch.zeros(-(-n // BLOCK) * BLOCK)
    pad[:n] = x
    amax = pad.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK)[:n]
    err = (back - x).abs()
    if kind == "int8":  # half a step of max|x|/127
        assert (err <= amax / 127 / 2 * (1 + 1e-5) + 1e-30).all()
    else:  # e4m3: 3 mantissa bits, relative 2^-4, and the subnormal floor
        assert (err <= x.abs() / 16 + amax / 448 * 2**-9 * (1 + 1e-5)).all()
    assert (back[x == 0] == 0).all()
    for dt in (torch.bfloat16, torch.float16):  # the compute dtype stays what it is
        assert dequantize(quantize(x.to(dt), kind), kind, n, dt).dtype == dt
    # int4 (gradients): two values a byte, at most ceil(n/2) + the scales on the wire
    four = quantize(x, "int4")
    assert four.numel() == -(-n // 2) + 4 * -(-n // BLOCK) == packed_numel(n, "int4")
    err4 = (dequantize(four, "int4", n, torch.float32) - x).abs()
    assert (err4 <= amax / 7 / 2 * (1 + 1e-5) + 1e-30).all()


def _train(rank: int, world: int, kind: str | None, raf, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model, opt = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                 node_size=2, reshard_after_forward=raf, lr=1e-2,
                                 quantize_weights=kind, mixed_precision="bf16")
    engine = zeroshard.engine_of(model)
    seen: list[tuple[str, float]] = []  # what each unit computed with, per forward
    for u in engine.units[:-1]:
        u.module.register_forward_pre_hook(
            lambda m, a, u=u: seen.append((str(u.buckets[0].full.dtype),
                                           float(u.buckets[0].full.double().sum()))))
    data = loader("gpt2-tiny", rank, world)
    x0, y0 = next(data)
    with torch.no_grad():
        exact = loss_of(model, x0, y0).item()
    model.eval()  # a validation loss with gradients on: eval mode gathers exact weights
    evaluated = loss_of(model, x0, y0).item()
    model.train()
    seen.clear()
    losses = []
    for _ in range(steps):
        loss = loss_of(model, x0, y0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ledger = engine.comm.ledger
    gathers = [(r.phase, r.group, r.dtype, r.logical_bytes) for r in ledger.last_step()
               if r.op == "all_gather"]
    sizes = [(u.name, [b.shard_numel for b in u.buckets]) for u in engine.units]
    return {"exact": exact, "evaluated": evaluated, "losses": losses, "seen": seen, "gathers": gathers,
            "sizes": sizes}


@pytest.mark.parametrize("kind,raf", [  # world 4: the plain-shard variants under `make slow`
    pytest.param("int8", True, marks=pytest.mark.slow), ("fp8", True), ("int8", 2)])
def test_quantised_gathers_move_a_byte_per_element_and_every_rank_computes_alike(
        kind: str, raf) -> None:
    """World 4 as 2 nodes x 2 in bf16: each training all-gather moves one byte per element
    plus its scales (against bf16's two), the weights every rank computes with are the
    same on all ranks (each dequantises its own slice too) and stay bf16, a no-grad
    forward sees the exact weights (stage 3's loss, bit for bit), and training stays close
    to stage 3's. With k = 2 backward reads the secondary shard (bf16, inside the node)."""
    base = run_ranks(_train, 4, None, True)
    got = run_ranks(_train, 4, kind, raf)
    for r in range(4):
        assert got[r]["exact"] == base[r]["exact"]  # no_grad: exact weights
        assert got[r]["evaluated"] == base[r]["exact"]  # eval mode too
        assert got[r]["seen"] == got[0]["seen"]  # the same weights on every rank
        assert {d for d, _ in got[r]["seen"]} == {"torch.bfloat16"}
        assert got[r]["seen"] != base[r]["seen"]  # ... which are quantised ones
        rel = abs(got[r]["losses"][-1] - base[r]["losses"][-1]) / base[r]["losses"][-1]
        assert rel < 0.05, got[r]["losses"]
    sizes = dict(got[0]["sizes"])
    for phase, group, dtype, logical in got[0]["gathers"]:
        if raf == 2 and phase == "backward":
            assert (group, dtype) == ("secondary", "bfloat16")
            continue
        assert dtype == "uint8"
        # one of the units' buckets: N x the packed slice
        assert any(logical == 4 * packed_numel(n) for ns in sizes.values() for n in ns)
    total = sum(b for p, g, d, b in got[0]["gathers"] if d == "uint8")
    bf16 = sum(b for p, g, d, b in base[0]["gathers"])
    assert total < (0.51 + 0.02) * bf16 * (1 if raf is True else 0.6)


def _odd(rank: int, world: int, kind: str | None) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 37), nn.GELU(),
                          nn.Linear(37, 5))
    model, opt = zeroshard.shard(model, torch.optim.SGD, stage=3, lr=0.1,
                                 quantize_weights=kind)
    torch.manual_seed(rank)
    out = []
    for _ in range(3):
        loss = model(torch.randn(4, 13)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_any_size_works() -> None:
    """Slices of sizes no block divides (13x37, 37, 5 ... over 3 ranks) are padded."""
    base = run_ranks(_odd, 3, None)
    got = run_ranks(_odd, 3, "int8")
    for b, g in zip(base, got):
        assert g == pytest.approx(b, rel=0.05)


def test_bad_names_and_stages() -> None:
    with pytest.raises(ValueError, match=r"quantize_weights='int4' .*'int8', 'fp8' or None"):
        zeroshard.ShardConfig(stage=3, quantize_weights="int4")
    from zeroshard.config import ignored_options

    with warnings.catch_warnings():
        config = zeroshard.ShardConfig(stage=1, quantize_weights="int8")
    (message,) = ignored_options(config, {"quantize_weights"})
    assert "quantize_weights='int8' has no effect with stage=1" in message


def _grads(rank: int, world: int, disturb: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model, _ = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                               node_size=2, reshard_after_forward=2, quantize_weights="int8",
                               lr=1e-2, mixed_precision="bf16")
    x, y = next(loader("gpt2-tiny", rank, world))
    loss = loss_of(model, x, y)
    if disturb == "gathered":
        with zeroshard.gathered(model):
            pass
    elif disturb == "unshard":
        model.unshard()
        model.reshard()
    loss.backward()
    return [p.grad.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("disturb", ["gathered", "unshard"])
def test_exact_gathers_between_forward_and_backward_leave_the_gradients_alone(
        disturb: str) -> None:
    """gathered() / unshard() between a quantised forward and its backward gather the
    exact weights; the backward then gathers again what its forward computed with, so the
    gradients are those of an undisturbed step, bit for bit."""
    base = run_ranks(_grads, 4, None)
    got = run_ranks(_grads, 4, disturb)
    for b, g in zip(base, got):
        assert all(torch.equal(x, y) for x, y in zip(b, g))
