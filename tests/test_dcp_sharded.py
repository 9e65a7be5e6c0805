"""torch's DCP state-dict API answered as FSDP2 answers it (issue #64, item 1; [Note:
sharded state dicts for torch's DCP API] in engine/sharded_state.py).

World 2, gpt2-tiny (tied embedding and head), AdamW, one step taken, stages 0-3 and bf16:

* ``get_model_state_dict`` / ``get_optimizer_state_dict`` with default options give, at
  stages 1-3, DTensor ``Shard(0)`` values whose local tensor is this rank's rows (``torch.chunk``:
  sizes asserted exactly, summing to the whole over the ranks) and whose ``full_tensor()`` is
  the whole value ``model.state_dict()`` / ``optimizer.state_dict()`` give; stage 0 DDP's
  whole tensors. No collective runs (zeroshard's ledger and torch's CommDebugMode: 0).
* ``full_state_dict=True, cpu_offload=True``: whole CPU tensors on rank 0, nothing on rank 1.
* ``model.state_dict()`` (a DDP script's ``torch.save`` on rank 0) stays whole.
* ``dcp.save`` of the sharded state, then into a fresh model and optimizer: torch's recipe
  (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``), and ``dcp.load`` alone (it
  writes the masters in place: the compute weights are re-derived before the next forward,
  or before the whole weights are read) continue exactly as the uninterrupted run, at
  stages 0-3; ``broadcast_from_rank0`` loads rank 0's full state; a checkpoint written at
  stage 3 loads at stage 1 and on one rank (world 4 <-> 2: ``make slow``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.state import full_optimizer_state
from zeroshard.testing import run_ranks, sweep

LR = 1e-2


def _build(stage: int, mp: str | None = None):
    return zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage, lr=LR,
                           weight_decay=0.1, mixed_precision=mp)


def _train(model, optim, batches) -> list[float]:
    out = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        out.append(loss.item())
    return out


def _whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _shapes(rank: int, world: int, stage: int, mp: str | None) -> dict:
    """Local shard sizes, no collective, the values; the full and rank-0 forms."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    model, optim = _build(stage, mp)
    batches = [next(loader("gpt2-tiny", rank, world))]
    _train(model, optim, batches)
    ledger = zeroshard.engine_of(model).comm.ledger
    with ledger.window("sd") as records, CommDebugMode() as comm:
        msd = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, optim)
    moved = len(records) + comm.get_total_counts()
    whole_m = model.state_dict()  # a DDP script's answer (collective where it gathers)
    whole_o = optim.state_dict()
    out = {"moved": moved, "locals": {}, "dtensor": {}, "equal": True}
    for k, v in msd.items():
        out["dtensor"][k] = isinstance(v, DTensor)
        out["locals"][k] = tuple(v.to_local().shape) if isinstance(v, DTensor) else tuple(v.shape)
        out["equal"] &= torch.equal(_whole(v).float(), whole_m[k].float())
        out["equal"] &= not isinstance(whole_m[k], DTensor)
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        for key, v in osd["state"][n].items():
            if key == "step":
                out["equal"] &= float(v) == float(whole_o["state"][i]["step"])
                continue
            out["locals"][f"optim.{n}.{key}"] = tuple(_local(v).shape)
            out["dtensor"][f"optim.{n}.{key}"] = isinstance(v, DTensor)
            out["equal"] &= torch.equal(_whole(v), whole_o["state"][i][key])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    out["full_keys"] = sorted(full)
    out["full_equal"] = all(torch.equal(full[k].float(), whole_m[k].float()) and
                            full[k].device.type == "cpu" and not isinstance(full[k], DTensor)
                            for k in full)
    return out


def _local(v):
    return v.to_local() if hasattr(v, "to_local") else v


def _resume(rank: int, world: int, stage: int, mp: str | None, root: str, how: str,
            load_stage: int | None = None) -> dict:
    """Train 2 steps, save the sharded state with dcp.save, train 2 more; a fresh model
    and optimizer (at ``load_stage``) load it ``how`` and train the same 2 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(4)]
    model, optim = _build(stage, mp)
    _train(model, optim, batches[:2])
    path = os.path.join(root, f"{stage}-{mp}-{how}-{load_stage}")
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = zeroshard.full_state_dict(model)
    want = _train(model, optim, batches[2:])
    model2, optim2 = _build(stage if load_stage is None else load_stage, mp)
    if how == "broadcast":  # rank 0's full weights, broadcast (FSDP2's way to load a
        full = zeroshard.full_state_dict(model)  # consolidated checkpoint)
        set_model_state_dict(model2, full if rank == 0 else {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return {"weights": zeroshard.full_state_dict(model2),
                "want": zeroshard.full_state_dict(model)}
    msd2, osd2 = get_state_dict(model2, optim2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    exported = True
    if how == "recipe":
        set_state_dict(model2, optim2, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:  # the weights as dcp.load left them; the optimizer's step and groups are set
        set_optimizer_state_dict(model2, optim2, state["optim"])
    if how == "load-get":  # the views handed out again before the next forward
        get_state_dict(model2, optim2)
    if how == "load-export":  # the whole weights read before any forward: the saved ones
        whole = zeroshard.full_state_dict(model2)
        plain = model2.state_dict()
        exported = all(torch.equal(whole[k], v) and torch.equal(plain[k].float(), v)
                       for k, v in saved.items())
    return {"want": want, "got": _train(model2, optim2, batches[2:]), "exported": exported}


# torch's recipe and dcp.load alone at stages 0-3 (fp32, bf16); dcp.load then the views
# handed out again; dcp.load then the whole weights read before a forward; stage 3 -> 1;
# broadcast_from_rank0 (last)
RESUMES = [{"stage": s, "mp": mp, "how": how}
           for s, mp in ((0, None), (1, None), (2, None), (3, None), (0, "bf16"), (2, "bf16"),
                         (3, "bf16"))
           for how in ("recipe", "load-only")]
RESUMES += [{"stage": s, "mp": mp, "how": how}
            for s, mp, how in ((1, None, "load-get"), (2, "bf16", "load-get"),
                               (3, "bf16", "load-get"), (0, None, "load-export"),
                               (1, None, "load-export"), (2, None, "load-export"))]
RESUMES += [{"stage": 3, "mp": None, "how": "recipe", "load_stage": 1},
            {"stage": 2, "mp": None, "how": "broadcast"}]
RESUME_CASES = [f"s{c['stage']}-{c['mp']}-{c['how']}" + (f"-to-s{c['load_stage']}"
                                                          if "load_stage" in c else "")
                for c in RESUMES[:-1]]


def _grid(rank: int, world: int, root: str) -> dict:
    where = {"rank": rank, "world": world}
    shapes = sweep(_shapes, [{"stage": s, "mp": mp, **where}
                             for s, mp in ((0, None), (1, None), (2, None), (3, None),
                                           (2, "bf16"), (3, "bf16"))])
    resumes = sweep(_resume, [{**c, "root": root, **where} for c in RESUMES])
    dist.barrier()
    return {"shapes": shapes, "resumes": resumes}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("dcp"))
    return run_ranks(_grid, 2, root, timeout=300)


SHAPE_CASES = [(0, None), (1, None), (2, None), (3, None), (2, "bf16"), (3, "bf16")]


@pytest.mark.parametrize("case", range(len(SHAPE_CASES)), ids=[f"s{s}-{mp}" for s, mp in SHAPE_CASES])
def test_default_options_give_local_shards_and_move_nothing(results, case: int) -> None:
    stage, _ = SHAPE_CASES[case]
    model = make_model("gpt2-tiny")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for rank, r in enumerate(results):
        got = r["shapes"][case]
        assert got["moved"] == 0
        assert got["equal"]
        for k, shape in shapes.items():
            for key in (k, *(f"optim.{k}.{m}" for m in ("exp_avg", "exp_avg_sq"))):
                if key not in got["locals"]:
                    assert key != k
                    continue
                if stage == 0:
                    assert not got["dtensor"][key] and got["locals"][key] == shape
                    continue
                assert got["dtensor"][key], key
                rows = -(-shape[0] // 2)  # torch.chunk: ceil(rows / N) for the first ranks
                mine = max(0, min(rows, shape[0] - rank * rows))
                assert got["locals"][key] == (mine, *shape[1:]), (key, rank)
    # full_state_dict + cpu_offload: whole CPU tensors on rank 0 only
    assert results[0]["shapes"][case]["full_keys"] == sorted(shapes)
    assert results[0]["shapes"][case]["full_equal"]
    assert results[1]["shapes"][case]["full_keys"] == []



@pytest.mark.parametrize("case", range(len(RESUME_CASES)), ids=RESUME_CASES)
def test_dcp_save_of_the_sharded_state_resumes_bitwise(results, case: int) -> None:
    """torch's recipe, and dcp.load into the views alone (the compute weights re-derived
    before the next forward; stage 0's views are DDP's whole parameters), continue as the
    uninterrupted run, bit for bit — also with the views handed out again after the load
    (a new-user trial: that cancelled the re-derivation), and the whole weights read before
    any forward (full_state_dict, model.state_dict()) are the saved ones."""
    for r in results:
        got = r["resumes"][case]
        assert got["got"] == got["want"], RESUME_CASES[case]
        assert got["exported"], RESUME_CASES[case]


def test_broadcast_from_rank0_loads_rank0s_full_state(results) -> None:
    for r in results:
        got = r["resumes"][-1]
        assert all(torch.equal(got["weights"][k], got["want"][k]) for k in got["want"])


def _one_rank(rank: int, world: int, path: str) -> bool:
    """A world-2 stage-3 checkpoint, loaded at world 1, stage 2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _build(2)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return zeroshard.full_state_dict(model)


def _saved(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _build(3)
    _train(model, optim, [next(loader("gpt2-tiny", rank, world))])
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return zeroshard.full_state_dict(model)


def test_a_world_2_checkpoint_loads_on_one_rank(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "ck")
    want = run_ranks(_saved, 2, path, timeout=120)[0]
    got = run_ranks(_one_rank, 1, path, timeout=120)[0]
    assert all(torch.equal(got[k], want[k]) for k in want)


def _at(rank: int, world: int, path: str, stage: int, save: bool) -> dict:
    """Save (after one step) or load the sharded state at this world and stage; the local
    shard sizes, and the whole state after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _build(stage)
    if save:
        _train(model, optim, [next(loader("gpt2-tiny", rank, world))])
    msd, osd = get_state_dict(model, optim)
    rows = _local(msd["tok_emb.weight"]).shape[0]
    state = {"model": msd, "optim": osd}
    if save:
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return {"rows": rows, "weights": zeroshard.full_state_dict(model),
            "optim": full_optimizer_state(model, optim)}


@pytest.mark.slow
@pytest.mark.parametrize(("first", "second"), [((4, 3), (2, 2)), ((2, 1), (4, 3))])
def test_world_4_and_world_2_checkpoints_load_at_the_other(tmp_path, first, second) -> None:  # noqa: ANN001
    """N -> M through DCP with the sharded state: world 4 stage 3 -> world 2 stage 2, and
    world 2 stage 1 -> world 4 stage 3; each rank holds 1/N of the rows, and the loaded
    state is the saved one, bit for bit."""
    path = str(tmp_path / "ck")
    saved = run_ranks(_at, first[0], path, first[1], True, timeout=300)
    loaded = run_ranks(_at, second[0], path, second[1], False, timeout=300)
    vocab = make_model("gpt2-tiny").tok_emb.weight.shape[0]
    assert [r["rows"] for r in saved] == [vocab // first[0]] * first[0]
    assert [r["rows"] for r in loaded] == [vocab // second[0]] * second[0]
    want = saved[0]
    for got in loaded:
        assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())
        assert all(torch.equal(torch.as_tensor(got["optim"][p][k]), torch.as_tensor(v))
                   for p, e in want["optim"].items() for k, v in e.items())
