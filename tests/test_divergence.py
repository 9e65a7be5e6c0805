"""Diverging ranks end in a clear error or a correct result, never a hang.

Every test here finishes in bounded time on its own: the engine's ``timeout`` and
``check_collectives`` options do the work, not the harness's watchdog.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _training import loader, loss_of, make_model, rel_diffs
from _watch import ended_by_watch, print_to_file

import zeroshard
from zeroshard.comm import CollectiveMismatch, CollectiveTimeout
from zeroshard.testing import run_ranks, sweep

STEPS = 4  # rank 0 has 4 batches, rank 1 has 3


def _uneven(rank: int, world: int, stage: int, clip: float | None = None) -> dict:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, weight_decay=0.1, timeout=60)
    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(STEPS - rank)]
    with zeroshard.join(model, optim):
        for x, y in batches:
            loss_of(model, x, y).backward()
            if clip is not None:
                optim.clip_grad_norm_(clip)
            optim.step()
            optim.zero_grad()
    return zeroshard.full_state_dict(model)


GRID = [{"stage": s} for s in (0, 1, 2, 3)] + [{"stage": 3, "clip": 0.05}, {"stage": 1, "clip": 0.05}]


def _all_uneven(rank: int, world: int) -> list:
    return sweep(functools.partial(_uneven, rank, world), GRID)


def _reference(clip: float | None) -> dict:
    """Steps 0-2 on both ranks' batches, step 3 on rank 0's batch alone."""
    model = make_model("gpt2-tiny")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = loader("gpt2-tiny", 0, 1)
    for step in range(STEPS):
        x, y = next(data)
        if step == STEPS - 1:
            half = x.shape[0] // 2
            x, y = x[:half], y[:half]
        loss_of(model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_join_trains_on_the_actual_batches() -> None:
    results = run_ranks(_all_uneven, 2, timeout=300)
    for point, r0, r1 in zip(GRID, *results):
        ref = _reference(point.get("clip"))
        for name in ref:
            assert torch.equal(r0[name], r1[name]), (point, name)  # ranks agree
        for name, dev in rel_diffs(r0, ref).items():
            assert dev < 5e-3, (point, name, dev)  # see test_parity for the key-bias noise


def _no_join(rank: int, world: int, stage: int) -> str:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, timeout=30, check_collectives=True)
    data = loader("gpt2-tiny", rank, world)
    try:
        for _ in range(STEPS - rank):
            x, y = next(data)
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
        zeroshard.full_state_dict(model)  # rank 1 gets here while rank 0 still trains
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_uneven_without_join_is_a_clear_error_on_every_rank(stage: int) -> None:
    start = time.monotonic()
    msgs = run_ranks(_no_join, 2, stage, timeout=120)
    assert time.monotonic() - start < 60
    for msg in msgs:
        assert "ranks diverged at step 3" in msg, msg  # 0-based: the 4th step
        assert "rank 0:" in msg and "rank 1:" in msg and "full_state_dict" in msg, msg
        assert "zeroshard.join()" in msg


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model("gpt2-tiny")
        self.blocks = self.inner.blocks
        self.skip_first = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.inner
        x = m.tok_emb(idx) + m.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if i == 0 and self.skip_first:
                continue  # a data-dependent skip, taken on one rank only
            x = block(x)
        return m.lm_head(m.norm_f(x))


def _branch(rank: int, world: int) -> str:
    model, optim = zeroshard.shard(_Branchy(), torch.optim.AdamW, stage=3, lr=1e-2,
                                   timeout=30, check_collectives=True)
    data = loader("gpt2-tiny", rank, world)
    try:
        for step in range(3):
            model.skip_first = rank == 1 and step == 2
            x, y = next(data)
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


def test_different_branch_names_step_and_unit() -> None:
    msgs = run_ranks(_branch, 2, timeout=120)
    for msg in msgs:
        # Forward still matches (prefetch gathered blocks.0 on both ranks); the first
        # differing collective is in backward: rank 0 gathers blocks.0 again, rank 1
        # (which never ran it) is already reducing blocks.1.
        assert "ranks diverged at step 2" in msg, msg
        assert "rank 0: all_gather(inner.blocks.0, backward" in msg, msg
        assert "rank 1: reduce_scatter(inner.blocks.1, backward" in msg, msg


def _hang(rank: int, world: int) -> str:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-2, timeout=3)
    x, y = next(loader("gpt2-tiny", rank, world))
    if rank == 1:
        time.sleep(5)  # busy elsewhere, not in any collective (longer than the timeout)
        return "slept"
    start = time.monotonic()
    try:
        loss_of(model, x, y).backward()
    except CollectiveTimeout as e:
        return f"{time.monotonic() - start:.1f}|{e}"
    return "no error"


def test_collective_timeout_names_rank_unit_and_phase() -> None:
    waited, msg = run_ranks(_hang, 2, timeout=60)[0].split("|", 1)
    assert float(waited) < 6, waited
    # Collective checks are on by default: the wait is in the check before the gather.
    assert "rank 0 waited 3 s in the check point before forward" in msg, msg
    assert "run it on every rank" in msg and "timeout=" in msg, msg


# -- with the default options (issue #16, item 8) ----------------------------------------
def _alone(rank: int, world: int, what: str, stage: int, mixed_precision: str | None) -> dict:
    """Train 3 steps; after the first, rank 0 alone evaluates or takes a state dict
    (``muon``: of torch's Muon over the matrices, whose state stays a collective)."""
    model = make_model("gpt2-tiny")
    if what == "muon":
        optim = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
        model, optim = zeroshard.shard(model, optim, stage=stage,
                                       mixed_precision=mixed_precision)
    else:
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage,
                                       lr=1e-2, mixed_precision=mixed_precision)
    data = loader("gpt2-tiny", rank, world)
    start = time.monotonic()
    alone = None
    try:
        for step in range(3):
            x, y = next(data)
            if step == 1 and rank == 0:
                if what == "eval":
                    with torch.no_grad():
                        alone = model(x).float().mean().item()
                elif what == "state_dict":
                    alone = model.state_dict()
                else:
                    alone = optim.state_dict()
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
    except (CollectiveMismatch, CollectiveTimeout) as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": None, "weights": zeroshard.full_state_dict(model), "alone": alone}


ALONE = [  # (what rank 0 does alone, stage, mixed precision, is it a collective there?)
    ("eval", 3, None, True), ("muon", 2, None, True),
    ("eval", 1, "bf16", False), ("eval", 2, None, False),
    ("state_dict", 2, None, False), ("state_dict", 0, "bf16", False),
    ("optimizer", 0, None, False),
    # read from the peers ([Note: state dicts served]): no collective on gloo
    ("state_dict", 3, "bf16", False), ("state_dict", 1, "bf16", False),
    ("optimizer", 2, None, False), ("optimizer", 3, None, False),
]


def _alone_each(rank: int, world: int, points: list) -> list:
    return [_alone(rank, world, what, stage, mp) for what, stage, mp, _ in points]


def test_one_rank_alone_is_an_error_on_every_rank_or_correct() -> None:
    """Evaluating or taking a state dict on rank 0 alone — the usual DDP habit — works
    wherever it needs no collective (state dicts on gloo: read from the peers), and is an
    error on every rank, naming the fix, where it does (never a hang, an abort or mixed-up
    weights), with the default options. (An error leaves the process group unusable, as a
    failed collective does: one run each.)"""
    fine = [p for p in ALONE if not p[3]]
    runs = [[p] for p in ALONE if p[3]] + [fine]
    for points in runs:
        per_rank = run_ranks(_alone_each, 2, points, timeout=300)
        for i, (what, stage, mp, collective) in enumerate(points):
            r0, r1 = per_rank[0][i], per_rank[1][i]
            where = (what, stage, mp)
            if not collective:
                assert r0["error"] is None and r1["error"] is None, (where, r0, r1)
                for k, v in r0["weights"].items():
                    assert torch.equal(v, r1["weights"][k]), (where, k)
                continue
            for r in (r0, r1):
                msg = r["error"]
                assert msg and msg.startswith("CollectiveMismatch"), (where, msg)
                assert r["seconds"] < 60, (where, r["seconds"])
                fix = "evaluation included, on every rank" if what == "eval" else (
                    "on every rank and save on one")
                assert fix in msg, (where, msg)
                if what == "muon":  # what the other rank does, said rightly
                    assert "A rank is taking a state dict alone" in msg, msg
                    assert "evaluation on one rank" not in msg, msg


# -- a stage-3 state dict on one rank, the others elsewhere (issue #31, item 2) -------------
TIMEOUT = 60.0


def _state_dict_alone(rank: int, world: int, others: str, root: str) -> dict:
    """Rank 0 takes a stage-3 state dict alone; the other ranks exit, wait in a barrier
    of their own, run a training step, or (``export``) rank 0 runs zeroshard.hf's
    save_pretrained alone, still a collective. A rank blocked in the barrier of an export
    is ended by its peer watch: what it printed goes to ``root``, beside the time its wait
    began."""
    from zeroshard.comm import CollectiveError

    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-2, timeout=TIMEOUT)
    x, y = next(loader("gpt2-tiny", rank, world))
    loss_of(model, x, y).backward()
    optim.step()
    start = time.time()
    if rank > 0 and others == "export":
        print_to_file(root, rank)  # its watch's last words
        dist.barrier()
        return {"error": None}  # not reached: the watch ends this process
    if rank > 0 and others == "exit":
        Path(root, f"pid{rank}").write_text(str(os.getpid()))
        return {"error": None, "exited": True}  # a fresh rank's process ends here
    try:
        if rank == 0:
            if others == "exit":  # the others' processes have ended
                for r in range(1, world):
                    _wait_gone(Path(root, f"pid{r}"))
                start = time.time()
            if others == "export":  # zeroshard.hf.save_pretrained on rank 0 only
                from zeroshard.hf import save_pretrained

                save_pretrained(model, "/nonexistent/never-written")
                return {"error": None}
            alone = model.state_dict()  # the others: in a barrier, or training on
        if others == "barrier":
            dist.barrier()
        else:  # the others' next step waits for rank 0's forward
            loss_of(model, x, y).backward()
        everyone = model.state_dict()
        optim.step()
    except (CollectiveMismatch, CollectiveTimeout, CollectiveError) as e:
        result = {"error": f"{type(e).__name__}: {e}", "seconds": time.time() - start}
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return result
    same = rank > 0 or all(torch.equal(alone[k], everyone[k]) for k in everyone)
    return {"error": None, "same": same, "seconds": time.time() - start}


def _wait_gone(pid_file: Path) -> None:
    """Until the process whose pid ``pid_file`` will hold has ended."""
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("others,world", [("exit", 2), ("barrier", 2), ("barrier", 3),
                                          ("forward", 2), ("export", 2)])
def test_state_dict_on_one_rank_alone(others: str, world: int, tmp_path: Path) -> None:
    """Rank 0 takes a stage-3 state dict alone, the DDP habit: with the others in a barrier
    of the user's or training on, it is the state dict every rank takes at the same step
    ([Note: state dicts served]); with the others gone, an error naming them, well within
    the timeout. zeroshard.hf.save_pretrained stays a collective: on one rank alone, an
    error on every rank still running, a rank blocked in a barrier found by asking the
    peers ([Note: asking the peers]) and ended by its watch."""
    from zeroshard.testing.errors import RankError

    # Fresh ranks: "exit" needs a process that ends, and the answers of a kept rank's peer
    # watch are not reliable across calls (see [Note: reused ranks]).
    args = (_state_dict_alone, world, others, str(tmp_path))
    if others == "export":
        with pytest.raises(RankError, match="exit code 1"):
            run_ranks(*args, timeout=TIMEOUT + 60, fresh=True)
        per_rank = [json.loads((tmp_path / "rank0.json").read_text())] + [
            dict(zip(("seconds", "error"), ended_by_watch(tmp_path, r)))
            for r in range(1, world)]
    else:
        per_rank = run_ranks(*args, timeout=TIMEOUT + 60, fresh=True)
    for rank, r in enumerate(per_rank):
        if others == "exit" and rank > 0:
            assert r == {"error": None, "exited": True}
            continue
        msg = r["error"]
        if others in ("barrier", "forward"):
            assert msg is None and r["same"], (rank, r)
            continue
        assert msg is not None, (rank, r)
        assert r["seconds"] < 15, (rank, r["seconds"], msg)
        if others == "export":  # the fix names the call that was made alone
            assert "zeroshard.hf.save_pretrained and zeroshard.full_state_dict gather the " \
                   "weights from every rank: call them on every rank" in msg, (rank, msg)
            continue
        assert msg.startswith("CollectiveError"), msg
        assert "asked rank 1 for its shards, but rank 1 is no longer running" in msg, msg


def _check_group_after_reinit(rank: int, world: int, root: str) -> bool:
    from zeroshard.comm_check import make_check_group

    first = make_check_group(list(range(world)), True)
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(root, "again"), world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    second = make_check_group(list(range(world)), True)
    return second is not first and dist.get_process_group_ranks(second) == list(range(world))


def test_a_new_default_group_gets_new_check_groups(tmp_path) -> None:
    """A script that destroys its group and makes a new one: zeroshard's collective checks
    run on a check group of the new one. They reused the destroyed group's (its size is
    still readable), where a check left pending by a timeout paired with the new run's
    first check: 'ranks diverged at step 0' on a correct program."""
    assert run_ranks(_check_group_after_reinit, 2, str(tmp_path), timeout=60) == [True, True]


def test_a_peer_that_issued_the_check_is_not_stranded(monkeypatch) -> None:
    """Under load (two busy processes beside the suite) a correct ``zeroshard train`` run
    failed with 'ranks diverged': rank 0 still waited in the check of a step's all-gather
    that rank 1 had already issued, completed and left for the loss's all_reduce — a
    collective rank 0 would reach as soon as gloo's thread delivered the descriptor. A
    peer blocked in a collective of its own strands the waiting rank only if it has not
    issued the waiting rank's check; each answer says how many it issued per check group."""
    from types import SimpleNamespace

    from zeroshard import comm_check
    from zeroshard.peer_watch import WATCH

    comm = SimpleNamespace(peers=[0, 1], global_rank=0, label="world")
    check = comm_check.Check(comm, None, None, "the check of all_gather(bucket0, step)",
                              "bucket0", "step", number=7)
    key = comm_check.check_key([0, 1])
    blocked = {"state": "foreign", "call": "torch.distributed.all_reduce()",
               "where": "train.py:305", "ranks": None}
    for issued in (7, 8):  # issued ours (and maybe more): only slow, keep waiting
        monkeypatch.setattr(WATCH, "ask", lambda peers, desc, n=issued: {
            1: {**blocked, "checks": {key: n}}})
        assert check._ask_peers()[1]["checks"][key] == issued
    monkeypatch.setattr(WATCH, "tell", lambda ranks, message: None)
    for answer in ({**blocked, "checks": {key: 6}}, blocked):  # not yet ours: stranded
        monkeypatch.setattr(WATCH, "ask", lambda peers, desc, a=answer: {1: a})
        with pytest.raises(CollectiveMismatch, match="rank 1 is blocked in "
                           r"torch.distributed.all_reduce\(\) called at train.py:305"):
            check._ask_peers()


def _full_tensor_alone(rank: int, world: int, root: str, linger: float,
                       hybrid: bool = False) -> str:
    """Rank 0 gathers a stage-3 parameter alone (``p.full_tensor()``: torch's collective,
    not zeroshard's); rank 1 goes on to its next training step. Each rank writes what it
    got, and when, to ``root``; with ``linger`` rank 1's process lives on afterwards."""
    from zeroshard.comm import CollectiveError

    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-2, timeout=TIMEOUT,
                                   hybrid=(1, world) if hybrid else None)
    x, y = next(loader("gpt2-tiny", rank, world))
    loss_of(model, x, y).backward()
    optim.step()
    optim.zero_grad()
    start = time.monotonic()
    try:
        if rank == 0:
            next(model.parameters()).full_tensor()
        else:
            loss_of(model, x, y).backward()
        got = "no error"
    except (CollectiveMismatch, CollectiveTimeout, CollectiveError) as e:
        got = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - start:.2f}\n{got}")
    if rank == 1 and linger:
        time.sleep(linger)  # a peer that caught the error and stays (a notebook, a retry)
    return got


@pytest.mark.parametrize(("linger", "hybrid"), [
    (0.0, False), (60.0, False),
    # a (replicate, shard) mesh: full_tensor() gathers over its shard dimension only, a
    # functional collective over one dimension of a 2-D mesh (#64 item 5: was unseen, the
    # peer waited the process group's timeout)
    pytest.param(0.0, True, marks=pytest.mark.slow)])
def test_full_tensor_on_one_rank_ends_every_rank_in_seconds(tmp_path, linger: float,
                                                            hybrid: bool) -> None:
    """p.full_tensor() of a stage-3 parameter on rank 0 alone (a known FSDP2 hang), rank 1
    on to its next step: rank 1 raises naming both places and the fix within seconds; rank
    0, blocked inside torch's collective, is ended by its own watch, which prints the same
    error and that a peer reported a divergence — whether rank 1's process ends (linger 0)
    or lives on (linger 60) — never the process group's 300 s timeout."""
    from zeroshard.testing.errors import RankError

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_full_tensor_alone, 2, str(tmp_path), linger, hybrid, timeout=120,
                  fresh=True)
    ended = str(info.value)
    took = time.monotonic() - t0
    seconds, got = (tmp_path / "rank1").read_text().split("\n", 1)
    assert float(seconds) < 15, (seconds, got)
    assert got.startswith("CollectiveMismatch") and "rank 0 is blocked in " \
        "DTensor.full_tensor()" in got and "every one of them must run it" in got, got
    assert "test_divergence.py" in got, got  # where rank 0 called it
    assert not (tmp_path / "rank0").exists()  # rank 0 never left full_tensor()
    assert ended.startswith("rank 0 of 2 failed: exited with exit code 1"), ended
    assert "rank 0: CollectiveMismatch: ranks diverged" in ended, ended
    assert "a peer reported a divergence" in ended, ended
    assert "DTensor.full_tensor()" in ended and "exit code 1" in ended, ended
    assert took < 30 + 10, took  # both ranks ended: 30 s, plus the fresh ranks' start-up
