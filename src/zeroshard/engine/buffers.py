"""The model's buffers (BatchNorm's running statistics and the like) across ranks: rank
0's at start-up, and before a forward that follows a training one, as DDP does."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm

__all__ = ["sync_module_states", "broadcast_buffers", "rank0_copies", "ignored_buffers",
           "materialize_buffers"]


@torch.no_grad()
def sync_module_states(model: nn.Module, frozen: list[nn.Parameter], world: Comm,
                       compute_dtype: torch.dtype | None, *, buffers: bool = True) -> None:
    """Start every rank from rank 0's buffers (unless not ``buffers``: DDP's
    ``broadcast_buffers=False``) and (stages 0-2) frozen parameters, as DDP does;
    trainable weights are broadcast per bucket (materialize.py). Frozen floating
    parameters then take the compute dtype, as stage 3 keeps them (its frozen buckets)."""
    ignored = ignored_buffers(model)
    for name, t in model.named_buffers() if buffers else ():
        if name in ignored:  # DDP's opt-out holds at start-up too
            continue
        buf = t if t.is_contiguous() else t.contiguous()
        world.broadcast(buf, 0, phase="init", unit=f"buffer {name}")
        if buf is not t:
            t.copy_(buf)
    for p in frozen:
        # a frozen tp parameter (a DTensor: tensor_parallel.py) by its local piece
        world.broadcast(getattr(p.data, "_local_tensor", p.data), 0, phase="init",
                        unit="frozen")
        if compute_dtype is not None and p.is_floating_point():
            p.data = p.data.to(compute_dtype)


def ignored_buffers(model: nn.Module) -> set[str]:
    """DDP's opt-out: names in ``model._ddp_params_and_buffers_to_ignore`` (set before
    shard(); read from the instance, where the sharded class has a property)."""
    return set(model.__dict__.get("_ddp_params_and_buffers_to_ignore", ()))


def _synced_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers DDP broadcasts before a forward: every module buffer, persistent or
    not (a non-persistent running statistic updated in training forwards drifted on
    rank 1 when only persistent ones went out: the weights ended 0.4 off DDP's), except
    those named in ``_ddp_params_and_buffers_to_ignore`` (DDP's opt-out). Read afresh
    each time: a buffer may have been reassigned."""
    ignored = ignored_buffers(model)
    return [(n, t) for n, t in model.named_buffers() if n not in ignored and not t.is_meta]


def _from_rank(named: list[tuple[str, torch.Tensor]], world: Comm, src: int, *,
               phase: str, unit: str, strict: bool) -> dict[str, torch.Tensor]:
    """Rank ``src``'s values of ``named``, as views of received flat tensors (detached:
    nothing is recorded, whatever the grad mode): one broadcast per dtype and device
    (``strict``: each checked before it is issued)."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault((t.dtype, t.device), []).append((name, t))
    out = {}
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for _, t in group])
        world.broadcast(flat, src, phase=phase, unit=unit, strict=strict)
        for (n, t), v in zip(group, flat.split([t.numel() for _, t in group])):
            out[n] = v.view_as(t)
    return out


def broadcast_buffers(model: nn.Module, world: Comm, src: int = 0, *,
                      phase: str = "forward", strict: bool = False) -> None:
    """Rank ``src``'s buffers to every rank before a forward that follows a training
    one — DDP's ``forward_sync_buffers`` (its default), so BatchNorm's running
    statistics are rank 0's everywhere as under DDP (under ``join()`` the highest rank
    still training, as DDP's join: rank 0 may have run out of data). Version counters
    are kept (as DDP does): a forward may have saved a buffer for a backward still to
    come. ``strict``: each broadcast (one per dtype) waits for its check (one rank alone
    in a forward at stages 0-2, or buffers of another size on each rank, must raise
    before anything is issued; see [Note: divergence] in comm_check.py)."""
    named = _synced_buffers(model)
    if not named:
        return
    # The broadcast runs in the caller's grad mode: the check's descriptor tells a
    # training forward from an evaluation (buffers never require grad).
    got = _from_rank(named, world, src, phase=phase, unit="buffers", strict=strict)
    tensors = tuple(t for _, t in named)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tensors):
        torch._foreach_copy_(list(tensors), [got[n] for n, _ in named])


def rank0_copies(tensors: dict[str, torch.Tensor], world: Comm) -> dict[str, torch.Tensor]:
    """Copies of rank 0's ``tensors`` (a state dict's buffers) on every rank, the live
    ones untouched: what a DDP user saves is rank 0's ``model.module.state_dict()``, and
    broadcasting the buffers themselves would overwrite rank-local statistics kept under
    ``broadcast_buffers=False``. Each broadcast is checked before it is issued (buffers
    of another size on each rank raise, nothing in flight)."""
    return _from_rank(list(tensors.items()), world, 0, phase="state",
                      unit="full_state_dict", strict=True)


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give a meta-built model real buffers, recomputed by its ``reset_buffers()``."""
    metas = [(m, n) for m in model.modules() for n, t in m._buffers.items()
             if t is not None and t.is_meta]
    if not metas:
        return
    reset = getattr(model, "reset_buffers", None)
    if not callable(reset):
        raise TypeError(
            f"{type(model).__name__} has buffers on the meta device but no reset_buffers() "
            "method to recompute them; add one, or build the model on a real device"
        )
    for m, n in metas:
        m._buffers[n] = torch.empty_like(m._buffers[n], device=device)
    reset()
