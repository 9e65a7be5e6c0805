"""Stages 1-2's post-step gather takes one of two paths (engine.refresh_weights): on gloo
each rank's chunk of each parameter is broadcast straight into the whole weights; on
NCCL (any non-decomposing group) the rank's slice goes into a gathered buffer, one
all-gather, then the copy-out. Stage 3's unit gathers likewise: on gloo this rank's slice
is broadcast from where it lives and only the others' land in a buffer
(``Comm.all_gather_from``), elsewhere the gathered buffer and one all-gather. And the masters live in one of two homes: inside the
weights (fp32, see [Note: masters inside the weights] in engine/chunks.py) or apart
(mixed precision). CPU tests run gloo, so the NCCL path is forced here on a gloo group
(``decompose = False``: gloo's native all-gather and reduce-scatter) and both paths must
train the same model, at a world size that pads (3) and with a parameter no rank uses.
Between steps every rank halves every weight in place, as a script might (re-initialise,
copy in an EMA): the next step must start from the halved weights, as under DDP — with
the masters inside the weights (fp32) that is the memory the optimizer steps."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep


class _Odd(nn.Module):
    """Row counts not divisible by 3 (padding), a bias-free layer, an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 10)
        self.b = nn.Linear(10, 5, bias=False)
        self.spare = nn.Linear(4, 4)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _steps(model: nn.Module, optim: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Three steps on this rank's share of a 12-sample batch (world 1: all of it), every
    weight halved in place after the first."""
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 7, generator=g), torch.randint(0, 3, (12,), generator=g)
        mb = 12 // world
        F.cross_entropy(model(x[rank * mb:(rank + 1) * mb]),
                        y[rank * mb:(rank + 1) * mb]).backward()
        optim.step()
        optim.zero_grad()
        if step == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)


def _train(rank: int, world: int, stage: int, mp: str | None, native: bool) -> dict:
    # bf16 gradients reduced in fp32: the two paths sum in different orders, which in
    # bf16 differs by an ulp and AdamW's first steps amplify that into a visible change.
    extra = {"reduce_dtype": "fp32"} if mp else {}
    m = _Odd()
    if stage == 3:  # two units and the root
        extra["units"] = [m.a, m.b]
    model, optim = zeroshard.shard(m, torch.optim.AdamW, stage=stage, lr=1e-2,
                                   mixed_precision=mp, bucket_bytes=256, **extra)
    engine = zeroshard.engine_of(model)
    for c in engine.comms():
        c.decompose = not native
    _steps(model, optim, rank, world)
    gathers = [r for r in engine.comm.ledger.last_step() if r.op == "all_gather"]
    return {"state": zeroshard.full_state_dict(model),
            "in_full": [b.master_in_full for b in engine.buckets],
            "impl": sorted({r.impl for r in gathers}), "gathers": len(gathers),
            "gathered_bytes": sum(r.logical_bytes for r in gathers),
            "buckets": len(engine.buckets),
            "compute": {} if stage == 3 else {  # the whole compute weights (stage 3 frees them)
                s.names[0]: b.slot_view(b.full, i).clone()
                for b in engine.buckets for i, s in enumerate(b.slots)}}


_SIZES = [5, 0, 40_000, 3, 1, 20_000, 7]  # elements per piece (fp32: 20 B to 160 KB)


def _gather_pieces(rank: int, world: int, pack_below: int) -> tuple[bool, int]:
    """``Comm.all_gather_pieces`` on a buffer cut into pieces of mixed sizes, rank q's
    piece i at a distinct place, each owner's filled with its own values (the rest NaN):
    whether every rank ends with every piece, and the collectives the ledger counted."""
    from zeroshard.comm import Comm

    comm = Comm()
    comm.pack_below = pack_below
    full = torch.full((world * sum(_SIZES),), float("nan"))
    pieces, at = [[] for _ in range(world)], 0
    for n in _SIZES:  # interleaved as in a bucket: each piece of rank 0, 1, ...
        for q in range(world):
            pieces[q].append(full[at : at + n])
            at += n
    want = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * i + 100_000 * q
                      for i, n in enumerate(_SIZES) for q in range(world)])
    for t, w in zip(pieces[rank], [want[p.storage_offset():][: p.numel()] for p in pieces[rank]]):
        t.copy_(w)
    comm.all_gather_pieces(full, pieces, unit="u").wait()
    return torch.equal(full, want), len(comm.ledger.records)


def _gather_from(rank: int, world: int) -> tuple[bool, list]:
    """``Comm.all_gather_from``: rank q's slice (values 1000 q + i) sent from its own
    tensor; every other rank's lands in ``others``, in rank order without this one's."""
    from zeroshard.comm import Comm

    comm = Comm()
    n = 5
    own = torch.arange(n, dtype=torch.float32) + 1000 * rank
    others = torch.full(((world - 1) * n,), float("nan"))
    comm.all_gather_from(own, others, unit="u").wait()
    want = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * q
                      for q in range(world) if q != rank])
    return torch.equal(others, want), [(r.op, r.impl, r.logical_bytes)
                                       for r in comm.ledger.records]


def _all(rank: int, world: int) -> tuple[list, list, tuple]:
    grid = [{"stage": s, "mp": mp, "native": nat}
            for s in (1, 2, 3) for mp in (None, "bf16") for nat in (False, True)]
    # nothing packed, the pieces under 64 KiB packed (the default), everything packed
    pieces = [_gather_pieces(rank, world, b) for b in (0, 64 * 2**10, 2**30)]
    return (sweep(functools.partial(_train, rank, world), grid), pieces,
            _gather_from(rank, world))


def test_both_gather_paths_and_master_homes_train_alike() -> None:
    ranks = run_ranks(_all, 3, timeout=300)
    # pieces broadcast one by one or packed (see [Note: small pieces]) land in place
    assert all(r[1] == [(True, 1)] * 3 for r in ranks), [r[1] for r in ranks]
    # a slice sent from where it lives: every rank (rank 1's own slice in the middle)
    # receives the others', counted as one all-gather of the whole 3 x 5 floats
    assert [r[2] for r in ranks] == [(True, [("all_gather", "broadcast", 60)])] * 3
    ranks = [r[0] for r in ranks]
    results = ranks[0]
    by = {}
    for i, (stage, mp) in enumerate((s, mp) for s in (1, 2, 3) for mp in (None, "bf16")):
        gloo, native = results[2 * i], results[2 * i + 1]
        by[(stage, mp)] = gloo
        assert gloo["impl"] == ["broadcast"] and native["impl"] == ["all_gather"]
        # the same logical all-gathers, whichever way they are issued
        assert gloo["gathered_bytes"] == native["gathered_bytes"], (stage, mp)
        if stage == 3:  # each unit's, around its forward and its backward
            assert gloo["gathers"] == native["gathers"] > gloo["buckets"], (stage, mp)
        else:  # one per bucket per step
            assert all(gloo["in_full"]) == (mp is None) == all(native["in_full"])
            assert gloo["gathers"] == native["gathers"] == gloo["buckets"], (stage, mp)
        for name, ref in gloo["state"].items():
            torch.testing.assert_close(native["state"][name], ref, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, k=(stage, mp, name): f"{k}: {m}")
        # every rank ends with the same whole weights (the gather filled every chunk)
        for other in ranks[1:]:
            mine = other[2 * i]["compute"]
            for name, ref in gloo["compute"].items():
                assert torch.equal(mine[name], ref), (stage, mp, name)
    # fp32: both paths equal one process on the whole batch, the in-place edit included;
    # the parameter no rank used keeps its (halved) initial value
    ref = _reference()
    for stage in (1, 2, 3):
        for name, want in ref.items():
            torch.testing.assert_close(by[(stage, None)]["state"][name], want, rtol=1e-5,
                                       atol=1e-6, msg=lambda m, k=(stage, name): f"{k}: {m}")
    torch.testing.assert_close(ref["spare.weight"], _Odd().spare.weight.detach() * 0.5)
    for r in by.values():
        spare = r["state"]["spare.weight"]
        torch.testing.assert_close(spare, ref["spare.weight"].to(spare.dtype))


def _reference() -> dict[str, torch.Tensor]:
    model = _Odd()
    _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank=0, world=1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _edit_then_forward(rank: int, world: int, stage: int, offload: str | None,
                       mp: str | None) -> tuple[float, float]:
    import zeroshard.engine.engine as engine_mod

    engine_mod._FORCE_HOST_COPIES = offload is not None  # the offload path on CPU
    try:
        m = _Odd()
        kw = {"units": [m.a, m.b]} if stage == 3 else {}
        model, optim = zeroshard.shard(m, torch.optim.SGD, stage=stage, lr=0.1,
                                       offload=offload, mixed_precision=mp, **kw)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
        model(x).float().sum().backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            before = model(x).float().sum().item()
            for p in model.parameters():
                p.mul_(0.5)
            return before, model(x).float().sum().item()
    finally:
        engine_mod._FORCE_HOST_COPIES = False


_EDIT_GRID = [{"stage": s, "offload": o, "mp": mp} for s in range(4)
              for o in ((None,) if s == 0 else (None, "optimizer")) for mp in (None, "bf16")]


def _all_edits(rank: int, world: int) -> list:
    return sweep(functools.partial(_edit_then_forward, rank, world), _EDIT_GRID)


def test_in_place_edits_reach_the_next_forward_at_every_stage() -> None:
    """Where the user parameters are the masters (mixed precision, stage 3, offload) the
    compute weights are a copy: an in-place edit must still reach the next forward."""
    m = _Odd()
    optim = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    m(x).sum().backward()  # every rank sees the same x: the mean gradient is this one
    optim.step()
    with torch.no_grad():
        want_before = m(x).sum().item()
        for p in m.parameters():
            p.mul_(0.5)
        want = m(x).sum().item()
    for r in run_ranks(_all_edits, 2, timeout=300):
        for (before, after), point in zip(r, _EDIT_GRID, strict=True):
            tol = 2e-2 if point["mp"] else 1e-5
            assert abs(before - want_before) <= tol * abs(want_before), (point, before)
            assert abs(after - want) <= tol * abs(want), (point, after, want)


def _bf16_model(rank: int, world: int, stage: int) -> str:
    model, optim = zeroshard.shard(_Odd().to(torch.bfloat16), torch.optim.AdamW, stage=stage,
                                   mixed_precision="bf16", lr=1e-2)
    x = torch.randn(4, 7, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    optim.step()
    engine = zeroshard.engine_of(model)
    return str({b.master.dtype for b in engine.buckets if b.master is not None})


def test_a_bf16_model_under_bf16_mixed_precision_keeps_fp32_masters() -> None:
    """Compute dtype = the parameters' dtype, yet mixed precision: the masters are fp32
    (config.py's promise), not the bf16 weights (found in review: it crashed)."""
    for stage in (1, 2):
        assert run_ranks(_bf16_model, 2, stage, timeout=120)[0] == "{torch.float32}"
