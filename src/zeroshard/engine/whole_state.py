"""A whole-parameter optimizer's state in torch's format (see [Note: whole-parameter
updates] in whole.py): each parameter's state lives on its owner rank, whole.

``state_dict()`` is what torch's optimizer over the unsharded model returns, on every
rank (each owner's entries, gathered: a collective where the optimizer is sharded);
``load_state_dict`` keeps on each rank the entries of the parameters it owns, with no
communication. ``optimizer.state`` on a rank holds the parameters it owns.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..comm import Comm
from .whole import WholeUpdates

__all__ = ["whole_state_dict", "whole_state_local", "whole_state_by_name", "load_whole_state", "whole_state_view"]


def whole_state_dict(whole: WholeUpdates, inner: torch.optim.Optimizer,
                     index: dict[torch.Tensor, int], device: torch.device
                     ) -> dict[int, dict[str, Any]]:
    """``{parameter index: state}`` of every parameter, on every rank (``index``: the
    user parameter -> its number in torch's format)."""
    mine: dict[int, dict[str, Any]] = {}
    for s, t in whole.tensors.items():
        st = inner.state.get(t)
        if st and s.user in index:
            mine[index[s.user]] = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v)
                                   else v for k, v in st.items()}
    if whole.size == 1:  # every rank owns every parameter (stage 0)
        return mine
    out: dict[int, dict[str, Any]] = {}
    for part in _all_gather_objects(whole.comm, mine, device):
        out.update(part)
    return out


def whole_state_local(whole: WholeUpdates, inner: torch.optim.Optimizer,
                      index: dict[torch.Tensor, int]) -> dict[int, dict[str, Any]]:
    """``{parameter index: state}`` as torch's DCP API gets it by default ([Note: sharded
    state dicts for torch's DCP API]): the parameters this rank owns, their state as it
    is (views: ``dcp.load`` writes in place); once stepped, an empty entry for each one
    another rank owns. No communication."""
    return {index[user]: {k: v.detach() if torch.is_tensor(v) else v for k, v in st.items()}
            for user, st in whole_state_view(whole, inner).items() if user in index}


def whole_state_by_name(whole: WholeUpdates, inner: torch.optim.Optimizer,
                        device: torch.device) -> dict[str, dict[str, Any]]:
    """``{canonical parameter name: state}`` of every stepped parameter, on every rank
    (CPU copies; gathered from the owners where the optimizer is sharded)."""
    names = {s.user: s.names[0] for s in whole.owner}
    index = {user: i for i, user in enumerate(names)}
    by_index = whole_state_dict(whole, inner, index, device)
    users = list(names)
    return {names[users[i]]: st for i, st in sorted(by_index.items())}


def _all_gather_objects(comm: Comm, obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (pickled, through the ledger and the collective check)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(comm.size, dtype=torch.int64, device=device)
    sizes[comm.rank] = data.numel()
    comm.all_reduce(sizes, phase="state", unit="optimizer.state_dict").wait()
    sizes = sizes.tolist()
    m = max(sizes)
    full = torch.zeros(comm.size * m, dtype=torch.uint8, device=device)
    full[comm.rank * m : comm.rank * m + data.numel()].copy_(data)
    comm.all_gather(full, phase="state", unit="optimizer.state_dict").wait()
    full = full.cpu()
    return [pickle.loads(full[q * m : q * m + sizes[q]].numpy().tobytes())
            for q in range(comm.size)]


def load_whole_state(whole: WholeUpdates, inner: torch.optim.Optimizer,
                     by_param: dict[torch.Tensor, Any]) -> None:
    """Each owned parameter's entry of ``by_param`` (user parameter -> torch-format
    state, None: never stepped) into ``inner``, cast as torch's own load casts it."""
    whole.started = whole.started or any(bool(v) for v in by_param.values())
    for s, t in whole.tensors.items():
        st = by_param.get(s.user)
        if not st:
            inner.state.pop(t, None)
            continue
        inner.state[t] = {k: _cast(k, v, t) for k, v in st.items()}


def _cast(key: str, value: Any, param: torch.Tensor) -> Any:
    """Torch's rule (Optimizer._process_value_according_to_param_policy): ``step``
    stays as saved, floating state takes the parameter's dtype, all of it its device."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.detach().clone()
    if value.is_floating_point():
        return value.detach().to(dtype=param.dtype, device=param.device, copy=True)
    return value.detach().to(device=param.device, copy=True)


def whole_state_view(whole: WholeUpdates, inner: torch.optim.Optimizer
                     ) -> dict[Any, dict[str, Any]]:
    """``optimizer.state`` by user parameter: the state of the parameters this rank owns;
    once the optimizer has stepped (or loaded state), an empty entry for each parameter
    another rank owns. So the view is empty on every rank or on none: torch's DCP
    ``get_state_dict`` runs a step (a collective here) on a fresh optimizer, which it
    recognises by an empty ``optimizer.state``, and a rank owning no parameter must not
    look fresh alone."""
    out: dict[Any, dict[str, Any]] = {}
    for s in whole.owner:
        t = whole.tensors.get(s)
        st = inner.state.get(t) if t is not None else None
        if st:
            out[s.user] = st
        elif whole.started and t is None:
            out[s.user] = {}
    return out
