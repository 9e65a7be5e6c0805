"""No double wrapping ([Note: double wrapping] in wrapping.py): DDP, FSDP1, FSDP2 and
DeepSpeed around a sharded model, or inside the model handed to shard(), raise before any
gradient is reduced, naming the wrapper and the supported call."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.testing import run_ranks, sweep


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.ModuleList([nn.Linear(8, 8)]),
                         nn.Linear(8, 2))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.blocks, self.b = nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)]), \
            nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.blocks[0](self.a(x).relu()))


class _Parent(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class DeepSpeedEngine(nn.Module):
    """Stands in for deepspeed.runtime.engine.DeepSpeedEngine (deepspeed is an optional
    comparison dependency, not installed by make test): recognised by name and module,
    as the real one is."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module(*inputs)


DeepSpeedEngine.__module__ = "deepspeed.runtime.engine"


def _fsdp2(m: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(m)


def _fsdp1(m: nn.Module) -> nn.Module:
    """An FSDP1 instance around ``m``. FSDP1 refuses to be built on CPU ("FSDP needs a
    non-CPU accelerator device"), so on CPU it is built without its __init__: shard()
    recognises the class, as it does the real one on GPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if torch.cuda.is_available():
        return FullyShardedDataParallel(m, use_orig_params=True)
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._fsdp_wrapped_module = m
    return wrapper


def _ds_partitioned(m: nn.Module) -> nn.Module:
    m.a.weight.ds_id = 0  # what deepspeed.zero.Init tags each partitioned parameter with
    return m


_BEFORE = {"ddp": DDP, "ddp_inside": lambda m: _Parent(DDP(m)), "fsdp2": _fsdp2,
           "fsdp1": _fsdp1, "deepspeed": DeepSpeedEngine, "deepspeed_zero3": _ds_partitioned}
# FSDP1 around a sharded model needs an accelerator (see _fsdp1); there it replaces the
# parameters, which the forward's check refuses as it does FSDP2's.
_AFTER = {"ddp": DDP, "ddp_parent": lambda m: DDP(_Parent(m)), "fsdp2": _fsdp2,
          "fsdp2_parent": lambda m: _fsdp2(_Parent(m)), "deepspeed": DeepSpeedEngine}


def _wrapped_then_sharded(how: str) -> str:
    model = _BEFORE[how](_Net())
    try:
        zeroshard.shard(model, torch.optim.SGD, lr=0.1, stage=1)
    except TypeError as e:
        return str(e)
    return "no error"


def _sharded_then_wrapped(how: str, stage: int) -> dict:
    """Where the error came (construction or forward) and whether any gradient or weight
    changed before it."""
    model, optim = zeroshard.shard(_Net(), torch.optim.SGD, lr=0.1, stage=stage)
    before = {k: v.clone() for k, v in zeroshard.full_state_dict(model).items()}
    x = torch.randn(4, 8)
    at = "construction"
    try:
        wrapped = _AFTER[how](model)
        at = "forward"
        loss = wrapped(x).sum()
        at = "backward"
        loss.backward()
        at = "none"
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        err = f"{type(e).__name__}: {e}"
    else:
        err = ""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    after = zeroshard.full_state_dict(model)
    same = all(torch.equal(before[k], after[k]) for k in before)
    # The model still trains as zeroshard's (nothing was left half-wrapped) where the
    # wrapper did not replace its parameters.
    return {"at": at, "err": err, "grads": len(grads), "weights_kept": same}


def _accelerate_prepare(rank: int, world: int) -> str:
    """The obvious Accelerate port: accelerator.prepare(model, optimizer) on the sharded
    model wraps it in DDP, which must refuse."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world  # it joined our group: the DDP path
    model, optim = zeroshard.shard(_Net(), torch.optim.SGD, lr=0.1, stage=0)
    try:
        accelerator.prepare(model, optim)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _cases(rank: int, world: int) -> dict:
    out = {"before": sweep(_wrapped_then_sharded, [{"how": h} for h in _BEFORE])}
    out["accelerate"] = _accelerate_prepare(rank, world)
    grid = [{"how": h, "stage": s} for h in _AFTER for s in (0, 3)]
    out["after"] = sweep(_sharded_then_wrapped, grid)
    out["grid"] = grid
    return out


BEFORE_EXPECT = {
    "ddp": "wrapped in DistributedDataParallel \\(the model itself\\)",
    "ddp_inside": "wrapped in DistributedDataParallel \\('inner'\\)",
    "fsdp2": "wrapped in FSDP2 \\(fully_shard\\)",
    "fsdp1": "wrapped in FSDP \\(FullyShardedDataParallel\\)",
    "deepspeed": "wrapped in DeepSpeed \\(DeepSpeedEngine",
    "deepspeed_zero3": "DeepSpeed ZeRO-3 \\(a partitioned parameter\\) \\('a.weight'\\)",
}
AFTER_EXPECT = {  # DDP's and fully_shard's constructors ask each module for its own
    # parameters, and the sharded model answers them with the refusal (#64 item 5: at
    # stage 3 they used to fail inside torch, "c10d.broadcast_ ... no sharding strategy")
    "ddp": ("construction", "DistributedDataParallel around a model sharded by zeroshard"),
    "ddp_parent": ("construction", "DistributedDataParallel around a module that contains a "
                   "model sharded by zeroshard \\(_Net\\)"),
    "fsdp2": ("construction", "fully_shard of a model sharded by zeroshard \\(_Net\\)"),
    "fsdp2_parent": ("construction", "fully_shard of a model sharded by zeroshard"),
    "deepspeed": ("forward", "runs inside DeepSpeed \\(DeepSpeedEngine"),
}


def test_double_wrapping_is_refused_either_way() -> None:
    got = run_ranks(_cases, 2, timeout=120)
    for rank in got:
        for how, msg in zip(_BEFORE, rank["before"]):
            assert re.search(BEFORE_EXPECT[how], msg), (how, msg)
            assert "zeroshard.shard(model, optimizer" in msg and "Accelerate" in msg, msg
        assert "DistributedDataParallel around a model sharded" in rank["accelerate"]
        assert "zeroshard.integrations.accelerate.prepare(accelerator" in rank["accelerate"]
        for point, res in zip(rank["grid"], rank["after"]):
            at, pattern = AFTER_EXPECT[point["how"]]
            assert res["at"] in ((at,) if at else ("construction", "forward")), (point, res)
            assert re.search(pattern, res["err"]), (point, res)
            assert res["grads"] == 0, (point, res)  # raised before any gradient existed
            if point["how"].startswith("ddp"):
                assert res["weights_kept"], (point, res)
