"""Count FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` (a thin wrapper).

What FlopCounterMode counts
---------------------------
* Matrix multiplies and convolutions: ``mm``/``addmm``/``bmm``/``baddbmm`` cost
  ``2·m·n·k`` (one multiply and one add per term; the bias add of ``addmm`` is ignored),
  plus convolutions and scaled-dot-product attention kernels.
* Forward *and* backward when ``backward()`` runs inside the context: a linear layer's
  backward is two matmuls (grad of input, grad of weight), so forward+backward is 3x the
  forward — the "6Ψ FLOPs per token" rule (2Ψ forward + 4Ψ backward). If the input does
  not require grad its gradient is skipped and backward is 1x, not 2x.
* Elementwise ops, reductions, softmax, norms and optimizer updates are ignored; they
  are memory-bound and small next to the matmuls.
* It works under ``FakeTensorMode`` (shapes are all it needs), so FLOPs of a model too
  large to run can be counted. Activation recomputation (checkpointing) shows up as extra
  forward matmuls inside backward: about +33% for full recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FlopCounter", "count_flops"]

T = TypeVar("T")


class FlopCounter:
    """Context manager counting matmul/attention FLOPs of everything run inside it.

    Attributes (read after or during the block):
        total: FLOPs counted so far.
        by_op: FLOPs per aten op name (e.g. ``"aten.addmm"``).
        by_module: FLOPs per module path and op; ``"Global"`` holds the whole count.
            Module paths are those of modules called inside the block (forward and,
            suffixed ``(backward)``, their backward).

    Example::

        with FlopCounter() as fc:
            model(x).sum().backward()
        fc.total  # == 3 * forward FLOPs for a stack of linears with x.requires_grad
    """

    def __init__(self, *, depth: int | None = None) -> None:
        self._mode = FlopCounterMode(depth=depth if depth is not None else 2, display=False)

    def __enter__(self) -> FlopCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return int(self._mode.get_total_flops())

    @property
    def by_op(self) -> dict[str, int]:
        counts = self._mode.get_flop_counts().get("Global", {})
        return {_op_name(op): int(n) for op, n in counts.items()}

    @property
    def by_module(self) -> dict[str, dict[str, int]]:
        return {
            mod: {_op_name(op): int(n) for op, n in ops.items()}
            for mod, ops in self._mode.get_flop_counts().items()
        }

    def __repr__(self) -> str:
        return f"FlopCounter(total={self.total})"


def count_flops(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int, dict[str, int]]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, total_flops, flops_by_op)``.

    Call ``backward()`` inside ``fn`` to include backward FLOPs.
    """
    with FlopCounter() as fc:
        result = fn(*args, **kwargs)
    return result, fc.total, fc.by_op


def _op_name(op: Any) -> str:
    # OpOverloadPacket prints as "aten.addmm"; keep whatever str() gives for others.
    return str(op)
