"""The token source: sharding parity across world sizes, determinism, resume, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from zeroshard.data import ByteFile, SyntheticLanguage, TokenLoader, make_source


def _global_batches(source, global_batch: int, world_size: int, steps: int, **kw):
    """Each step's rank batches concatenated in rank order (what world 1 should see)."""
    loaders = [
        TokenLoader(source, global_batch=global_batch, rank=r, world_size=world_size, **kw)
        for r in range(world_size)
    ]
    out = []
    for _ in range(steps):
        pairs = [next(loader) for loader in loaders]
        out.append(tuple(torch.cat(parts) for parts in zip(*pairs)))
    return out


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.fixture(params=["synthetic", "bytes"])
def source(request, text_file: Path):
    return make_source(request.param, vocab=256, seq_len=16, seed=3, path=text_file)


def test_world_sizes_see_the_same_global_batch(source) -> None:
    reference = _global_batches(source, 8, 1, steps=4)
    for inputs, targets in reference:
        assert inputs.shape == targets.shape == (8, 16)
        assert inputs.dtype == targets.dtype == torch.long
    for world_size in (2, 4):
        sharded = _global_batches(source, 8, world_size, steps=4)
        for (ref_in, ref_tgt), (inp, tgt) in zip(reference, sharded):
            assert torch.equal(ref_in, inp) and torch.equal(ref_tgt, tgt)
    # World 3 (global batch 6) must match world 1 at global batch 6 as well.
    assert all(
        torch.equal(a, b)
        for ref, got in zip(_global_batches(source, 6, 1, 3), _global_batches(source, 6, 3, 3))
        for a, b in zip(ref, got)
    )


def test_targets_are_inputs_shifted_and_steps_differ(source) -> None:
    loader = TokenLoader(source, global_batch=4)
    inputs, targets = next(loader)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(torch.cat([inputs, targets[:, -1:]], 1), source.batch(0, 4))
    assert not torch.equal(next(loader)[0], inputs)
    assert 0 <= int(inputs.min()) and int(inputs.max()) < source.vocab


def test_two_instances_are_identical_and_seed_matters() -> None:
    a = TokenLoader(SyntheticLanguage(64, 32, seed=1), global_batch=4)
    b = TokenLoader(SyntheticLanguage(64, 32, seed=1), global_batch=4)
    other = TokenLoader(SyntheticLanguage(64, 32, seed=2), global_batch=4)
    for _ in range(3):
        (xa, ya), (xb, yb), (xo, _) = next(a), next(b), next(other)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xo)


def test_sample_is_a_function_of_index_only() -> None:
    lang = SyntheticLanguage(64, 32, seed=5)
    assert torch.equal(lang.batch(10, 5)[2], lang.sample(12))
    assert torch.equal(lang.batch(0, 20)[10:15], lang.batch(10, 5))


@pytest.mark.parametrize("resume_world", [1, 2, 4])
def test_resume_continues_identically(source, resume_world: int) -> None:
    straight = _global_batches(source, 8, 1, steps=6)
    first = TokenLoader(source, global_batch=8, rank=1, world_size=2)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    assert all(isinstance(v, int | str) for v in state.values())
    assert state["step"] == 3 and state["position"] == 24
    loaders = [
        TokenLoader(source, global_batch=8, rank=r, world_size=resume_world)
        for r in range(resume_world)
    ]
    for loader in loaders:
        loader.load_state_dict(state)
    for step in range(3, 6):
        got = torch.cat([next(loader)[0] for loader in loaders])
        assert torch.equal(got, straight[step][0])


def test_start_step_and_mismatched_state() -> None:
    lang = SyntheticLanguage(64, 8)
    skipped = TokenLoader(lang, global_batch=4, start_step=2)
    fresh = TokenLoader(lang, global_batch=4)
    next(fresh), next(fresh)
    assert torch.equal(next(skipped)[0], next(fresh)[0])
    with pytest.raises(ValueError, match="global_batch=4.*global_batch=8"):
        TokenLoader(lang, global_batch=8).load_state_dict(fresh.state_dict())
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        TokenLoader(SyntheticLanguage(64, 8, seed=1), global_batch=4).load_state_dict(
            fresh.state_dict()
        )


def test_micro_batches_split_rows_in_order() -> None:
    lang = SyntheticLanguage(64, 8)
    whole = next(TokenLoader(lang, global_batch=8, rank=1, world_size=2))
    loader = TokenLoader(lang, global_batch=8, rank=1, world_size=2)
    chunks = loader.micro_batches(2)
    assert len(chunks) == 2 and chunks[0][0].shape == (2, 8)
    assert torch.equal(torch.cat([c[0] for c in chunks]), whole[0])
    assert torch.equal(torch.cat([c[1] for c in chunks]), whole[1])
    assert loader.step == 1
    with pytest.raises(ValueError, match="k=3"):
        loader.micro_batches(3)


def test_synthetic_language_is_learnable() -> None:
    """Empirical bigram conditional entropy matches entropy_bound(), far below log(vocab)."""
    vocab = 64
    lang = SyntheticLanguage(vocab, 128, seed=0)
    tokens = lang.batch(0, 256)
    pairs = tokens[:, :-1] * vocab + tokens[:, 1:]
    counts = torch.bincount(pairs.flatten(), minlength=vocab * vocab).view(vocab, vocab).double()
    row_totals = counts.sum(1, keepdim=True)
    p = counts / row_totals.clamp(min=1)
    h_rows = -(p * p.clamp(min=1e-30).log()).sum(1)
    h = float((h_rows * row_totals.squeeze(1)).sum() / row_totals.sum())
    assert h < 0.35 * math.log(vocab)
    assert h == pytest.approx(lang.entropy_bound(), abs=0.05)
    assert (counts > 0).sum(1).max() <= 4  # each token has at most `branching` successors


def test_byte_file_windows(text_file: Path) -> None:
    data = text_file.read_bytes()
    source = ByteFile(text_file, seq_len=12, seed=7)
    batch = source.batch(0, 16)
    assert batch.shape == (16, 13) and source.vocab == 256
    for row in batch.tolist():
        assert bytes(row) in data
    assert len({tuple(r) for r in batch.tolist()}) > 1  # offsets vary with i
    assert torch.equal(ByteFile(text_file, 12, seed=7).batch(0, 16), batch)
    exact = text_file.parent / "exact.txt"
    exact.write_bytes(b"abcde")
    assert ByteFile(exact, seq_len=4).sample(9).tolist() == list(b"abcde")


def test_errors_name_the_value(tmp_path: Path) -> None:
    lang = SyntheticLanguage(64, 8)
    with pytest.raises(ValueError, match="global_batch=6.*world_size=4"):
        TokenLoader(lang, global_batch=6, world_size=4)
    with pytest.raises(ValueError, match="rank=2.*world_size=2"):
        TokenLoader(lang, global_batch=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="global_batch must be a positive int, got 0"):
        TokenLoader(lang, global_batch=0)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got -1"):
        SyntheticLanguage(64, -1)
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        ByteFile(missing, seq_len=8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"hello")
    with pytest.raises(ValueError, match="5 bytes.*at least 9"):
        ByteFile(short, seq_len=8)
    with pytest.raises(ValueError, match="'parquet'.*synthetic, bytes"):
        make_source("parquet", vocab=64, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="path="):
        make_source("bytes", vocab=256, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="vocab=64"):
        make_source("bytes", vocab=64, seq_len=8, seed=0, path=short)
