"""Stage 3 on models that are not language models (issue #46): a CNN with BatchNorm and
dropout and no ``nn.ModuleList`` gets units by size and equals DDP bitwise; a parameter
read outside its unit is an error naming the parameter, the module that read it and the
fix."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.testing import run_ranks, sweep

STEPS = 5


class _CNN(nn.Module):
    """Two convolution stages (Conv2d, BatchNorm2d, ReLU, pooling), dropout, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16),
                                    nn.ReLU(), nn.MaxPool2d(2))
        self.stage2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
                                    nn.ReLU())
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage2(self.stage1(self.stem(x)))
        return self.head(self.drop(h.mean((2, 3))))


def _images(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def _run(model: nn.Module, optim, rank: int) -> dict:
    torch.manual_seed(10 + rank)  # dropout's masks: the same draws under DDP and here
    losses = []
    for step in range(STEPS):
        x, y = _images(rank, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(_images(rank, STEPS)[0])
    inner = model.module if isinstance(model, DDP) else model
    state = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    return {"losses": losses, "logits": logits, "state": state}


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _sharded(rank: int, stage: int) -> dict:
    log = _Log()
    logging.getLogger("zeroshard").addHandler(log)
    try:
        model, optim = zeroshard.shard(_CNN(), torch.optim.AdamW, stage=stage, lr=1e-2)
    finally:
        logging.getLogger("zeroshard").removeHandler(log)
    out = _run(model, optim, rank)
    engine = zeroshard.engine_of(model)
    out["units"] = [u.name for u in engine.units if not u.is_root]
    out["log"] = log.lines
    out["peak"] = engine.peak_unsharded_bytes
    out["whole"] = sum(p.numel() * p.element_size() for p in _CNN().parameters())
    return out


def _cnn_all(rank: int, world: int) -> dict:
    model = DDP(_CNN())
    ddp = _run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank)
    return {"ddp": ddp, "zs": sweep(_sharded, [{"rank": rank, "stage": s} for s in range(4)])}


def test_a_bn_cnn_equals_ddp_at_every_stage_with_units_by_size() -> None:
    """No ``units=``, no ``nn.ModuleList``: at stages 0-3 the losses, the evaluation
    logits and every weight and buffer on both ranks equal DDP's bitwise after 5 steps;
    at stage 3 the log names the units chosen by size (at least two), and the weights
    gathered at once stay below the whole model."""
    for rank, out in enumerate(run_ranks(_cnn_all, 2, timeout=120)):
        ddp = out["ddp"]
        for stage, got in enumerate(out["zs"]):
            where = (rank, stage)
            assert got["losses"] == ddp["losses"], (where, got["losses"], ddp["losses"])
            assert torch.equal(got["logits"], ddp["logits"]), where
            assert got["state"].keys() == ddp["state"].keys(), where
            for k, v in ddp["state"].items():
                assert torch.equal(got["state"][k], v), (where, k)
        s3 = out["zs"][3]
        assert len(s3["units"]) >= 2, s3["units"]
        if rank == 0:
            said = [line for line in s3["log"] if "units chosen by size" in line]
            assert said and all(f"{u} (" in said[0] for u in s3["units"]), s3["log"]
        assert 0 < s3["peak"] < s3["whole"], (s3["peak"], s3["whole"])


# -- parameters read outside their unit -----------------------------------------------------
class _TiedByHand(nn.Module):
    """The root computes with the first block's weight (a head tied by hand)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).relu()
        return F.linear(x, self.blocks[0].weight)


class _BiasByHand(_TiedByHand):
    """The root adds the first block's bias: not the first parameter of its bucket (its
    shard shares the bucket's storage with the weight's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).relu()
        return x + self.blocks[0].bias


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class _Attention(nn.Module):
    """Attention and a feed-forward, no ModuleList: units by size keep the attention
    whole (it reads out_proj.weight itself)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Sized so that out_proj alone holds over 1/8 of the parameters: split by size,
        # it would be a unit of its own.
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.up, self.down = nn.Linear(32, 8), nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.down(self.up(x).relu())


def _read_outside(rank: int, world: int) -> dict:
    out = {}
    cases = {
        "tied": (_TiedByHand, None, (2, 4)),
        "bias": (_BiasByHand, None, (2, 4)),
        "linears": (_encoder, lambda m: isinstance(m, nn.Linear), (2, 3, 8)),
    }
    for case, (build, units, shape) in cases.items():
        model, _ = zeroshard.shard(build(), torch.optim.SGD, stage=3, lr=0.1, units=units)
        try:
            model(torch.randn(*shape)).sum().backward()
            out[case] = "no error"
        except RuntimeError as e:
            out[case] = f"{type(e).__name__}: {e}"
    model, optim = zeroshard.shard(_Attention(), torch.optim.SGD, stage=3, lr=0.1)
    ref = _Attention()
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(rank))
    out["attention_units"] = [u.name for u in zeroshard.engine_of(model).units]
    out["attention"] = (model(x).sum().item(), ref(x).sum().item())
    return out


def test_a_parameter_read_outside_its_unit_is_named_with_the_fix() -> None:
    """The root reading ``blocks.0.weight``; ``units=`` the Linears of an
    ``nn.TransformerEncoder`` (its MultiheadAttention reads ``out_proj.weight``): the
    error names the parameter, the module that read it and the fix, not DTensor's raw
    "mixed torch.Tensor and DTensor". Units chosen by size keep a MultiheadAttention
    whole, and that model runs."""
    for out in run_ranks(_read_outside, 2, timeout=120):
        tied = out["tied"]
        assert tied.startswith("ParameterOutsideUnit") and "'blocks.0.weight'" in tied \
            and "the root (_TiedByHand.forward)" in tied and "without 'blocks.0'" in tied \
            and "units=[model.get_submodule('blocks.1'), model.get_submodule('blocks.2')]" \
            in tied, tied
        bias = out["bias"]
        assert bias.startswith("ParameterOutsideUnit") and "'blocks.0.bias'" in bias, bias
        lin = out["linears"]
        assert lin.startswith("ParameterOutsideUnit") and \
            "'layers.0.self_attn.out_proj.weight'" in lin and \
            "read by 'layers.0.self_attn'" in lin and \
            "model.get_submodule('layers.0.self_attn')" in lin, lin
        assert out["attention_units"] == ["attn", "up", "down", "root"], out["attention_units"]
        got, want = out["attention"]
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), out["attention"]
