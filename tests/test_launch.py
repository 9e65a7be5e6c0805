"""zeroshard.launch.run_ranks_local: ranks forked from a rank server ([Note: forked ranks]),
each in the environment a spawned rank would have had."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.launch import run_ranks_local


def _report(tag: str) -> dict[str, Any]:
    import tempfile

    import zeroshard.launch_preload as preload

    return {"tmp": tempfile.gettempdir(), "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
            "tag": tag, "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "probe": os.environ.get("ZS_LAUNCH_PROBE"), "gone": os.environ.get("ZS_LAUNCH_GONE"),
            "threads": torch.get_num_threads(), "master": os.environ["MASTER_PORT"],
            "forked": preload.SERVER_PID != os.getpid(), "pid": os.getpid()}


def test_ranks_fork_from_the_server_in_the_launching_processs_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZS_LAUNCH_PROBE", "first")
    monkeypatch.setenv("ZS_LAUNCH_GONE", "set")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Set by the caller now and by the agent for each rank: the agent's value, always.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    first = run_ranks_local(_report, 2, "a")
    # Changed and removed between two launches from one process: the server started with
    # the first environment; the second launch's ranks see the second.
    monkeypatch.setenv("ZS_LAUNCH_PROBE", "second")
    monkeypatch.delenv("ZS_LAUNCH_GONE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    second = run_ranks_local(_report, 2, "b")
    assert first["forked"] and second["forked"]  # no interpreter started per rank
    assert (first["tag"], first["rank"], first["world"]) == ("a", "0", "2")
    assert (first["probe"], first["gone"]) == ("first", "set")
    assert (second["probe"], second["gone"]) == ("second", None)
    assert first["threads"] == second["threads"] == 1
    assert first["master"] != second["master"]  # the agent's own variables win
    assert first["pid"] != second["pid"] != os.getpid()
    assert first["local_world"] == second["local_world"] == "2"
    assert second["tmp"] == str(tmp)  # tempfile reads TMPDIR again (the server cached its own)


def _exits(code: int) -> None:
    sys.exit(code)


def test_a_rank_that_exits_with_status_0_returns_none() -> None:
    """sys.exit(0) in fn: torch's elastic agent records None for the rank, as with spawned
    ranks (the CPU report must not choke on it)."""
    assert run_ranks_local(_exits, 2, 0) is None
