"""What a step computes, op by op: the records a time model prices.

[Note: ops of a step]
A trace (memory/traced.py) runs one real training step of the real engine on fake
tensors; :class:`OpRecorder` watches it at the dispatcher, below autograd, so it sees
what the CPU or GPU would execute: the model's forward, autograd's backward (with
checkpointing's recompute), the engine's copies, casts and flattening, and the optimizer.
Each op goes into one *class* that the calibration profile has a price for:

* ``gemm`` — ``mm``/``addmm``/``bmm``/``baddbmm``: ``2·m·n·k`` FLOPs (per batch), keyed by
  its shape ``(b, m, n, k)`` and dtype, priced at the achieved FLOP/s of that shape;
* ``attention`` — the fused scaled-dot-product kernels, forward or backward, keyed by
  ``(b, h, s, d)``;
* ``optimizer`` — a fused Adam/AdamW update (the trace steps AdamW fused), keyed by its
  element count and priced at the engine's own chunked step per element;
* ``view`` — ops that move no data (views, ``detach``, ``empty``): dispatch overhead only;
* every other op is memory-bound, priced by the bytes it reads and writes (its tensor
  arguments and outputs) at the measured rate of its kind (``memory_classes``).

Collectives are not ops here: the engine's ledger records them (priced by
:mod:`zeroshard.timing.model`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

__all__ = ["OpRecorder", "StepOps", "op_class", "MEMORY_CLASSES"]

_GEMM = {"mm", "addmm", "bmm", "baddbmm"}
_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": "fwd",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "bwd",
    "_scaled_dot_product_flash_attention": "fwd",
    "_scaled_dot_product_flash_attention_backward": "bwd",
    "_scaled_dot_product_efficient_attention": "fwd",
    "_scaled_dot_product_efficient_attention_backward": "bwd",
    "_scaled_dot_product_cudnn_attention": "fwd",
    "_scaled_dot_product_cudnn_attention_backward": "bwd",
}
_OPTIMIZER = {"_fused_adamw_", "_fused_adam_"}
_VIEW = {
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice",
    "select", "detach", "alias", "unsqueeze", "squeeze", "reshape", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "empty", "empty_strided", "empty_like", "set_", "resize_",
    "lift_fresh", "_reshape_alias", "view_as", "unflatten", "flatten", "diagonal",
    "is_same_size", "_local_scalar_dense", "new_empty", "new_empty_strided", "record_stream",
}
#: memory-bound kinds with a price of their own; anything else is ``elementwise``
MEMORY_CLASSES = {
    "transcendental": {"gelu", "gelu_backward", "tanh", "tanh_backward", "exp", "log", "silu",
                       "silu_backward", "sigmoid", "sigmoid_backward", "erf", "pow", "rsqrt",
                       "sqrt", "reciprocal"},
    "softmax": {"_softmax", "_softmax_backward_data", "_log_softmax",
                "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"},
    "norm": {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
             "_fused_rms_norm_backward"},
    "reduction": {"sum", "mean", "norm", "linalg_vector_norm", "amax", "max", "min",
                  "var_mean", "_foreach_norm"},
    "index": {"embedding", "embedding_dense_backward", "index_select", "gather", "scatter",
              "scatter_add", "index_add", "index_put", "index", "_embedding_bag"},
    "copy": {"copy_", "_to_copy", "clone", "cat", "contiguous", "fill_", "zero_", "zeros",
             "zeros_like", "ones_like", "full", "fill", "new_zeros", "stack"},
}
_KIND = {name: kind for kind, names in MEMORY_CLASSES.items() for name in names}
# not kernels in a real run (prim: metadata queries) or priced elsewhere (collectives: ledger)
_SKIP_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor", "profiler", "prim")


#: Allocations from this size on are counted (glibc serves smaller ones from its heap).
FRESH_MIN = 128 * 2**10


def op_class(name: str) -> str:
    """The class an aten op name (its overload packet, e.g. ``"addmm"``) is priced as."""
    if name in _GEMM:
        return "gemm"
    if name in _ATTENTION:
        return "attention"
    if name in _OPTIMIZER:
        return "optimizer"
    if name in _VIEW:
        return "view"
    return _KIND.get(name, "elementwise")


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor):
            yield x


def _bytes(args: Any, out: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in (*_tensors(args), *_tensors(out)):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _transposed(t: torch.Tensor) -> int:
    """1 where a matrix operand is a transposed view (column-major): the kernel's speed
    depends on it, and backward's products take such views."""
    return int(t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1)


def _gemm_key(name: str, args: tuple) -> tuple:
    """(b, m, n, k, dtype, a transposed, b transposed) of a matrix product."""
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = 1 if a.dim() == 2 else a.shape[0]
    return (batch, a.shape[-2], b.shape[-1], a.shape[-1], _dtype(a),
            _transposed(a), _transposed(b))


def _causal(name: str, args: tuple, kwargs: dict) -> int:
    if "is_causal" in kwargs:
        return int(bool(kwargs["is_causal"]))
    # forward (q, k, v, dropout_p, is_causal, ...); backward (grad, q, k, v, out, lse,
    # dropout_p, is_causal, ...) on CPU
    at = 4 if _ATTENTION[name] == "fwd" else 7
    return int(bool(args[at])) if len(args) > at and isinstance(args[at], bool) else 0


def _attention_key(name: str, args: tuple, kwargs: dict) -> tuple:
    """(direction, b, h, s_q, s_kv, d, dtype, causal) of a fused attention kernel."""
    first = 1 if _ATTENTION[name] == "bwd" else 0  # backward: grad_out first
    q, k = args[first], args[first + 1]
    b, h, s, d = q.shape
    return (_ATTENTION[name], b, h, s, k.shape[2], d, _dtype(q), _causal(name, args, kwargs))


@dataclass
class StepOps:
    """A step's ops by phase ("forward", "backward", "step"): ``counts[phase][(cls, key)]``.

    Keys: gemm ``(b, m, n, k, dtype, a_t, b_t)``; attention ``(dir, b, h, s, s_kv, d,
    dtype, causal)``;
    optimizer ``(elements,)``; view ``()``; memory classes ``(bytes,)``."""

    counts: dict[str, Counter] = field(default_factory=dict)

    def add(self, phase: str, cls: str, key: tuple) -> None:
        self.counts.setdefault(phase, Counter())[(cls, key)] += 1

    def items(self, phase: str | None = None) -> Iterator[tuple[str, str, tuple, int]]:
        for ph, c in self.counts.items():
            if phase is None or ph == phase:
                for (cls, key), n in c.items():
                    yield ph, cls, key, n

    def gemm_shapes(self) -> set[tuple]:
        return {key for _, cls, key, _ in self.items() if cls == "gemm"}

    def attention_shapes(self) -> set[tuple]:
        return {key for _, cls, key, _ in self.items() if cls == "attention"}

    def to_dict(self) -> dict[str, list]:
        return {ph: [[cls, list(key), n] for (cls, key), n in c.items()]
                for ph, c in self.counts.items()}

    @classmethod
    def from_dict(cls, d: dict[str, list]) -> StepOps:
        out = cls()
        for ph, rows in d.items():
            for c, key, n in rows:
                out.counts.setdefault(ph, Counter())[(c, tuple(key))] += n
        return out


class OpRecorder(TorchDispatchMode):
    """Records the ops of the step ``phase`` names (``phase[0]`` as ``run_steps`` keeps it:
    "forward of step 2", "backward of step 2", "optimizer step 2") when it is ``step``."""

    def __init__(self, phase: list[str], step: int) -> None:
        super().__init__()
        self.phase, self.step = phase, step
        self.ops = StepOps()

    def _phase(self) -> str | None:
        p = self.phase[0]
        if p == f"forward of step {self.step}":
            return "forward"
        if p == f"backward of step {self.step}":
            return "backward"
        if p == f"optimizer step {self.step}":
            return "step"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor desugars first; we see its local ops
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        phase = self._phase()
        if phase is None or func.namespace in _SKIP_NAMESPACES:
            return out
        name = func._overloadpacket.__name__
        cls = op_class(name)
        if cls == "gemm":
            key: tuple = _gemm_key(name, args)
        elif cls == "attention":
            key = _attention_key(name, args, kwargs)
        elif cls == "optimizer":
            key = (sum(p.numel() for p in args[0]),)
        elif cls == "view":
            key = ()
            if name == "resize_" and args[0].untyped_storage().nbytes() >= FRESH_MIN:
                self.ops.add(phase, "alloc", (args[0].untyped_storage().nbytes(),))
        else:
            key = (_bytes((args, kwargs), out),)
        self.ops.add(phase, cls, key)
        self._allocations(phase, args, out)
        return out

    def _allocations(self, phase: str, args: tuple, out: Any) -> None:
        """Storages an op created (not one of its inputs'), or grew (``resize_``): memory
        the process may have to take from the system ([Note: fresh memory])."""
        inputs = {t.untyped_storage()._cdata for t in _tensors(args)}
        for t in _tensors(out):
            st = t.untyped_storage()
            if st._cdata not in inputs and st.nbytes() >= FRESH_MIN:
                self.ops.add(phase, "alloc", (st.nbytes(),))
