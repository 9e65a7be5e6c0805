"""Random-number-generator states, one row per rank, as tensors a checkpoint can hold.

Each rank has its own generators (dropout masks usually differ per rank), so the states
form a ``[world, L]`` table: rank r writes row r (its ``Shard(0)`` piece of a DTensor)
and on loading every rank reads the whole small table and restores row r — or, when the
world size changed, row ``r % saved_world`` (exact continuation of random streams is
impossible across world sizes; data order is not affected, see zeroshard.data).

Stored: torch's CPU generator (``rng.torch``, uint8), the current CUDA device's generator
when CUDA is in use (``rng.cuda``), and Python's ``random`` (``rng.python``: version and
the 625 Mersenne-Twister words as int64; ``rng.python_gauss``: [has cached gaussian,
its value] as float64).
"""

from __future__ import annotations

import random

import torch

__all__ = ["capture", "restore", "row_lengths"]


def _python_state() -> tuple[torch.Tensor, torch.Tensor]:
    version, words, gauss = random.getstate()
    state = torch.tensor([version, *words], dtype=torch.int64)
    g = torch.tensor([0.0 if gauss is None else 1.0, 0.0 if gauss is None else gauss],
                     dtype=torch.float64)
    return state, g


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture() -> dict[str, torch.Tensor]:
    """This rank's generator states, each a 1-D CPU tensor."""
    py, gauss = _python_state()
    out = {"rng.torch": torch.get_rng_state(), "rng.python": py, "rng.python_gauss": gauss}
    if _cuda_in_use():
        out["rng.cuda"] = torch.cuda.get_rng_state()
    return out


def row_lengths(states: dict[str, torch.Tensor]) -> dict[str, list]:
    """``{key: [length, dtype name]}`` for the manifest."""
    return {k: [v.numel(), str(v.dtype).removeprefix("torch.")] for k, v in states.items()}


def restore(tables: dict[str, torch.Tensor], rank: int) -> None:
    """Restore this rank's row (``rank % saved_world``) of each ``[world, L]`` table."""
    if "rng.torch" in tables:
        t = tables["rng.torch"]
        torch.set_rng_state(t[rank % t.shape[0]].clone())
    if "rng.cuda" in tables and _cuda_in_use():
        t = tables["rng.cuda"]
        torch.cuda.set_rng_state(t[rank % t.shape[0]].clone())
    if "rng.python" in tables:
        t, g = tables["rng.python"], tables.get("rng.python_gauss")
        row = t[rank % t.shape[0]].tolist()
        gauss = None
        if g is not None and g[rank % g.shape[0], 0].item() == 1.0:
            gauss = float(g[rank % g.shape[0], 1].item())
        random.setstate((int(row[0]), tuple(int(x) for x in row[1:]), gauss))
