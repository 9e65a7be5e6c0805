"""A deterministic, rank-sharded, resumable token source.

[Note: why sharded training can match single-process training row for row]
Sample ``i`` of a source is a pure function of ``(seed, i)``: it is drawn from its own
``torch.Generator`` seeded from a hash of the pair, never from the global RNG. Step ``k``'s
*global* batch is samples ``[k*G, (k+1)*G)`` and rank ``r`` of ``N`` takes the contiguous
rows ``[r*G/N, (r+1)*G/N)`` of it, producing only those rows. So one process with a batch of
8, two ranks with 4 each and four ranks with 2 each see the same 8 samples in the same order,
and a loader's whole position is one integer (the next step), independent of the world size:
a checkpoint taken at world size 2 resumes at world size 4 without skipping or repeating.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["TokenSource", "SyntheticLanguage", "ByteFile", "TokenLoader", "make_source"]

_MASK64 = (1 << 64) - 1


def _seed_for(seed: int, index: int, stream: int) -> int:
    """splitmix64's finaliser over ``(seed, stream, index)``: well-mixed 64-bit seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + index) & _MASK64
    for mul in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        x = ((x ^ (x >> 31)) * mul) & _MASK64
    return x ^ (x >> 31)


def _generator(seed: int, index: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_for(seed, index, stream))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class TokenSource(Protocol):
    """What :class:`TokenLoader` needs: ``batch(start, count)`` returns samples
    ``start .. start+count-1`` as a LongTensor ``[count, seq_len + 1]``."""

    name: str
    vocab: int
    seq_len: int
    seed: int

    def batch(self, start: int, count: int) -> torch.Tensor: ...


class SyntheticLanguage:
    """A fixed sparse first-order Markov chain over ``vocab`` tokens.

    Every token has ``branching`` distinct successors (one drawn from each of ``branching``
    equal slices of the vocabulary, so they cannot collide) carrying the weights
    ``2^-j`` (normalised), shuffled per token. The first token of a sample is uniform;
    every later token depends only on the one before it, with the same weight vector for
    every state, so the conditional entropy of each target is exactly
    :meth:`entropy_bound` (``branching=4``: 1.14 nats, against ``log(vocab)`` for a model
    that has learnt nothing). A small transformer only has to learn a ``vocab x vocab``
    bigram table, which is why its loss visibly falls within ~100 CPU steps. (The top
    ``vocab % branching`` ids are in no slice, so they only ever start a sample.)
    """

    name = "synthetic"

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, *, branching: int = 4) -> None:
        _check_positive(vocab=vocab, seq_len=seq_len, branching=branching)
        if vocab < branching:
            raise ValueError(
                f"vocab={vocab} is smaller than branching={branching}; "
                f"use vocab >= {branching} or a smaller branching"
            )
        self.vocab, self.seq_len, self.seed, self.branching = vocab, seq_len, seed, branching
        g = _generator(seed, 0, stream=1)  # stream 1: the chain; stream 0: samples
        width = vocab // branching
        pick = torch.randint(0, width, (vocab, branching), generator=g)
        slices = torch.arange(branching) * width + pick
        order = torch.rand(vocab, branching, generator=g).argsort(dim=1)
        # successors[v, j] is v's successor of weight rank j (weights fall with j).
        self.successors = slices.gather(1, order)
        self._succ = self.successors.tolist()
        weights = 2.0 ** -torch.arange(branching, dtype=torch.float64)
        self.probs = weights / weights.sum()
        self._cdf = self.probs.cumsum(0).float()
        self._cdf[-1] = 2.0  # u in [0, 1) always lands in a bucket despite rounding

    def entropy_bound(self) -> float:
        """Per-target cross-entropy (nats) of the true chain: the loss floor."""
        return float(-(self.probs * self.probs.log()).sum())

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1``, LongTensor ``[count, seq_len + 1]``."""
        n = self.seq_len + 1
        u = torch.empty(count, n)
        for row in range(count):  # one generator per sample keeps it a function of (seed, i)
            torch.rand(n, generator=_generator(self.seed, start + row, 0), out=u[row])
        first = (u[:, 0] * self.vocab).long().clamp_(max=self.vocab - 1).tolist()
        ranks = torch.searchsorted(self._cdf, u[:, 1:].contiguous(), right=True).tolist()
        # The walk is sequential in t. Plain list lookups cost ~0.3 us a token, while one
        # batched torch index op per position costs ~10 us, so lists win (8x257: <1 ms).
        rows = []
        for token, row_ranks in zip(first, ranks):
            row = [token]
            for j in row_ranks:
                token = self._succ[token][j]
                row.append(token)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long).reshape(count, n)

    def sample(self, i: int) -> torch.Tensor:
        """Sample ``i`` as a LongTensor ``[seq_len + 1]``."""
        return self.batch(i, 1)[0]


class ByteFile:
    """Byte-level (vocab 256) windows of a local file, read into memory once.

    Sample ``i`` is the ``seq_len + 1`` bytes starting at an offset drawn uniformly from all
    valid offsets by a generator seeded from ``(seed, i)``; windows may overlap and repeat.
    """

    name = "bytes"
    vocab = 256

    def __init__(self, path: str | Path, seq_len: int, seed: int = 0) -> None:
        _check_positive(seq_len=seq_len)
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        if not self.path.is_file():
            raise FileNotFoundError(f"ByteFile: no such file: {str(self.path)!r}")
        self.data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8)
        if self.data.numel() < seq_len + 1:
            raise ValueError(
                f"ByteFile: {str(self.path)!r} has {self.data.numel()} bytes but seq_len="
                f"{seq_len} needs at least {seq_len + 1}; use a longer file or a smaller seq_len"
            )
        self._offsets = self.data.numel() - seq_len  # number of valid window starts

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1``, LongTensor ``[count, seq_len + 1]``."""
        gens = (_generator(self.seed, start + row, 0) for row in range(count))
        offsets = torch.tensor(
            [int(torch.randint(0, self._offsets, (1,), generator=g)) for g in gens],
            dtype=torch.long,
        )
        index = offsets[:, None] + torch.arange(self.seq_len + 1)
        return self.data[index].long()

    def sample(self, i: int) -> torch.Tensor:
        """Sample ``i`` as a LongTensor ``[seq_len + 1]``."""
        return self.batch(i, 1)[0]


class TokenLoader:
    """Iterator over this rank's ``(inputs, targets)``, each LongTensor ``[mb, seq_len]``.

    Step ``k``'s global batch is samples ``[k*global_batch, (k+1)*global_batch)``; rank
    ``r`` gets rows ``[r*mb, (r+1)*mb)`` with ``mb = global_batch // world_size``, and
    ``targets`` is ``inputs`` shifted left by one token. The loader never ends.
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
    ) -> None:
        _check_positive(global_batch=global_batch, world_size=world_size)
        if global_batch % world_size:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by world_size={world_size}; "
                f"use a global_batch that is a multiple of {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.source, self.global_batch = source, global_batch
        self.rank, self.world_size = rank, world_size
        self.micro_batch = global_batch // world_size
        self.step = start_step  # the next step to produce

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.step * self.global_batch + self.rank * self.micro_batch
        tokens = self.source.batch(start, self.micro_batch)
        self.step += 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def micro_batches(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's rows for this rank, split into ``k`` accumulation micro-batches.

        Chunks are contiguous and in row order: chunk ``j`` is rows ``[j*mb/k, (j+1)*mb/k)``
        of what ``next(loader)`` would have returned, so concatenating the chunks gives
        that batch back. Advances the loader by one step.
        """
        _check_positive(k=k)
        if self.micro_batch % k:
            raise ValueError(
                f"micro-batch {self.micro_batch} (global_batch={self.global_batch} / "
                f"world_size={self.world_size}) is not divisible by k={k}; pick k dividing it"
            )
        inputs, targets = next(self)
        return list(zip(inputs.chunk(k), targets.chunk(k)))

    def state_dict(self) -> dict[str, int | str]:
        """Plain ints/strs; the position (``step``, ``position``) is global, not per rank."""
        return {
            "source": self.source.name,
            "seed": self.source.seed,
            "seq_len": self.source.seq_len,
            "global_batch": self.global_batch,
            "step": self.step,
            "position": self.step * self.global_batch,  # index of the next global sample
        }

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue from ``state``; this loader's rank and world size may differ."""
        mine = self.state_dict()
        for key in ("source", "seed", "seq_len", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has "
                    f"{key}={mine[key]!r}; build the loader with {key}={state[key]!r} to resume"
                )
        self.step = int(state["step"])


_SOURCES = ("synthetic", "bytes")


def make_source(
    name: str, *, vocab: int, seq_len: int, seed: int = 0, path: str | Path | None = None
) -> SyntheticLanguage | ByteFile:
    """Build a source by name: ``"synthetic"`` (needs ``vocab``) or ``"bytes"`` (needs
    ``path``; its tokens are bytes, so ``vocab`` must be at least 256)."""
    if name == "synthetic":
        return SyntheticLanguage(vocab, seq_len, seed)
    if name == "bytes":
        if path is None:
            raise ValueError('make_source("bytes") needs path=<a local text file>')
        if vocab < ByteFile.vocab:
            raise ValueError(f"byte-level data needs vocab >= 256, got vocab={vocab}")
        return ByteFile(path, seq_len, seed)
    raise ValueError(f"unknown data source {name!r}; supported: {', '.join(_SOURCES)}")
