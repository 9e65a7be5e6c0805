"""Whole weights streamed out of a sharded model, one bucket at a time: what an RL loop
pushes into an inference engine after every step (vLLM's ``load_weights(iterator)``).

``full_state_dict`` holds the whole model at once (~2.3x the model per rank at stage 3,
measured); a ``p.full_tensor()`` loop stays bounded but issues one collective per tensor.
:func:`stream_weights` gathers each bucket (a stage-3 unit: one or two buckets, by dtype
and trainability) in one collective and yields its tensors before gathering the next, so
the extra memory is about one unit, however large the model.

[Note: streaming memory]
On gloo (``Comm.decompose``) a bucket's pieces are broadcast straight into place in a
parameter-major buffer: one unit's bytes, no copy. Elsewhere (NCCL) the all-gather lands
rank-major and each tensor is copied out as it is yielded: one unit plus one tensor.
The tensors yielded are views of that buffer (or those copies): nothing is freed under
the caller, and a caller that keeps them all keeps the whole model, as it asked. A unit's
buffer is freed when the caller lets go of its tensors and the collective's worker thread
of it: gloo's lets go a moment after the collective completes, so on a loaded machine the
next unit's buffer may be allocated first — two units' bytes for an instant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from .engine.buffers import ignored_buffers, rank0_copies
from .engine.engine import engine_of
from .engine.flat import FlatBucket

__all__ = ["stream_weights"]


def _source(engine: Any, b: FlatBucket) -> tuple[torch.Tensor, bool]:
    """The bucket's master values: (this rank's shard, True) to gather, or (the whole
    full-layout tensor, False) where every rank holds them whole already."""
    if not engine.policy.shard_optimizer:
        return b.master.detach(), False  # stage 0
    if b.master_in_full:
        return b.full, False  # the masters are the weights' own chunks: whole and current
    return (b.master if b.master is not None else b.shard16).detach(), True


@torch.no_grad()
def _gathered(engine: Any, b: FlatBucket, dtype: torch.dtype | None
              ) -> Iterator[tuple[Any, torch.Tensor]]:
    """(slot, whole tensor) for each parameter of ``b``, after one collective."""
    src, sharded = _source(engine, b)
    if dtype is not None:
        src = src.to(dtype)  # cast first: fewer bytes on the wire
    if not sharded or b.world == 1:  # whole already: a copy, not a view of live weights
        for s in b.slots:
            yield s, src[s.offset : s.offset + s.numel].view(s.shape).clone()
        return
    comm = engine.comm
    src = src.to(b.device)  # offloaded masters are on the host; collectives on the device
    if comm.decompose:  # see [Note: streaming memory]
        full = torch.empty(b.padded_numel, dtype=src.dtype, device=b.device)
        b.shard_to_full(src, full)
        comm.all_gather_pieces(full, b.rank_pieces(full), phase="state", unit=b.name).wait()
        for s in b.slots:
            yield s, full[s.offset : s.offset + s.numel].view(s.shape)
        return
    gathered = torch.empty(b.padded_numel, dtype=src.dtype, device=b.device)
    b.shard_of(gathered).copy_(src)
    comm.all_gather(gathered, phase="state", unit=b.name).wait()
    for i, s in enumerate(b.slots):
        region = b.grad_region(gathered, i)  # its N chunks, rank-major: one copy
        yield s, region.reshape(-1)[: s.numel].view(s.shape)


def stream_weights(model: nn.Module, *, dtype: torch.dtype | None = None,
                   to_rank: int | None = None, buffers: bool = True,
                   merge_adapters: bool = False,
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for every parameter (and buffer) of a sharded model, one
    collective per bucket — per unit at stage 3 — with about one unit's bytes alive at a
    time ([Note: streaming memory]). Names are the model's ``state_dict()`` keys (both
    names of a tied weight, as it gives both; Hugging Face's names for HF models), in
    bucket order; values are the fp32 masters' (the exact values being trained), in
    ``dtype`` if given (cast before the collective), else in each parameter's dtype as
    built. Buffers are rank 0's, as ``full_state_dict`` gives them.

    A collective: every rank iterates it to the end. With ``to_rank`` only that rank
    gets tensors (the others' iterations are empty but still take part). Tensor
    parallelism is refused (use ``zeroshard.full_state_dict``).

    ``merge_adapters=True`` (a PEFT LoRA model): the base model's weights with the active
    LoRA adapters merged in — ``W + scaling · B @ A`` under the base model's names
    (``model.layers.0.self_attn.q_proj.weight``), adapter tensors left out — what an RL
    loop pushes into vLLM (TRL merges the same way); see [Note: merged adapters]."""
    engine = engine_of(model)
    if engine.tp is not None:
        raise NotImplementedError(
            "stream_weights() under tensor parallelism: each tp piece would need a tp "
            "collective per tensor; use zeroshard.full_state_dict(model) (or p.full_tensor() "
            "per parameter) there")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} is not a torch.dtype; pass e.g. torch.bfloat16")
    if to_rank is not None and (isinstance(to_rank, bool) or not isinstance(to_rank, int)):
        raise TypeError(f"to_rank={to_rank!r} is not a rank; pass an int (e.g. to_rank=0) "
                        "or None (every rank gets the tensors)")
    if to_rank is not None and not 0 <= to_rank < engine.world.size:
        raise ValueError(f"to_rank={to_rank} is not a rank of the model's group "
                         f"(0..{engine.world.size - 1})")
    if merge_adapters:
        return _merged(_stream(model, engine, dtype, to_rank, buffers), *_lora_layers(model),
                       _peft_prefix(model))
    return _stream(model, engine, dtype, to_rank, buffers)


def _stream(model: nn.Module, engine: Any, dtype: torch.dtype | None,
            to_rank: int | None, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    engine.world.sync_point("stream_weights")
    engine.refresh_handed_out("stream_weights after dcp.load")
    mine = to_rank is None or engine.world.rank == to_rank
    done: set[str] = set()
    for b in engine.all_buckets:
        for s, t in _gathered(engine, b, dtype):
            out = t if dtype is not None else t.to(engine.orig_dtype.get(s.names[0], t.dtype))
            done.update(s.names)
            if mine:
                for name in s.names:
                    yield name, out
        t = out = None  # the last views hold this bucket's buffer: not beside the next one
    rest = {k: t for k, t in nn.Module.state_dict(model, keep_vars=True).items()
            if k not in done}
    found = set(model.buffers())
    ignored = ignored_buffers(model)
    out = {k: t for k, t in rest.items() if t not in found}  # parameters kept whole
    if buffers:  # rank 0's (a broadcast), those kept out of DDP's broadcast each rank's
        out.update(rank0_copies({k: t for k, t in rest.items()
                                 if t in found and k not in ignored}, engine.world))
        out.update({k: t for k, t in rest.items() if t in found and k in ignored})
    for k, t in out.items():
        t = t.detach().clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if mine:
            yield k, t


# -- merged adapters ----------------------------------------------------------------------
# [Note: merged adapters]
# A PEFT LoRA layer holds its base weight (``<name>.base_layer.weight``) and, per adapter,
# ``lora_A`` (r x in) and ``lora_B`` (out x r); merged, the layer is one Linear whose
# weight is ``W + scaling · B @ A`` (transposed for ``fan_in_fan_out``). The three tensors
# belong to one stage-3 unit (the module that holds the layer), so they arrive within one
# unit's buckets: the stream holds the first ones until the third arrives, then yields the
# merged weight, computed in fp32 and cast back; with ``lora_bias=True`` the base bias
# gets ``scaling · lora_B.bias`` too (peft's merge). Names lose PEFT's ``base_model.model.``
# prefix and ``.base_layer``; the adapters' own tensors are not yielded. A
# ``modules_to_save`` module (a trained copy of the head, say) is yielded under its own
# names from the copy the merged model keeps: the active adapter's, or the original where
# adapters are disabled (peft's merge_and_unload does the same). DoRA, and LoRA on
# embeddings or convolutions, are refused (merge_adapters=False streams them unmerged).


def _peft_prefix(model: nn.Module) -> str:
    """``base_model.model.`` for a ``peft.PeftModel`` (its state dict's prefix), else ''."""
    return "base_model.model." if any(
        c.__name__ == "PeftModel" and c.__module__.startswith("peft")
        for c in type(model).__mro__) else ""


class _Lora(NamedTuple):
    """One LoRA layer's active adapter: its A and B tensors' names, scaling, whether the
    base weight is stored transposed (``fan_in_fan_out``) and whether B has a bias
    (``lora_bias=True``: merged into the base bias, ``b + scaling · lora_B.bias``)."""

    a: str
    b: str
    scaling: float
    transposed: bool
    bias: bool


def _lora_layers(model: nn.Module) -> tuple[dict[str, _Lora], set[str], dict[str, str]]:
    """Per LoRA layer with an active adapter (its name in the model), that adapter; the
    names of every LoRA layer; and per ``modules_to_save`` wrapper, the prefix of the copy
    the merged model keeps (the active adapter's trained copy, or the original module
    where adapters are disabled)."""
    layers, every, saved = {}, set(), {}
    for name, m in model.named_modules():
        if hasattr(m, "original_module") and hasattr(m, "modules_to_save"):
            active = [a for a in getattr(m, "active_adapters", []) if a in m.modules_to_save]
            saved[name] = (f"{name}.modules_to_save.{active[0]}."
                           if active and not getattr(m, "disable_adapters", False)
                           else f"{name}.original_module.")
            continue
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer")):
            continue
        every.add(name)
        active = [a for a in getattr(m, "active_adapters", []) if a in m.lora_A]
        if len(active) > 1:
            raise NotImplementedError(f"merge_adapters: {name} has several active adapters "
                                      f"{active}; activate one (model.set_adapter(name))")
        if not active:
            continue
        a = active[0]
        if getattr(m, "use_dora", {}).get(a) or a in getattr(m, "lora_embedding_A", {}):
            raise NotImplementedError(
                f"merge_adapters: {name} uses DoRA or LoRA on an embedding, which this stream "
                "does not merge; stream with merge_adapters=False (the base weights and the "
                "adapter tensors, unmerged) or merge with zeroshard.hf.save_pretrained("
                "merge_adapters=True)")
        if not isinstance(m.base_layer, nn.Linear):
            raise NotImplementedError(
                f"merge_adapters: {name} wraps a {type(m.base_layer).__name__}, not a Linear; "
                "stream with merge_adapters=False")
        layers[name] = _Lora(f"{name}.lora_A.{a}.weight", f"{name}.lora_B.{a}.weight",
                             float(m.scaling[a]), bool(getattr(m, "fan_in_fan_out", False)),
                             bool(getattr(m, "lora_bias", {}).get(a)))
    if not layers:
        raise ValueError("merge_adapters=True, but the model has no active LoRA layer (a "
                         "peft.get_peft_model model); stream without merge_adapters")
    return layers, every, saved


def _merged(stream: Iterator[tuple[str, torch.Tensor]], layers: dict[str, _Lora],
            every: set[str], saved: dict[str, str], prefix: str
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each LoRA layer's weight (and, with ``lora_bias``, its bias)
    merged and each ``modules_to_save`` wrapper's kept copy under the module's own names
    (see [Note: merged adapters])."""
    def inside(name: str, names: set[str] | dict[str, str]) -> str | None:
        layer = name.rpartition(".")[0]  # the innermost of ``names`` holding the tensor
        while layer and layer not in names:
            layer = layer.rpartition(".")[0]
        return layer or None

    part_of = {}  # tensor name -> (layer, role)
    for layer, lora in layers.items():
        part_of[f"{layer}.base_layer.weight"] = (layer, "w")
        part_of[lora.a], part_of[lora.b] = (layer, "a"), (layer, "b")
        if lora.bias:
            part_of[f"{layer}.base_layer.bias"] = (layer, "bias")
            part_of[lora.b.removesuffix(".weight") + ".bias"] = (layer, "b_bias")
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        if name in part_of:
            layer, role = part_of[name]
            parts = held.setdefault(layer, {})
            parts[role] = t
            lora = layers[layer]
            if len(parts) < (5 if lora.bias else 3):
                continue
            del held[layer]
            delta = parts["b"].float() @ parts["a"].float() * lora.scaling
            w = parts["w"]
            yield _plain_name(f"{layer}.weight", prefix), (
                w.float() + (delta.T if lora.transposed else delta)).to(w.dtype)
            if lora.bias:
                b = parts["bias"]
                yield _plain_name(f"{layer}.bias", prefix), (
                    b.float() + parts["b_bias"].float() * lora.scaling).to(b.dtype)
            continue
        layer = inside(name, every)
        if layer is not None:
            if not name.startswith(f"{layer}.base_layer."):
                continue  # an adapter's own tensor (another adapter's, inactive ones)
            name = f"{layer}.{name[len(layer) + len('.base_layer.'):]}"  # its bias
        wrapper = inside(name, saved)
        if wrapper is not None:
            if not name.startswith(saved[wrapper]):
                continue  # the copy the merged model does not keep
            name = f"{wrapper}.{name[len(saved[wrapper]):]}"
        yield _plain_name(name, prefix), t
    if held:
        raise RuntimeError(f"merge_adapters: the stream ended with LoRA layers incomplete: "
                           f"{sorted(held)}")


def _plain_name(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name
