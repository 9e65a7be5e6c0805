"""Hugging Face ``transformers`` causal LMs under zeroshard (the ``zeroshard[hf]`` extra).

``zeroshard.shard(hf_model, torch.optim.AdamW, stage=3)`` needs nothing from this module:
the stage-3 units default to the model's first ``nn.ModuleList``, which for HF causal LMs
is the decoder-layer list (``model.layers``, ``transformer.h``), tied input/output
embeddings are one parameter owned by the root unit, and ``ModelOutput`` (a dict
subclass that ``transformers`` registers with ``torch.utils._pytree``) passes through the
engine's output hooks, fp16 loss scaling included: a model called with ``labels=``
returns a 0-dim ``loss``, and only that is scaled. This module adds what is HF-specific:

* :func:`decoder_layers` — the decoder-layer list, from known attribute paths;
* :func:`apply_checkpointing` — the activation-checkpoint policies on HF models, with an
  op-level ``selective`` policy (see [Note: selective checkpointing of HF attention]);
* :func:`save_pretrained` — an export that ``AutoModelForCausalLM.from_pretrained(dir)``
  loads, for peft models the adapter ``PeftModel.from_pretrained`` loads or the merged
  model (zeroshard/hf_export.py, [Note: exports check themselves]);
* :func:`load_config`, :func:`model_config_from_hf` — an HF config as the planner's shape
  (``zeroshard plan --hf-config``); :func:`bench_model` — ``zeroshard bench --hf-config``.

``transformers`` is imported only inside the functions that need it: ``import
zeroshard`` never imports it, and neither does ``import zeroshard.hf``.

[Note: selective checkpointing of HF attention]
Korthikanti et al. (2022, sec. 4.2) recompute only the attention core (QK^T, softmax,
dropout, attention over V): its a*s^2 scores are large to store and cheap to recompute.
zeroshard's own models keep that core in a ``CoreAttention`` module, so the core
``selective`` policy checkpoints exactly it. HF attention modules (``LlamaAttention``,
``GPT2Attention``) compute the projections *and* the core in one ``forward``, with the
core in a function (``eager_attention_forward``, ``sdpa_attention_forward``), so there is
no module to wrap. We therefore checkpoint the whole attention module with an op-level
*selective activation checkpoint* (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``, torchtitan's op-level SAC mechanism): the
outputs of the projection matmuls (``aten.mm`` / ``aten.addmm``: q, k, v and the output
projection) are saved in forward; every other op of the module — rotary embedding,
``bmm`` of QK^T and of the probabilities with V, softmax, dropout, SDPA kernels — is
recomputed in backward. So the projections (the module's FLOPs) run once and the scores
are never stored: the same trade as Korthikanti's selective recompute. With a fused SDPA
kernel the scores are not stored anyway and the policy saves little (the kernel's output
and log-sum-exp); with ``attn_implementation="eager"`` it drops the a*s^2 terms.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpointing import CheckpointPolicy, Selective, parse_policy
from .checkpointing import apply_checkpointing as _core_apply_checkpointing
from .checkpointing import remove_checkpointing as _core_remove_checkpointing
from .hf_export import ExportError, save_pretrained

__all__ = [
    "BENCH_CONFIG_ENV",
    "CausalLMLogits",
    "ExportError",
    "apply_checkpointing",
    "bench_model",
    "decoder_layers",
    "load_config",
    "model_config_from_hf",
    "remove_checkpointing",
    "save_pretrained",
    "selective_modules",
]

#: Attribute paths of the decoder-layer list in HF causal LMs, most common first.
LAYER_PATHS = (
    "model.layers",  # Llama, Mistral, Qwen2, Gemma, Phi-3, ...
    "transformer.h",  # GPT-2, GPT-J, Falcon, Bloom
    "model.decoder.layers",  # OPT
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "transformer.layers",
    "transformer.blocks",  # MPT
    "model.language_model.layers",
    "layers",
    "h",
)

#: Environment variable through which ``zeroshard bench --hf-config`` names the config
#: for :func:`bench_model` on every rank.
BENCH_CONFIG_ENV = "ZEROSHARD_HF_CONFIG"

_INSTALL = "pip install 'zeroshard[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"zeroshard.hf needs transformers ({exc}); {_INSTALL}") from None
    return transformers


# -- layers -----------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder-layer list: the first of :data:`LAYER_PATHS` that is a
    non-empty ``nn.ModuleList``, else the first ``ModuleList`` of HF
    ``GradientCheckpointingLayer`` modules.

    Pass it as ``zeroshard.shard(model, ..., stage=3, units=list(decoder_layers(model)))``
    when the default (the first ``nn.ModuleList``) would pick another list.
    """
    for path in LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and all(
            any(c.__name__ == "GradientCheckpointingLayer" for c in type(b).__mro__) for b in m
        ):
            return m
    raise ValueError(
        f"found no decoder-layer list in {type(model).__name__} (tried "
        f"{', '.join(LAYER_PATHS)} and a ModuleList of GradientCheckpointingLayer); for "
        "stage 3 pass the repeated layers yourself: zeroshard.shard(model, ..., stage=3, "
        "units=list(model.<path to the layers>)) or a predicate units=lambda m: "
        "isinstance(m, MyDecoderLayer)"
    )


# -- activation checkpointing -----------------------------------------------------------
Match = str | type | Callable[[str, nn.Module], bool]


def _is_attention(name: str, module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def selective_modules(model: nn.Module, match: Match | None = None) -> list[nn.Module]:
    """Each decoder layer's attention module(s), outermost only: class names ending in
    ``Attention`` (``LlamaAttention``, ``GPT2Attention``), or ``match`` (a class-name
    substring, a type, or ``fn(name_inside_layer, module) -> bool``)."""
    hit = _is_attention if match is None else Selective(match=match)._hit
    found: list[nn.Module] = []
    for layer in decoder_layers(model):
        inside: set[int] = set()
        for n, m in layer.named_modules():
            if n and id(m) not in inside and hit(n, m):
                found.append(m)
                inside.update(id(s) for s in m.modules())
    return found


def _storages(args: tuple, kwargs: dict) -> set[int]:
    return {t.untyped_storage()._cdata for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor)}


def _sac_context(inputs: set[int]) -> Callable[[], tuple[Any, Any]]:
    """SAC contexts for one call of an attention module whose tensor inputs live in the
    storages ``inputs``: save the outputs of matmuls *of those inputs* (the q, k, v
    projections); recompute every other op. The output projection is recomputed in
    principle, but nothing after it is saved, so the recompute stops before it (torch's
    early stop): it never runs twice. Exact under in-place writes into a kept projection
    ([Note: in-place writes into a kept output], sac_policy.py)."""
    from .sac_policy import keep_outputs_contexts

    aten = torch.ops.aten
    matmuls = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> index of its input matrix

    def keep(op: Any, args: tuple) -> bool:
        i = matmuls.get(op)
        return i is not None and isinstance(args[i], torch.Tensor) and (
            args[i].untyped_storage()._cdata in inputs)

    return lambda: keep_outputs_contexts(keep)


class _SelectiveMixin(nn.Module):
    """First in the MRO of ``Selective<Cls>``; see [Note: wrapping by class swap] in
    zeroshard/checkpointing.py, the same technique."""

    _zs_hf_original: type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._zs_hf_original.forward
        if not torch.is_grad_enabled():
            return forward(self, *args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, self, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_sac_context(_storages(args, kwargs)), **kwargs)


_CLASSES: dict[type, type] = {}


def _wrap_selective(m: nn.Module) -> None:
    cls = type(m)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Selective{cls.__name__}", (_SelectiveMixin, cls),
                             {"_zs_hf_original": cls})
    m.__class__ = _CLASSES[cls]


# -- the KV cache in checkpointed training ----------------------------------------------
# [Note: the KV cache under checkpointing]
# HF causal LMs default to ``use_cache=True``: each attention appends its keys and values
# to a cache object in forward. A checkpointed region runs that forward again in backward,
# so the append runs twice: under the op-level selective policy the recompute then sees
# other ops than the forward and fails ("aten.slice.Tensor encountered during backward
# but not found in storage"); under ``full`` it goes through and the cache handed back
# holds every key twice (16 -> 32 positions measured). HF's own gradient checkpointing
# turns the cache off in training for this reason; so do we, once a policy is applied:
# a forward pre-hook on the module that owns the decoder layers passes
# ``use_cache=False`` to training forwards with gradients (logged once). Generation and
# evaluation (no gradients, or eval mode) keep the cache. A cache the caller passes in
# (``cache=``, ``past_key_values=`` before transformers 5.2x) in such a forward cannot be
# made safe and is refused.
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # newest first
_LOG_ONCE: set[str] = set()


def _training_with_grads(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


def _cache_off_in_training(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The decoder's forward pre-hook; see [Note: the KV cache under checkpointing]."""
    if not _training_with_grads(module):
        return None
    given = next((k for k in _CACHE_ARGS if kwargs.get(k) is not None), None)
    if given is not None:
        raise ValueError(
            f"{given}= was passed to a training forward of a model with activation "
            "checkpointing: the recompute in backward would append to the cache a second "
            "time. Pass no cache in training (use_cache=False), or remove the checkpointing "
            "(zeroshard.hf.remove_checkpointing(model))")
    if kwargs.get("use_cache") is False:
        return None
    if type(module).__name__ not in _LOG_ONCE:
        _LOG_ONCE.add(type(module).__name__)
        import logging

        logging.getLogger("zeroshard.hf").warning(
            "use_cache=True is incompatible with activation checkpointing in training (the "
            "recompute would fill the KV cache twice): %s runs with use_cache=False while "
            "training with gradients, as HF's gradient checkpointing does",
            type(module).__name__)
    return args, {**kwargs, "use_cache": False}


def _decoder(model: nn.Module) -> nn.Module:
    """The module that owns the decoder-layer list (LlamaModel, GPT2Model, ...)."""
    layers = decoder_layers(model)
    return next(m for m in model.modules() if any(c is layers for c in m.children()))


def _hook_cache(model: nn.Module) -> None:
    decoder = _decoder(model)
    if getattr(decoder, "_zs_cache_hook", None) is None:
        decoder._zs_cache_hook = decoder.register_forward_pre_hook(  # type: ignore[assignment]
            _cache_off_in_training, with_kwargs=True)


def _unhook_cache(model: nn.Module) -> None:
    for m in model.modules():
        handle = m.__dict__.pop("_zs_cache_hook", None)
        if handle is not None:
            handle.remove()


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_checkpointing` (both the core policies and HF selective)."""
    for m in model.modules():
        if isinstance(m, _SelectiveMixin):
            m.__class__ = type(m)._zs_hf_original
    _unhook_cache(model)
    return _core_remove_checkpointing(model)


def _hf_checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def apply_checkpointing(
    model: nn.Module,
    policy: str | CheckpointPolicy = "full",
    *,
    attention: Match | None = None,
    offload_activations: bool = False,
    pin_memory: bool = True,
) -> nn.Module:
    """Apply an activation-checkpoint policy to an HF model's decoder layers, in place.

    ``none``, ``full``, ``every-k`` and ``sqrt`` are zeroshard's policies
    (:func:`zeroshard.checkpointing.apply_checkpointing`) over :func:`decoder_layers`.
    ``selective`` checkpoints each layer's attention module with an op-level policy that
    saves the projection matmuls and recomputes the attention core (see [Note: selective
    checkpointing of HF attention]); ``attention=`` picks other modules (see
    :func:`selective_modules`). A ``Selective(match=...)`` object is applied as the
    core policy (plain checkpoint of the matched modules).

    HF's own ``model.gradient_checkpointing_enable()`` also works under zeroshard (it
    composes like ``full``); using both would checkpoint twice, so this refuses while
    HF's flag is on. Returns ``model``.
    """
    pol = parse_policy(policy)
    if pol.name != "none" and _hf_checkpointing_on(model):
        raise ValueError(
            f"{type(model).__name__} already has HF gradient checkpointing on "
            "(model.gradient_checkpointing_enable()); applying zeroshard's "
            f"{pol.name!r} too would checkpoint the layers twice. Use one: call "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
            "transformers 5) first, or keep HF's and skip this call"
        )
    remove_checkpointing(model)
    layers = list(decoder_layers(model))
    if type(pol) is Selective and pol.match == Selective.match:  # the default: HF-aware
        if offload_activations:
            raise ValueError(
                "offload_activations is not supported with HF selective checkpointing; use "
                "'full' or 'every-k' with offload_activations=True"
            )
        mods = selective_modules(model, attention)
        if not mods:
            classes = sorted({type(b).__name__ for b in layers})
            raise ValueError(
                f"selective checkpointing found no attention module in {len(layers)} decoder "
                f"layers ({', '.join(classes)}): no submodule class ends with 'Attention'. "
                "Pass attention= (a class-name substring, a type or fn(name, module) -> "
                "bool), or use 'full' / 'every-k'"
            )
        for m in mods:
            _wrap_selective(m)
        _hook_cache(model)
        return model
    if pol.name != "none":
        _hook_cache(model)
    return _core_apply_checkpointing(model, pol, blocks=layers,
                                     offload_activations=offload_activations,
                                     pin_memory=pin_memory)


# -- configs: planner and bench ---------------------------------------------------------
def load_config(path: str | os.PathLike[str]) -> Any:
    """An HF config from a ``config.json`` file or a model directory, defaults filled
    in by its ``transformers`` config class (``AutoConfig``)."""
    tf = _transformers()
    p = Path(path)
    if p.is_dir():
        return tf.AutoConfig.from_pretrained(str(p))
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(p)!r} does not exist; give a config.json file or a model "
                         "directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(p)!r} as JSON: {exc}") from None
    return _config_from_dict(data, tf)


def _config_from_dict(data: Mapping[str, Any], tf: Any) -> Any:
    if not isinstance(data, Mapping) or "model_type" not in data:
        raise ValueError("the config has no 'model_type' (e.g. \"llama\", \"gpt2\"); give a "
                         "Hugging Face config.json")
    rest = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return tf.AutoConfig.for_model(data["model_type"], **rest)
    except ValueError as exc:
        raise ValueError(f"transformers does not know model_type {data['model_type']!r}: "
                         f"{exc}") from None


_LLAMA_LIKE = ("llama", "mistral")


def model_config_from_hf(config: Any) -> Any:
    """zeroshard's shape (:class:`~zeroshard.models.GPT2Config` or
    :class:`~zeroshard.models.LlamaConfig`) for an HF config: an HF config object, a dict
    (``config.json``'s content) or a path. Supported model types: ``gpt2`` and the
    Llama-shaped ``llama`` and ``mistral``; anything the shape cannot represent exactly
    (biases, untied GPT-2 head, another head_dim) is refused with the field named, since
    the planner's byte counts would be wrong. For other architectures use
    ``zeroshard plan --params <count>``.
    """
    from .models.config import GPT2Config, LlamaConfig

    if isinstance(config, (str, os.PathLike)):
        config = load_config(config)
    elif isinstance(config, Mapping):
        config = _config_from_dict(config, _transformers())
    d = config.to_dict()
    kind = d.get("model_type")
    fix = "use zeroshard plan --params <parameter count> for a Llama-like estimate"
    if kind == "gpt2":
        h = d["n_embd"]
        if d.get("n_inner") not in (None, 4 * h):
            raise ValueError(f"gpt2 n_inner={d['n_inner']} is not 4 * n_embd = {4 * h}; "
                             f"zeroshard's GPT-2 shape has a 4h MLP; {fix}")
        if not d.get("tie_word_embeddings", True):
            raise ValueError(f"gpt2 tie_word_embeddings=False: zeroshard's GPT-2 shape ties the "
                             f"LM head; {fix}")
        if d.get("add_cross_attention"):
            raise ValueError(f"gpt2 add_cross_attention=True is not a causal-LM shape; {fix}")
        return GPT2Config(n_layers=d["n_layer"], hidden=h, n_heads=d["n_head"],
                          seq_len=d["n_positions"], vocab=d["vocab_size"],
                          norm_eps=d.get("layer_norm_epsilon", 1e-5),
                          dropout=float(d.get("resid_pdrop") or 0.0))
    if kind in _LLAMA_LIKE:
        h, heads = d["hidden_size"], d["num_attention_heads"]
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{kind} {flag}=True: zeroshard's Llama shape has no biases; "
                                 f"{fix}")
        head_dim = d.get("head_dim") or h // heads
        if head_dim * heads != h:
            raise ValueError(f"{kind} head_dim={head_dim} x num_attention_heads={heads} != "
                             f"hidden_size={h}; zeroshard's Llama shape has head_dim = "
                             f"hidden / heads; {fix}")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta")) or 10000.0
        return LlamaConfig(n_layers=d["num_hidden_layers"], hidden=h, n_heads=heads,
                           n_kv_heads=d.get("num_key_value_heads") or heads,
                           intermediate=d["intermediate_size"],
                           seq_len=d["max_position_embeddings"], vocab=d["vocab_size"],
                           norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                           tie_embeddings=bool(d.get("tie_word_embeddings", False)))
    raise ValueError(f"model_type {kind!r} is not supported by the planner (supported: gpt2, "
                     f"{', '.join(_LLAMA_LIKE)}); {fix}")


class CausalLMLogits(nn.Module):
    """``module(input_ids) -> logits`` around an HF causal LM, for code written for
    logits-returning models (``zeroshard bench``). State-dict keys gain a ``lm.`` prefix."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def bench_model() -> nn.Module:
    """``--model-factory`` for ``zeroshard bench --hf-config``: the causal LM of the config
    named by ``$ZEROSHARD_HF_CONFIG``, built by ``AutoModelForCausalLM.from_config``
    (random init from the global RNG, which the bench seeds identically on every rank)."""
    path = os.environ.get(BENCH_CONFIG_ENV)
    if not path:
        raise ValueError(f"${BENCH_CONFIG_ENV} is not set; use zeroshard bench --hf-config PATH")
    tf = _transformers()
    lm = tf.AutoModelForCausalLM.from_config(load_config(path))
    return CausalLMLogits(lm)
