"""torch's own checkpoint API resumes exactly: a torchtitan-style loop saves with
``get_state_dict`` + ``dcp.save`` and resumes into a fresh model and optimizer with
``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``. The fresh optimizer's
``get_state_dict`` must hold every state entry (torch builds them with
``_init_optim_state``: zero ``.grad``, one step at lr=0) or ``dcp.load`` has nothing to
fill and the run continues on fresh Adam moments, silently. The same files move between
FSDP2 and zeroshard (the keys are the FQNs and torch's state names)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _training import loader, loss_of, make_model
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep

STEPS, SAVE_AT, LR = 4, 2, 1e-2


def _zeroshard(stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage, lr=LR,
                           weight_decay=0.1)


def _fsdp2() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    from zeroshard.checkpointing import find_blocks

    model = make_model("gpt2-tiny")
    for block in find_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _build(kind: str, stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return _fsdp2() if kind == "fsdp2" else _zeroshard(stage)


def _train(model, optim, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _save(model, optim, path: str, use_async: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    if use_async:  # torchtitan's async checkpointing: training goes on while it writes,
        # on a process group of its own, as DCP advises (docs/checkpoints.md)
        group = torch.distributed.new_group(backend="gloo")
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path,
                                process_group=group)
        future.result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _resume(model, optim, path: str) -> int:
    """Load into a fresh model and optimizer, as torchtitan does; return how many state
    entries the fresh optimizer's get_state_dict offered to dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    offered = len(osd["state"])
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return offered


def _state(kind: str, model, optim) -> dict[str, torch.Tensor]:
    """Weights and optimizer state as whole fp32 tensors keyed by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
    )

    if kind == "zeroshard":
        out = {f"model.{k}": v for k, v in zeroshard.full_state_dict(model).items()}
        named = dict(zip(range(10**6), [n for n, _ in model.named_parameters()]))
        for pid, entry in optim.state_dict()["state"].items():
            for k, v in entry.items():
                out[f"optim.{named[pid]}.{k}"] = v.float()
        return out
    msd, osd = get_state_dict(model, optim,
                              options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.float() for k, v in msd.items()}
    for fqn, entry in osd["state"].items():
        out.update({f"optim.{fqn}.{k}": v.float() for k, v in entry.items()})
    return out


def _loop(rank: int, world: int, stage: int, root: str, first: str, second: str,
          use_async: bool = False) -> dict:
    """``first`` trains STEPS steps, saving at SAVE_AT; a fresh ``second`` resumes from the
    files and trains the rest. Returns both continuations and final states."""
    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(STEPS)]
    path = os.path.join(root, f"{first}-{stage}-{use_async}")
    model, optim = _build(first, stage)
    losses = _train(model, optim, batches[:SAVE_AT])
    _save(model, optim, path, use_async)
    losses += _train(model, optim, batches[SAVE_AT:])
    want = _state(first, model, optim)
    model2, optim2 = _build(second, stage)
    offered = _resume(model2, optim2, path)
    resumed = _train(model2, optim2, batches[SAVE_AT:])
    got = _state(second, model2, optim2)
    return {"losses": losses[SAVE_AT:], "resumed": resumed, "offered": offered,
            "keys": sorted(want) == sorted(got),
            "max_diff": max((want[k] - got[k]).abs().max().item() for k in want),
            "bitwise": all(torch.equal(want[k], got[k]) for k in want)}


def _all(rank: int, world: int, root: str) -> list[dict]:
    where = {"rank": rank, "world": world, "root": root}
    grid = [{"stage": s, "first": "zeroshard", "second": "zeroshard", **where}
            for s in (0, 1, 2, 3)]
    grid += [{"stage": 3, "first": "zeroshard", "second": "zeroshard", "use_async": True,
              **where},
             {"stage": 3, "first": "fsdp2", "second": "zeroshard", **where},
             {"stage": 3, "first": "zeroshard", "second": "fsdp2", **where}]
    return sweep(_loop, grid)


def test_dcp_state_dict_resume_is_exact_and_moves_to_and_from_fsdp2(tmp_path) -> None:
    results = run_ranks(_all, 2, str(tmp_path), timeout=240)
    for rank in results:
        for i, r in enumerate(rank):
            # gpt2-tiny: 28 parameters with state (the tied lm_head counted once)
            assert r["offered"] == 28, (i, r)
            assert r["keys"], (i, r)
            if i < 5:  # zeroshard -> zeroshard, stages 0-3 (and async_save): bitwise
                assert r["resumed"] == r["losses"], (i, r)
                assert r["bitwise"], (i, r)
            else:  # across FSDP2 and zeroshard: within 1e-6
                assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in
                           zip(r["resumed"], r["losses"])), (i, r)
                assert r["max_diff"] <= 1e-5, (i, r)


def _tp(stage: int, dp_only: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from _tp import llama_config, parallelize_llama, tp_mesh

    from zeroshard.models import build_model

    torch.manual_seed(0)
    model = build_model(llama_config(255))
    mesh = tp_mesh("dp2xtp2")
    parallelize_llama(model, mesh["tp"])
    # FSDP2's habit (fully_shard(model, mesh=mesh["dp"])) and zeroshard's (the whole mesh)
    return zeroshard.shard(model, torch.optim.AdamW, stage=stage,
                           mesh=mesh["dp"] if dp_only else mesh, lr=LR, weight_decay=0.1)


def _tp_loop(rank: int, world: int, stage: int, dp_only: bool, root: str) -> dict:
    from _tp import backward, batch, tp_loss

    def train(model, optim, steps):
        out = []
        for step in steps:
            x, y = batch(step, 255)
            loss = tp_loss(model, x, y)
            backward(loss)
            optim.step()
            optim.zero_grad()
            out.append(loss.full_tensor().item() if hasattr(loss, "full_tensor")
                       else loss.item())
        return out

    path = os.path.join(root, f"tp-{stage}-{dp_only}")
    model, optim = _tp(stage, dp_only)
    train(model, optim, range(SAVE_AT))
    sharded = _tp_sharded(model, optim)
    _save(model, optim, path)
    losses = train(model, optim, range(SAVE_AT, STEPS))
    want = _state("zeroshard", model, optim)
    model2, optim2 = _tp(stage, dp_only)
    offered = _resume(model2, optim2, path)
    resumed = train(model2, optim2, range(SAVE_AT, STEPS))
    got = _state("zeroshard", model2, optim2)
    return {"losses": losses, "resumed": resumed, "offered": offered, **sharded,
            "bitwise": sorted(want) == sorted(got)
            and all(torch.equal(want[k], got[k]) for k in want)}


def _tp_sharded(model, optim) -> dict:
    """torch's DCP API under tensor parallelism, default options: FSDP2 + TP's answer.
    Every model and optimizer tensor is a DTensor on the whole mesh whose full_tensor()
    is the whole value (model.state_dict() / optimizer.state_dict()), each rank holding
    its part: summed over the job, the local sizes are the whole size times the mesh
    dimension it is replicated over (a tp-replicated parameter's tp) — nothing gathered,
    no collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    ledger = zeroshard.engine_of(model).comm.ledger
    with ledger.window("sd") as records, CommDebugMode() as comm:
        msd, osd = get_state_dict(model, optim)
    moved = len(records) + comm.get_total_counts()
    whole_m, whole_o = model.state_dict(), optim.state_dict()
    names = [n for n, _ in model.named_parameters()]
    values = dict(msd)
    for i, n in enumerate(names):
        for k, v in osd["state"][n].items():
            if k != "step":
                values[f"optim.{n}.{k}"] = (v, whole_o["state"][i][k])
    equal, replication, local = True, {}, {}
    for k, v in values.items():
        v, whole = v if isinstance(v, tuple) else (v, whole_m.get(k))
        if k in dict(model.named_parameters()) or k.startswith("optim."):
            if not isinstance(v, DTensor):
                equal = False
                continue
            equal &= torch.equal(v.full_tensor(), whole)
            replication[k] = [v.device_mesh.size(d) for d, p in enumerate(v.placements)
                              if p.is_replicate()]
            local[k] = (v.to_local().numel(), v.numel())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    exact = all(sum(r[k][0] for r in everyone) == numel * _prod(replication[k])
                for k, (_, numel) in local.items())
    return {"moved": moved, "tp_equal": bool(equal), "tp_exact": exact, "tp_keys": len(local)}


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _tp_all(rank: int, world: int, root: str, points: list[tuple[int, bool]]) -> list[dict]:
    return sweep(_tp_loop, [{"rank": rank, "world": world, "stage": s, "dp_only": d,
                             "root": root} for s, d in points])


def _check_tp(tmp_path, points: list[tuple[int, bool]]) -> None:
    for rank in run_ranks(_tp_all, 4, str(tmp_path), points, timeout=300):
        for r in rank:
            assert r["offered"] > 0 and r["resumed"] == r["losses"] and r["bitwise"], r
            assert r["moved"] == 0 and r["tp_equal"] and r["tp_exact"] and r["tp_keys"], r


def test_dcp_state_dict_resume_under_tensor_parallelism_dp_submesh(tmp_path) -> None:
    """dp 2 x tp 2 on 4 ranks, sharded with FSDP2's mesh["dp"], stage 3: the sharded
    answer (each rank its dp rows of its tp piece, no collective), resumed bitwise."""
    _check_tp(tmp_path, [(3, True)])


@pytest.mark.slow
def test_dcp_state_dict_resume_under_tensor_parallelism(tmp_path) -> None:
    """The same with the whole mesh, at stages 1 and 3."""
    _check_tp(tmp_path, [(1, False), (3, False)])


def _into_fsdp2(rank: int, world: int, root: str) -> list[float]:
    """zeroshard's own checkpoint (save_checkpoint) read by FSDP2 with plain DCP, as
    docs/checkpoints.md shows: its tensors are the DTensor pieces FSDP2 holds, under
    ``model.<name>`` and ``optim.<name>.<state>``, the scalars in the manifest. gpt2-tiny
    (tied: the head stored once) at stage 1, llama-tiny (untied) at stage 3."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from zeroshard.checkpointing import find_blocks
    from zeroshard.state import full_optimizer_state, save_checkpoint

    worst = []
    for stage, preset in ((1, "gpt2-tiny"), (3, "llama-tiny")):
        model, optim = zeroshard.shard(make_model(preset), torch.optim.AdamW, stage=stage,
                                       lr=LR, weight_decay=0.1)
        data = loader(preset, rank, world)
        _train(model, optim, [next(data) for _ in range(2)])
        ckpt = Path(root) / f"own-s{stage}"
        save_checkpoint(ckpt, model, optim)
        weights = zeroshard.full_state_dict(model)
        moments = full_optimizer_state(model, optim)
        fsdp_model = make_model(preset, seed=3)
        for block in find_blocks(fsdp_model):
            fully_shard(block)
        fully_shard(fsdp_model)
        fsdp_optim = torch.optim.AdamW(fsdp_model.parameters(), lr=LR, weight_decay=0.1)
        _train(fsdp_model, fsdp_optim, [next(data)])  # state to overwrite
        # -- docs/checkpoints.md's snippet ---------------------------------------------
        manifest = json.loads((ckpt / "zeroshard.json").read_text())
        stored = {p["name"] for p in manifest["params"]}
        msd, osd = get_state_dict(fsdp_model, fsdp_optim)
        target = {f"model.{k}": v for k, v in msd.items() if k in stored}
        saved = manifest["optimizer"]["params"]
        target |= {f"optim.{k}.{s}": osd["state"][k][s] for k in stored if k in saved
                   for s in saved[k]["per_element"]}
        dcp.load(target, checkpoint_id=ckpt)
        for k in stored & saved.keys():
            osd["state"][k]["step"].fill_(saved[k]["scalars"]["step"]["value"])
        set_state_dict(fsdp_model, fsdp_optim, model_state_dict=msd, optim_state_dict=osd)
        # ------------------------------------------------------------------------------
        msd, osd = get_state_dict(fsdp_model, fsdp_optim)  # what FSDP2 holds now
        assert stored == set(weights) - {"lm_head.weight"} if preset == "gpt2-tiny" else \
            stored == set(weights), (preset, stored)
        worst.append(max([(msd[k].full_tensor() - weights[k]).abs().max().item()
                          for k in stored]
                         + [(osd["state"][k][s].full_tensor() - moments[k][s]).abs().max()
                            .item() for k in stored for s in ("exp_avg", "exp_avg_sq")]
                         + [abs(float(osd["state"][k]["step"]) - float(moments[k]["step"]))
                            for k in stored]))
    return worst


def test_own_checkpoints_load_into_fsdp2_with_plain_dcp(tmp_path) -> None:
    for rank in run_ranks(_into_fsdp2, 2, str(tmp_path), timeout=240):
        assert rank == [0.0, 0.0], rank
