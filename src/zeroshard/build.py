"""Building a sharded model's engine: the process groups a layout needs (plain, hybrid,
tensor-parallel), the device a meta model materialises on, and the finishing touches
``shard()`` and ``shard_for_inference()`` share (api.py holds both)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import Comm, CommLedger
from .comm_links import Nodes, resolve_node_size
from .config import ShardConfig
from .engine.engine import Engine, ParamInit
from .engine.quantized_grads import two_hop_for
from .engine.secondary import resolve_reshard, secondary_comm
from .engine.tensor_parallel import (
    TensorParallel,
    is_tp_mesh,
    localize,
    sync_over_tp,
    tp_comms,
)
from .engine.units import UnitSpec
from .gather import give_units_their_calls, register_forward_method

__all__ = ["build_engine", "finish"]

_EXIT_HOOK = False


def build_engine(model: nn.Module, config: ShardConfig, *, units: UnitSpec,
                 param_init: ParamInit | None, device: torch.device | str | None,
                 hybrid: tuple[int, int] | None, mesh: Any,
                 process_group: dist.ProcessGroup | None, group_of: dict[str, int]) -> Engine:
    """The engine for ``model`` under ``config`` on the layout the arguments give."""
    stage = config.stage
    if units is not None and stage != 3:
        raise ValueError(f"units= applies to stage 3 only (stage={stage}); drop it")
    meta = next(model.parameters()).is_meta
    dev = resolve_device(device) if meta else None
    if meta and param_init is None:
        param_init = default_param_init(model)
    nodes = Nodes(_node_size(config.node_size, process_group))
    ledger = CommLedger(nodes=nodes)
    tp = None
    mesh = whole_mesh(model, mesh)
    check_dtensor_params(model, mesh)
    if is_tp_mesh(mesh):  # see [Note: tensor-parallel parameters]
        if process_group is not None or hybrid is not None:
            raise ValueError("a mesh with a tp dimension says the dp layout too; drop "
                             "process_group= and hybrid=")
        if meta:
            raise ValueError(
                "tensor parallelism needs real weights at shard(): materialise the model "
                "before parallelize_module (zeroshard.models.materialize), then shard it")
        comm, replicate, world, tp_comm = tp_comms(ledger, mesh, stage)
        sync_over_tp(model, tp_comm)  # before localize: tp parameters stay DTensors there
        specs = localize(model, mesh["tp"], frozen=stage == 3)
        if not specs:
            raise ValueError(
                "the mesh has a tp dimension but no parameter is a DTensor: apply "
                "parallelize_module(model, mesh['tp'], plan) before shard()")
        tp = TensorParallel(mesh, specs, tp_comm)
    elif hybrid is not None or mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or hybrid=/mesh=, not both")
        if stage == 0:
            raise ValueError(
                "hybrid sharding needs stage 1, 2 or 3 (stage 0 shards nothing); drop "
                "hybrid= or pick a stage"
            )
        from .hybrid import hybrid_comms

        comm, replicate, world, mesh = hybrid_comms(ledger, hybrid=hybrid, mesh=mesh)
    else:
        label = "world" if process_group is None else "dp"
        comm, replicate, world = Comm(process_group, ledger, label=label), None, None
    config, secondary = _secondary(config, comm, nodes)
    two_hop = two_hop_for(comm, config.quantize_grads, config.grad_error_feedback)
    if config.quantize_grads is not None and two_hop is None and dist.get_rank() == 0:
        warnings.warn(
            f"quantize_grads={config.quantize_grads!r} has no effect here: the shard group's "
            f"{comm.size} ranks lie on one node (node_size={nodes.size}"
            + (", hybrid sharding's shard groups" if replicate is not None else "")
            + "), so the gradients are reduce-scattered plainly, unquantised; declare the "
            "nodes with node_size= (logical nodes work on one machine) — docs/links.md",
            UserWarning, stacklevel=4)
    engine = Engine(model, config, comm, units=units, param_init=param_init, device=dev,
                    replicate=replicate, world=world, param_groups=group_of, mesh=mesh,
                    tp=tp, secondary=secondary, two_hop=two_hop)
    return engine


def _node_size(given: int | None, group: dist.ProcessGroup | None) -> int:
    """:func:`resolve_node_size`, once every rank agrees on it: torchrun's
    LOCAL_WORLD_SIZE differs between nodes of unequal size, and a rank that alone found its
    value acceptable would go on into collectives its peers never join ([Note: bytes by
    link] in comm_links.py)."""
    world = dist.get_world_size()
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(env) if env.isdigit() and int(env) > 0 else None
    mine = given if given is not None else (local or world)
    backend = str(dist.get_backend(group))
    if backend == "fake":  # a trace (memory/traced.py): one process, nothing to agree on
        return resolve_node_size(given, world)
    device = (torch.device("cuda", torch.cuda.current_device())
              if backend == "nccl" else torch.device("cpu"))
    bounds = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(bounds[0]), -int(bounds[1])
    if hi != lo:
        why = ("node_size= differs between ranks" if given is not None else
               "torchrun's LOCAL_WORLD_SIZE differs between nodes: nodes of unequal size")
        raise ValueError(
            f"the ranks disagree on the ranks per node ({lo} to {hi}; {why}): nodes are "
            "groups of node_size consecutive ranks, the same number on every node; give "
            "every rank the same node_size= (the ledger's split by node cannot describe "
            "unequal nodes)")
    if given is not None and local is not None and given != local and dist.get_rank() == 0:
        warnings.warn(
            f"node_size={given} differs from torchrun's LOCAL_WORLD_SIZE={local}: the "
            f"ledger counts nodes of {given} ranks, not the machines torchrun started "
            "(expected where logical nodes are declared on purpose)",
            UserWarning, stacklevel=5)
    return resolve_node_size(given, world)


def _secondary(config: ShardConfig, comm: Comm, nodes: Nodes) -> tuple[ShardConfig, Comm | None]:
    """``reshard_after_forward=k`` resolved against the shard group and the nodes, and the
    k ranks' group backward gathers over ([Note: the secondary shard] in secondary.py)."""
    value = config.reshard_after_forward
    if config.stage != 3 or isinstance(value, bool):
        return config, None
    k = resolve_reshard(value, comm.size, nodes, dist.get_world_size())
    config = dataclasses.replace(config, reshard_after_forward=k)
    if isinstance(k, bool):
        return config, None
    return config, secondary_comm(comm, k)


def finish(model: nn.Module, engine: Engine) -> None:
    """After the engine (and the optimizer) are built and the model's class swapped:
    set-up traffic closed, the names collective checks may report, ``generate``
    registered at stage 3 (gather.py)."""
    destroy_group_at_exit()
    engine.comm.ledger.mark_step()  # the initial broadcast is not part of any step
    engine.comm.ledger.step = 0
    names = [b.name for b in engine.all_buckets] + [u.name for u in engine.units]
    for c in engine.comms():
        c.know_names([*names, "full_state_dict", "state_dict", "optimizer.state_dict",
                      "forward", "buffers", "used", "grad_norm", "overflow", "join",
                      "unshard", "budget", "stream_weights"])
    if engine.units:
        give_units_their_calls(engine)  # FSDP2's unshard()/reshard() on each unit
    if engine.units and callable(getattr(model, "generate", None)):
        register_forward_method(model, "generate", engine.config.generate_budget)


def whole_mesh(model: nn.Module, mesh: Any) -> Any:
    """FSDP2's habit on a tensor-parallel model: ``fully_shard(model, mesh=mesh["dp"])``.
    zeroshard reduces over dp and keeps the tp pieces in step itself, so it needs the
    whole mesh: the dp submesh's root, when that root has a tp dimension and the tp
    parameters live on its tp submesh."""
    if mesh is None or is_tp_mesh(mesh) or not hasattr(mesh, "_get_root_mesh"):
        return mesh
    from torch.distributed.tensor import DTensor

    tp_param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if tp_param is None:
        return mesh
    root = mesh._get_root_mesh()
    names = tuple(n for n in (getattr(root, "mesh_dim_names", None) or ()) if n != "tp")
    if (root is mesh or not is_tp_mesh(root) or names != tuple(mesh.mesh_dim_names or ())
            or tp_param.device_mesh._get_root_mesh() != root):
        return mesh  # not the dp part of the tp model's mesh: _check_dtensor_params says so
    return root


def check_dtensor_params(model: nn.Module, mesh: Any) -> None:
    """A model parallelised with parallelize_module needs the whole mesh, tp dimension
    included (FSDP2 takes mesh["dp"]; zeroshard takes the mesh itself)."""
    if is_tp_mesh(mesh):
        return
    from torch.distributed.tensor import DTensor

    found = next(((n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if found is None:
        return
    name, dims = found[0], found[1].device_mesh
    raise ValueError(
        f"parameter {name!r} is a DTensor (the model was parallelised, e.g. with "
        "parallelize_module); pass the whole mesh it came from, with a 'tp' dimension: "
        "shard(model, ..., mesh=mesh) where mesh = init_device_mesh(device, (dp, tp), "
        "mesh_dim_names=('dp', 'tp')) and the plan was applied on mesh['tp']"
        + (f" (got mesh={mesh})" if mesh is not None else " (no mesh= was given)")
        + f"; its tp mesh is {dims}"
        + ". See docs/tensor-parallel.md")


def destroy_group_at_exit() -> None:
    """Tear the default process group down at interpreter exit if the script did not.

    Exiting with a live gloo group can abort the process ("terminate called without an
    active exception") after all the work is done; torchrun then reports the rank failed.
    """
    global _EXIT_HOOK
    if _EXIT_HOOK:
        return
    _EXIT_HOOK = True

    def _cleanup() -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    atexit.register(_cleanup)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_param_init(model: nn.Module) -> ParamInit:
    from .models import GPT2, Llama, init_weights

    if isinstance(model, (GPT2, Llama)):
        return lambda m, names: init_weights(m, 0, names)
    raise ValueError(
        f"{type(model).__name__} is on the meta device; pass param_init=fn(model, names) "
        "that initialises the named parameters in place (the same on every rank), or build "
        "the model on a real device"
    )
