"""A stage-3 parameter read outside its unit: torch's raw error, explained.

[Note: reads outside a unit]
At stage 3 a unit's parameters are whole only inside that unit's forward and backward;
elsewhere the modules hold the user parameters, DTensors sharded over the ranks
(params.py). Code that reads one outside its unit — the root computing with
``self.blocks[0].weight`` (a head tied by hand), or ``nn.MultiheadAttention`` when
``units=`` made its ``out_proj`` a unit of its own (it reads ``out_proj.weight``
directly) — computes with a DTensor and a plain tensor, and DTensor raises "got mixed
torch.Tensor and DTensor", naming neither the parameter nor the fix (FSDP2 raises the
same). ``ShardedModule.__call__`` turns exactly that error into
:class:`ParameterOutsideUnit`, found from the exception's traceback: the innermost frame
whose ``self`` is a module of the model is the module that read it; the parameter is a
local of a frame (``F.multi_head_attention_forward``'s ``out_proj_weight``: the
parameter itself, or a view starting where its shard does), or else what the reader's
line names as ``self.a.b[0].weight`` (DTensor's dispatch runs in C++, so an operand made
there, like F.linear's transpose, is in no frame). Nothing is found: torch's error as is.
"""

from __future__ import annotations

import linecache
import re
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ParameterOutsideUnit", "explain_outside_read"]

_RAW = "got mixed torch.Tensor and DTensor"


class ParameterOutsideUnit(RuntimeError):
    """A stage-3 parameter was read outside the unit that gathers it."""


def _frames(tb: TracebackType | None) -> list[Any]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out[::-1]  # innermost first


def _operands(frame: Any) -> list[torch.Tensor]:
    """Tensors among a frame's locals, one container level deep."""
    out = []
    for v in list(frame.f_locals.values()):
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, torch.Tensor):
                out.append(x)
    return out


def _start(t: torch.Tensor) -> int | None:
    """Where a DTensor's local shard starts: a view of a parameter (F.linear's
    transpose) starts where it does; parameters sharing a bucket's storage do not."""
    local = getattr(t, "_local_tensor", None)
    if local is None or local.numel() == 0:
        return None
    try:
        return local.data_ptr()
    except RuntimeError:
        return None


def _find(t: torch.Tensor, by_param: dict[torch.Tensor, str], by_start: dict[int, str]
          ) -> str | None:
    """The sharded parameter ``t`` is, or views: only a DTensor can be the culprit (a
    plain tensor beside it, the root's gathered parameter included, is whole)."""
    if getattr(t, "_local_tensor", None) is None:
        return None
    if t in by_param:
        return by_param[t]
    start = _start(t)
    return by_start.get(start) if start is not None else None


_CHAIN = re.compile(r"\bself((?:\.\w+|\[-?\d+\])+)")


def _step(obj: Any, attr: str, index: str) -> Any:
    """One step of ``self.a.b[0].weight`` through modules' own registries only: no
    property, parametrization or tensor indexing runs."""
    if not isinstance(obj, nn.Module):
        return None
    if attr:
        for table in (obj._modules, obj._parameters, obj._buffers):
            if attr in table:
                return table[attr]
        return None
    kids = list(obj._modules.values())
    i = int(index)
    return kids[i] if -len(kids) <= i < len(kids) else None


def _named_on_line(tb: TracebackType | None, reader: str, model: nn.Module,
                   by_param: dict[torch.Tensor, str]) -> str | None:
    """A parameter the reader's line names as ``self.a.b[0].weight``: only module,
    parameter and constant-index steps are followed (nothing is called)."""
    frame = next((f for f in _frames(tb) if isinstance(f.f_locals.get("self"), nn.Module)
                  and f.f_locals["self"] is model.get_submodule(reader)), None)
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    for chain in _CHAIN.findall(line):
        obj: Any = frame.f_locals["self"]
        for attr, index in re.findall(r"\.(\w+)|\[(-?\d+)\]", chain):
            obj = _step(obj, attr, index)
            if obj is None:
                break
        if hasattr(obj, "_local_tensor") and obj in by_param:
            return by_param[obj]
    return None


def _common(a: str, b: str) -> str:
    """The deepest module name containing both dotted names ('' for the root)."""
    out = []
    for x, y in zip(a.split(".") if a else [], b.split(".") if b else []):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def explain_outside_read(model: nn.Module, engine: Engine,
                         error: RuntimeError) -> ParameterOutsideUnit | None:
    """The error naming the parameter, its unit, the reader and the fix; None if
    ``error`` is not DTensor's mixed-operands error over one of the model's parameters."""
    if _RAW not in str(error) or not engine.units:
        return None
    by_param: dict[torch.Tensor, str] = {}
    by_start: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(p, name)
        start = _start(p)
        if start is not None:
            by_start.setdefault(start, name)
    modules = {m: n for n, m in model.named_modules()}
    param = reader = None
    for frame in _frames(error.__traceback__):
        if param is None:
            param = next((n for t in _operands(frame)
                          if (n := _find(t, by_param, by_start)) is not None), None)
        owner = frame.f_locals.get("self")
        if reader is None and isinstance(owner, nn.Module) and owner in modules:
            reader = modules[owner]
    if reader is None:
        return None
    if param is None:  # an operand made in C++ (F.linear's transpose): read the code
        param = _named_on_line(error.__traceback__, reader, model, by_param)
    if param is None:
        return None
    unit = next((u.name for u in engine.units
                 if not u.is_root and param.startswith(u.name + ".")), None)
    if unit is None:  # a root parameter: whole all step, so not the one refused
        return None
    owner_module = param.rpartition(".")[0]
    both = _common(reader, owner_module)
    said = repr(reader) if reader else f"the root ({type(model).__name__}.forward)"
    others = [u.name for u in engine.units if not u.is_root and u.name != unit]
    spelled = (", ".join(f"model.get_submodule({n!r})" for n in others) if len(others) <= 4
               else f"... the {len(others)} others ...")
    fix = (f"keep that parameter in the root: shard with units= listing the units "
           f"without {unit!r}, units=[{spelled}] (the root's parameters stay whole "
           "through forward and backward)")
    if both and both != owner_module:
        fix = (f"let {both!r} (which holds both) be the unit in place of "
               f"{unit!r}: units=[..., model.get_submodule({both!r}), ...] "
               f"(FSDP1 kept nn.MultiheadAttention whole for this reason); or {fix}")
    return ParameterOutsideUnit(
        f"{param!r} was read by {said} outside its stage-3 unit {unit!r}: outside that "
        "unit's forward and backward its parameters are shards (DTensors), so torch "
        f"refused the operation ({error}). Fix: {fix}.")
