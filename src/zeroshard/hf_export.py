"""Exporting a (sharded) Hugging Face model: :func:`save_pretrained`.

What is written depends on the model, so that the files load with the call a user of
that model already knows:

* a ``transformers`` model: ``config.json`` + ``model.safetensors``, for
  ``AutoModelForCausalLM.from_pretrained(dir)`` (or the class the config names);
* a ``peft`` model (``peft.get_peft_model``): the adapter in peft's own format
  (``adapter_config.json`` + ``adapter_model.safetensors``, written by peft's
  ``save_pretrained``), for ``PeftModel.from_pretrained(base, dir)``; with
  ``merge_adapters=True`` the base model with the adapters merged into its weights, for
  plain ``from_pretrained(dir)``.

[Note: exports check themselves]
``from_pretrained`` matches tensors to the model by name. A name it does not find keeps
the fresh random init, and the mismatch is only *printed* in a load report: a file with
the wrong names "loads" as a random model. A peft model exported as a full model was
exactly that (``base_model.model.…lora_A.default.weight`` keys under a
``LlamaForCausalLM`` config). So every export, before it writes a byte, builds what the
loader will build, on the meta device (no memory, no init cost): the class named in the
config for a full model, the base class with the same peft config for an adapter. It
then compares the names and shapes it is about to write with what that model expects,
strictly, and raises naming the missing, unexpected and misshapen tensors; nothing is
written then. Only rank 0 writes, and it tells the other ranks whether it succeeded, so
no rank returns from a failed export.

``transformers`` and ``peft`` are imported only inside these functions.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExportError", "save_pretrained"]

_SHOW = 6  # names listed per kind of mismatch in an error


class ExportError(ValueError):
    """An export would not load as the model that was trained; nothing was written."""


# -- what the model is ------------------------------------------------------------------
def _original_class(model: nn.Module) -> type:
    """The user's class, skipping the subclasses zeroshard creates (the sharded model's,
    which keeps the user's name and module, and the checkpoint wrappers')."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("zeroshard") and not cls.__dict__.get(
                "_zeroshard_swapped", False):
            return cls
    return type(model)


def _is_peft(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


def _is_transformers_model(cls: type) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and issubclass(cls, tf.PreTrainedModel)


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - a PeftModel implies peft
        raise ImportError(f"exporting a peft model needs peft ({exc}); pip install peft") from None
    return peft


def _meta_model(cls: type, config: Any) -> nn.Module:
    """``cls(config)`` on the meta device: names and shapes, no memory."""
    with torch.device("meta"):
        return cls(copy.deepcopy(config))


# -- tied parameters --------------------------------------------------------------------
def _tie_targets(model: nn.Module) -> set[str]:
    """Names HF re-ties on load (``_tied_weights_keys``: a list before transformers 5, a
    ``{target: source}`` dict since)."""
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return set(keys.keys() if isinstance(keys, Mapping) else keys)


def aliases(model: nn.Module) -> set[str]:
    """Every name but one of each tied parameter: what HF leaves out of its checkpoint."""
    engine = getattr(model, "_zeroshard_engine", None)
    alias_of = engine.faces.alias_of if engine is not None else {}
    groups: dict[torch.Tensor, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        # a tied parameter's alias (held between a forward and its backward) is the parameter
        groups.setdefault(alias_of.get(p, p), []).append(name)
    targets = _tie_targets(model)
    drop: set[str] = set()
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in targets), names[0])
            drop.update(n for n in names if n != keep)
    return drop


# -- the check --------------------------------------------------------------------------
def _compare(what: str, expected: Mapping[str, torch.Size],
             got: Mapping[str, torch.Tensor], fix: str) -> None:
    """Raise :class:`ExportError` unless ``got`` has exactly ``expected``'s names and
    shapes (see [Note: exports check themselves])."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(f"{k} {tuple(got[k].shape)} (expected {tuple(expected[k])})"
                    for k in set(expected) & set(got) if tuple(got[k].shape) != tuple(expected[k]))
    if not (missing or unexpected or shapes):
        return

    def some(names: list[str]) -> str:
        more = f", ... ({len(names)} in all)" if len(names) > _SHOW else ""
        return ", ".join(names[:_SHOW]) + more

    parts = [f"{len(missing)} missing ({some(missing)})" if missing else "",
             f"{len(unexpected)} unexpected ({some(unexpected)})" if unexpected else "",
             f"{len(shapes)} of another shape ({some(shapes)})" if shapes else ""]
    raise ExportError(
        f"refusing to export: {what} would not load the trained weights: of its "
        f"{len(expected)} tensors, " + "; ".join(p for p in parts if p)
        + f". The loader keeps random weights for names it does not find. {fix} "
        "Nothing was written."
    )


# -- full models ------------------------------------------------------------------------
def _full_tensors(model: nn.Module, state: Mapping[str, torch.Tensor],
                  dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    drop = aliases(model)
    out = {}
    for k, v in state.items():
        if k in drop:
            continue
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def _write_full(model: nn.Module, state: Mapping[str, torch.Tensor], out: Path,
                dtype: torch.dtype | None) -> None:
    from safetensors.torch import save_file

    cls = _original_class(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained") or not (
            _is_transformers_model(cls)):
        raise TypeError(
            f"{cls.__name__} is not a Hugging Face transformers model (a PreTrainedModel "
            "with model.config): from_pretrained could not build it from the exported "
            "config. save_pretrained exports transformers and peft models only; for other "
            "models (a wrapper around an HF model included) save "
            "zeroshard.full_state_dict(model) with torch.save"
        )
    if getattr(model, "_hf_peft_config_loaded", False):
        raise TypeError(
            f"{cls.__name__} carries PEFT adapters added through transformers "
            "(model.add_adapter / load_adapter); a full export would not load them. Build "
            "the model with peft.get_peft_model(model, config) before zeroshard.shard, then "
            "save_pretrained writes the adapter (or merge_adapters=True the merged model)"
        )
    tensors = _full_tensors(model, state, dtype)
    config = copy.deepcopy(config)
    config.architectures = [cls.__name__]
    fresh = _meta_model(cls, config)
    expected = {k: v.shape for k, v in fresh.state_dict().items() if k not in aliases(fresh)}
    _compare(f"{cls.__name__} (config.json's architectures)", expected, tensors,
             "Export the transformers model itself (not a wrapper around it), with the "
             "config it was built from.")
    saved = dtype or next((v.dtype for v in tensors.values() if v.is_floating_point()),
                          torch.float32)
    # transformers >= 4.56 names it dtype, before that torch_dtype.
    setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", saved)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# -- peft models ------------------------------------------------------------------------
def _meta_peft(model: nn.Module) -> nn.Module:
    """The peft model ``PeftModel.from_pretrained(base, dir)`` builds: the base class over
    the same config, with each of the model's adapters, on the meta device."""
    peft = _peft()
    base = model.get_base_model()
    names = list(model.peft_config)
    with torch.device("meta"):
        fresh_base = _original_class(base)(copy.deepcopy(base.config))
        fresh = peft.get_peft_model(fresh_base, copy.deepcopy(model.peft_config[names[0]]),
                                    adapter_name=names[0])
        for n in names[1:]:
            fresh.add_adapter(n, copy.deepcopy(model.peft_config[n]))
    return fresh


def _write_adapter(model: nn.Module, state: dict[str, torch.Tensor], out: Path,
                   dtype: torch.dtype | None) -> None:
    from peft.utils import get_peft_model_state_dict

    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    fresh = _meta_peft(model)
    for name in model.peft_config:
        written = get_peft_model_state_dict(model, state_dict=state, adapter_name=name)
        expected = get_peft_model_state_dict(fresh, state_dict=fresh.state_dict(),
                                             adapter_name=name)
        _compare(f"adapter {name!r} of {_original_class(model).__name__}",
                 {k: v.shape for k, v in expected.items()}, written,
                 "Export the peft model as peft built it (peft.get_peft_model), or pass "
                 "merge_adapters=True for a merged full model.")
    # peft's own writer, given the whole state (it would otherwise take state_dict(), a
    # collective at stage 3): the format PeftModel.from_pretrained reads, by definition.
    _peft().PeftModel.save_pretrained(model, str(out), state_dict=state, is_main_process=True)


def _merged(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """The base model with the active adapters merged (peft's ``merge_and_unload``), built
    over ``state`` without a second copy of the weights."""
    fresh = _meta_peft(model)
    expected = {k: v.shape for k, v in fresh.state_dict().items()}
    _compare(f"{_original_class(model).__name__}'s state", expected, state,
             "Export the peft model as peft built it (peft.get_peft_model).")
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.set_adapter(model.active_adapter)
    base = fresh.get_base_model()
    if hasattr(base, "tie_weights"):  # assign=True gave tied names separate tensors
        base.tie_weights()
    return fresh.merge_and_unload()


# -- the entry point --------------------------------------------------------------------
def _export(model: nn.Module, state: dict[str, torch.Tensor], out: Path,
            dtype: torch.dtype | None, merge_adapters: bool) -> None:
    if _is_peft(model):
        if merge_adapters:
            merged = _merged(model, state)
            _write_full(merged, merged.state_dict(), out, dtype)
        else:
            _write_adapter(model, state, out, dtype)
        return
    if merge_adapters:
        raise TypeError(f"merge_adapters=True, but {_original_class(model).__name__} is not a "
                        "peft model (peft.PeftModel): there are no adapters to merge; drop it")
    _write_full(model, state, out, dtype)


def _as_built(model: nn.Module, engine: Any, state: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """``full_state_dict``'s fp32 values in the dtypes the model was built in, as HF's own
    ``save_pretrained`` writes them (a bf16 model exports bf16; peft merges in them)."""
    built = dict(engine.orig_dtype)
    built.update((k, v.dtype) for k, v in model.named_buffers(remove_duplicate=False))
    return {k: v.to(built[k]) if v.is_floating_point() and k in built else v
            for k, v in state.items()}


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    merge_adapters: bool = False,
    dtype: torch.dtype | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Export the trained model in Hugging Face's format; see the module docstring for
    what each kind of model gets.

    Collective: every rank calls it (the weights come from
    :func:`zeroshard.full_state_dict`, the master values, in the dtypes the model was built
    in); rank 0 of
    ``process_group`` checks and writes, and every rank returns once the files exist, or
    raises if the export was refused ([Note: exports check themselves]). Tied parameters
    are stored once, under the name HF keeps (``transformer.wte.weight``, not
    ``lm_head.weight``); ``from_pretrained`` ties them again. ``dtype`` casts the
    floating tensors (default: the model's own) and is recorded in the config. Works on an
    unsharded
    model too (then nothing is collective but the outcome's broadcast, if a group exists).
    """
    from . import full_state_dict

    engine = getattr(model, "_zeroshard_engine", None)
    if engine is not None:
        engine.world.sync_point("save_pretrained")  # one rank alone: an error naming this
        state = _as_built(model, engine, full_state_dict(model))
    else:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    failure: BaseException | None = None
    if rank == 0:
        try:
            _export(model, state, Path(save_directory), dtype, merge_adapters)
        except Exception as exc:  # every rank must learn the outcome before raising
            failure = exc
    if distributed:
        said = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(said, src=src, group=process_group)
        if said[0] is not None and failure is None:
            raise ExportError(f"rank 0 refused the export to {str(save_directory)!r}: "
                              f"{said[0]}")
    if failure is not None:
        raise failure
