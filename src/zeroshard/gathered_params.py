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
from torch import nn

from .engine.engine import engine_of
from .engine.flat import FlatParam
from .engine.model_state import load_model_state_dict

__all__ = ["gathered_parameters"]


@contextmanager
def gathered_parameters(model: nn.Module,
                        params: Iterable[nn.Parameter | str] | nn.Parameter | str | None = None,
                        *, modifier_rank: int | None = None
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Whole fp32 copies of ``params`` (parameters of the sharded ``model`` or their names;
    None: all of them), ``{name: tensor}`` in model order, on every rank. ``modifier_rank``:
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
    copies: dict[str, torch.Tensor] = {}
    for b in engine.all_buckets:  # the same order on every rank
        mine = [s for s in b.slots if s in wanted]
        if mine:
            full = engine.full_master(b)
            for s in mine:
                copies[s.names[0]] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
    order = {n: i for i, n in enumerate(engine.user_params_by_name())}  # model order
    copies = dict(sorted(copies.items(), key=lambda kv: order[kv[0]]))
    yield copies
    if modifier_rank is None:
        return
    for name, t in copies.items():
        engine.world.broadcast(t, modifier_rank, phase="state", unit=name)
    load_model_state_dict(model, engine, copies, strict=False)


def _slots(engine, params) -> set[FlatParam]:
    """The slots of ``params`` (parameters or names, any alias)."""
    slots = [s for b in engine.all_buckets for s in b.slots]
    if params is None:
        return set(slots)
    if isinstance(params, (str, nn.Parameter, torch.Tensor)):
        params = [params]
    by_name = {n: s for s in slots for n in s.names}
    by_user = {s.user: s for s in slots}
    out: set[FlatParam] = set()
    for p in params:
        s = by_name.get(p) if isinstance(p, str) else by_user.get(p)
        if s is None:
            what = repr(p) if isinstance(p, str) else f"a {tuple(p.shape)} tensor"
            raise ValueError(
                f"{what} is not a parameter of the sharded {type(engine.model).__name__}; "
                "pass its parameters (as model.parameters() gives them after shard()) or "
                "their names (model.named_parameters())")
        out.add(s)
    return out

