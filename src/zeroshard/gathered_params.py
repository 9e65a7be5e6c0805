"""Whole parameters to read or edit, on every rank: ``zeroshard.gathered_parameters``
(DeepSpeed's ``GatheredParameters``, with ``modifier_rank``).

[Note: editing gathered parameters]
A script sometimes edits some weights by code that runs on one rank only — initialise new
embedding rows after growing a vocabulary, copy a pretrained head in, overwrite a layer
from a file rank 0 read. Under DDP it edits every rank's replica (or broadcasts);
DeepSpeed ZeRO-3 users write ``with GatheredParameters(params, modifier_rank=0): ...``.
Here the block gets whole fp32 copies of the named parameters (the master values being
trained, gathered from the shards: one all-gather per bucket holding them), on every
rank. With ``modifier_rank=r``, on leaving the block rank ``r``'s copies — as the block
left them — are broadcast and written into every rank's shards *and* masters (the
model's ``load_state_dict`` path, so the next forward and the optimizer both see them;
stage-3 units kept gathered drop their stale copies). DeepSpeed writes the 16-bit
partitions only, so an edit made after ``deepspeed.initialize`` is lost at the next step
from its fp32 masters; here it is not. Without ``modifier_rank`` the copies are read-only
in effect: edits are discarded. Optimizer state is left as it is (as an in-place edit
under DDP leaves it).

Collective: every rank enters and leaves the block together, naming the same parameters;
each collective goes through the communication ledger and the divergence check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .engine.engine import engine_of
from .engine.flat import FlatParam
from .engine.model_state import check_outside_forward, load_model_state_dict

__all__ = ["gathered_parameters"]


@contextmanager
def gathered_parameters(model: nn.Module,
                        params: Iterable[nn.Parameter | str] | nn.Parameter | str | None = None,
                        *, modifier_rank: int | None = None
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Whole fp32 copies of ``params`` (parameters of the sharded ``model`` or their names;
    None: all of them), ``{name: tensor}`` in model order, keyed by the names given (any
    alias; a parameter given as a tensor: its first name), on every rank. ``modifier_rank``:
    the rank (in the model's process group) whose copies, as the block leaves them, are
    written back into every rank's shards and masters on exit; None: edits are discarded.
    See [Note: editing gathered parameters]."""
    engine = engine_of(model)
    if engine.tp is not None:
        raise NotImplementedError(
            "gathered_parameters() under tensor parallelism is not supported yet; edit the "
            "parameters through model.load_state_dict({name: whole tensor}, strict=False) on "
            "every rank")
    size = engine.world.size
    if modifier_rank is not None and (isinstance(modifier_rank, bool)
                                      or not isinstance(modifier_rank, int)
                                      or not 0 <= modifier_rank < size):
        raise ValueError(f"modifier_rank={modifier_rank!r}: give the rank (0 to {size - 1}) "
                         "whose edits are kept, or None to discard edits")
    engine.between_steps("gathered_parameters()")
    wanted = _slots(engine, params)
    engine.world.sync_point("gathered_parameters")
    engine.refresh_handed_out("gathered_parameters after dcp.load")
    copies: dict[str, torch.Tensor] = {}
    for b in engine.all_buckets:  # the same order on every rank
        mine = [s for s in b.slots if s in wanted]
        if mine:
            full = engine.full_master(b)
            for s in mine:
                copies[wanted[s]] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
    order = {n: i for i, n in enumerate(engine.user_params_by_name())}  # model order
    copies = dict(sorted(copies.items(), key=lambda kv: order[kv[0]]))
    shapes = {n: (t.shape, t.dtype) for n, t in copies.items()}
    failed = False
    try:
        yield copies
    except BaseException:
        failed = True
        raise
    finally:
        if modifier_rank is not None:
            _write_back(model, engine, copies, shapes, modifier_rank, failed)


def _write_back(model: nn.Module, engine, copies: dict[str, torch.Tensor], shapes: dict,
                modifier_rank: int, failed: bool) -> None:
    """Every rank, on leaving the block: agree that nothing went wrong anywhere (a rank
    that raised inside the block, or a copy replaced by another shape), then the
    modifier's copies to every rank and into the shards and masters."""
    odd = [n for n, (shape, dtype) in shapes.items()
           if not isinstance(copies.get(n), torch.Tensor) or copies[n].shape != shape
           or copies[n].dtype != dtype]
    if set(copies) != set(shapes):
        odd += sorted(set(copies) ^ set(shapes))
    flags = torch.tensor([float(failed), float(bool(odd))], device=engine.device)
    engine.world.all_reduce(flags, op=dist.ReduceOp.MAX, phase="state",
                            unit="gathered_parameters").wait()
    if failed:
        return  # this rank's own exception goes on
    if flags[0] > 0:
        raise RuntimeError("gathered_parameters(): another rank raised inside the block; "
                           "nothing was written back (its error says why)")
    if flags[1] > 0:
        where = f": {_describe(odd[0], copies, shapes)}" if odd else " on another rank"
        raise ValueError(
            f"gathered_parameters(): a copy changed shape or dtype, or a key came or went, "
            f"inside the block{where}; nothing was written back. Edit the copies in place "
            "(or assign tensors of the same shape and dtype); to resize a parameter (a larger "
            "vocabulary), resize the model before zeroshard.shard()")
    check_outside_forward(engine, "gathered_parameters()' write-back")
    for name, t in copies.items():
        engine.world.broadcast(t, modifier_rank, phase="state", unit=name)
    load_model_state_dict(model, engine, copies, strict=False)


def _describe(name: str, copies: dict, shapes: dict) -> str:
    """What became of one copy: ``'w' is now (3, 4) torch.float32, was (2, 4) ...``."""
    now = copies.get(name)
    now_s = (f"{tuple(now.shape)} {now.dtype}" if isinstance(now, torch.Tensor)
             else "gone" if name not in copies else f"a {type(now).__name__}")
    was_s = f"{tuple(shapes[name][0])} {shapes[name][1]}" if name in shapes else "not a copy"
    return f"{name!r} is now {now_s}, was {was_s}"


def _slots(engine, params) -> dict[FlatParam, str]:
    """The slots of ``params`` (parameters or names, any alias), each with the name its
    copy goes by (the name given; a tensor: its parameter's first name)."""
    slots = [s for b in engine.all_buckets for s in b.slots]
    if params is None:
        return {s: s.names[0] for s in slots}
    if isinstance(params, (str, nn.Parameter, torch.Tensor)):
        params = [params]
    by_name = {n: s for s in slots for n in s.names}
    by_user = {s.user: s for s in slots}
    out: dict[FlatParam, str] = {}
    for p in params:
        s = by_name.get(p) if isinstance(p, str) else by_user.get(p)
        if s is None:
            what = repr(p) if isinstance(p, str) else f"a {tuple(p.shape)} tensor"
            raise ValueError(
                f"{what} is not a parameter of the sharded {type(engine.model).__name__}; "
                "pass its parameters (as model.parameters() gives them after shard()) or "
                "their names (model.named_parameters())")
        out.setdefault(s, p if isinstance(p, str) else s.names[0])
    return out
