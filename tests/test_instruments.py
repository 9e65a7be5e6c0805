"""The measuring instruments: memory tracker, saved-activation counter, FLOP counter.

Every number is checked against an itemised formula, on CPU and under FakeTensorMode.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zeroshard.flops import FlopCounter, count_flops
from zeroshard.memory import Category, MemoryTracker, SavedTensorCounter, record_kept

F32 = 4  # bytes per float32


def param_bytes(module: nn.Module) -> int:
    # module.parameters() yields a tied parameter once.
    return sum(p.numel() * p.element_size() for p in module.parameters())


def mlp(d: int = 32, h: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))


# -- SavedTensorCounter ------------------------------------------------------------------
def test_linear_saves_exactly_its_input() -> None:
    b, d_in, d_out = 4, 16, 8
    lin = nn.Linear(d_in, d_out)
    x = torch.randn(b, d_in, requires_grad=True)  # so weight.t() is saved too
    with SavedTensorCounter() as c:
        lin(x)
    assert c.bytes == b * d_in * F32  # weight excluded: it is a parameter
    assert c.count == 1
    assert c.by_dtype == {torch.float32: b * d_in * F32}

    with SavedTensorCounter(exclude_params=False) as c_all:
        lin(x)
    assert c_all.bytes == b * d_in * F32 + d_in * d_out * F32


def test_input_of_two_linears_counted_once() -> None:
    b, d = 3, 8
    a, bb = nn.Linear(d, d), nn.Linear(d, d)
    x = torch.randn(b, d)
    with SavedTensorCounter() as c:
        a(x) + bb(x)
    assert c.saves == 2  # autograd packs x twice
    assert c.bytes == b * d * F32
    assert c.count == 1


def test_views_of_one_storage_counted_once() -> None:
    w = nn.Parameter(torch.randn(8, 8))
    base = torch.randn(4, 8)
    with SavedTensorCounter() as c:
        (base[:2] @ w).sum()
        (base[2:] @ w).sum()
        (base.t().t() @ w).sum()
    assert c.bytes == base.numel() * F32  # the whole storage, once


def test_params_identified_by_storage() -> None:
    # A plain tensor sharing storage with a parameter (as a sharding engine's unsharded
    # view would) is recognised through `params`.
    lin = nn.Linear(8, 8)
    weight_view = lin.weight.detach().requires_grad_()  # not an nn.Parameter
    x = torch.randn(2, 8, requires_grad=True)
    with SavedTensorCounter() as c_unknown:
        torch.nn.functional.linear(x, weight_view)
    assert c_unknown.bytes == (x.numel() + weight_view.numel()) * F32
    with SavedTensorCounter(params=lambda: [lin.weight]) as c:
        torch.nn.functional.linear(x, weight_view)
    assert c.bytes == x.numel() * F32


def test_add_kept_and_active() -> None:
    assert SavedTensorCounter.active() is None
    kept = torch.randn(5, 7)
    with SavedTensorCounter() as outer, SavedTensorCounter() as inner:
        assert SavedTensorCounter.active() is inner
        inner.add_kept([kept, kept[1:]])
        record_kept(kept)  # reaches every active counter
    assert SavedTensorCounter.active() is None
    assert inner.bytes == outer.bytes == kept.numel() * F32


# -- MemoryTracker ---------------------------------------------------------------------
def test_params_bytes_with_tied_weights() -> None:
    emb = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = emb.weight  # tied: one storage
    model = nn.ModuleDict({"emb": emb, "head": head})
    tracker = MemoryTracker().track_module(model)
    with tracker:
        assert tracker.current()[Category.PARAMS] == 10 * 6 * F32 == param_bytes(model)


def test_training_step_breakdown() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pbytes = param_bytes(model)
    n_tensors = len(list(model.parameters()))
    x = torch.randn(8, 32)
    tracker = MemoryTracker().track_module(model).track_optimizer(opt)
    with tracker:
        loss = model(x).sum()
        after_fwd = tracker.snapshot("after_forward")
        loss.backward()
        after_bwd = tracker.snapshot("after_backward")
        opt.step()
        after_step = tracker.snapshot("after_step")

    assert after_fwd[Category.PARAMS] == pbytes
    assert after_fwd[Category.GRADS] == 0
    assert after_fwd[Category.ACTIVATIONS] > 0
    assert after_bwd[Category.GRADS] == pbytes
    # AdamW: exp_avg + exp_avg_sq (2 x params) + one float32 scalar `step` per tensor.
    assert after_step[Category.OPTIM] == 2 * pbytes + F32 * n_tensors
    assert tracker.peak_total() == sum(tracker.peak().values())
    assert tracker.peak_total() >= 2 * pbytes
    assert tracker.max_per_category()[Category.ACTIVATIONS] >= after_fwd[Category.ACTIVATIONS]
    report = tracker.report()
    json.dumps(report)
    assert report["peak_total"] == tracker.peak_total()
    assert set(report["snapshots"]) == {"after_forward", "after_backward", "after_step"}
    assert report["rss_bytes"] > 0 and report["peak_rss_bytes"] > 0


def test_comm_label_and_resize() -> None:
    tracker = MemoryTracker()
    with tracker:
        flat = torch.empty(1000)
        tracker.label(flat[100:200], Category.COMM)  # a view labels the whole storage
        assert tracker.current()[Category.COMM] == 1000 * F32
        flat.untyped_storage().resize_(0)  # how sharding engines free a gathered buffer
        assert tracker.current()[Category.COMM] == 0
        flat.untyped_storage().resize_(1000 * F32)
        assert tracker.current()[Category.COMM] == 1000 * F32
    with pytest.raises(ValueError, match="use one of"):
        tracker.label(flat, "buffers")


def test_freeing_lowers_current_and_peak_is_kept() -> None:
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(256)
        b = a.view(16, 16)  # same storage: no new bytes
        assert tracker.current_total() == 256 * F32
        del a, b
        assert tracker.current_total() == 0
        assert tracker.peak_total() == 256 * F32
        tracker.reset_peak()
        assert tracker.peak_total() == 0


def test_out_and_inplace_outputs() -> None:
    tracker = MemoryTracker()
    x = torch.randn(64)  # created before entering, no source: not counted
    with tracker:
        out = torch.empty(0)
        torch.add(x, 1, out=out)  # out= grows a new storage
        assert tracker.current_total() == 64 * F32
        out.mul_(2)  # in place: same storage
        assert tracker.current_total() == 64 * F32


def test_activations_during_forward_and_saved_counter_agree() -> None:
    model = mlp()
    x = torch.randn(8, 32)
    tracker = MemoryTracker().track_module(model)
    with tracker, SavedTensorCounter(params=model) as saved:
        loss = model(x).sum()
        acts = tracker.current()[Category.ACTIVATIONS]
    assert acts == saved.bytes > 0
    del loss


def test_add_source_priority_over_saved() -> None:
    # An engine's source wins over "saved for backward"; a label wins over the source.
    w = torch.randn(16, 16, requires_grad=True)  # a "flat parameter" the engine owns
    flat = torch.empty(64)
    tracker = MemoryTracker().add_source(lambda: {Category.PARAMS: [w, flat]})
    with tracker:
        tracker.label(flat, Category.COMM)
        x = torch.randn(4, 16, requires_grad=True)
        loss = (x @ w).sum()  # saves both x and w
        now = tracker.current()
    assert now[Category.PARAMS] == w.numel() * F32
    assert now[Category.COMM] == flat.numel() * F32
    assert now[Category.ACTIVATIONS] == x.numel() * F32
    del loss


def test_host_sources_and_compute_device_split_device_from_host() -> None:
    # What a host source lists is host memory even where host and device are one (CPU).
    master, state = torch.zeros(100), torch.zeros(50)
    weights = torch.zeros(30, dtype=torch.bfloat16)
    tracker = (MemoryTracker()
               .add_source(lambda: {Category.OPTIM: [master, state], Category.PARAMS: [weights]})
               .add_host_source(lambda: [master, state]))
    with tracker:
        where = tracker.current_by_location()
        grown = torch.zeros(1000)  # a new device allocation: the device's peak moves
        del grown
    assert where["host"][Category.OPTIM] == 150 * F32 and where["host"][Category.PARAMS] == 0
    assert where["device"][Category.PARAMS] == 60 and where["device"][Category.OPTIM] == 0
    report = tracker.report()
    assert report["host"]["current_total"] == 600 and report["device"]["current_total"] == 60
    assert tracker.peak_total_by_location() == {"device": 60 + 4000, "host": 600}
    # Computing on an accelerator, every CPU storage is host memory (fake: no real CUDA).
    with FakeTensorMode():
        gpu = torch.empty(256, device="cuda")
        cpu = torch.empty(64)
        tracker = MemoryTracker(compute_device="cuda").add_source(
            lambda: {Category.PARAMS: [gpu], Category.OPTIM: [cpu]})
        with tracker:
            where = tracker.current_by_location()
    assert where["device"][Category.PARAMS] == 256 * F32 and where["device"][Category.OPTIM] == 0
    assert where["host"][Category.OPTIM] == 64 * F32 and where["host"][Category.PARAMS] == 0


def test_optimizer_step_with_many_small_states_stays_linear() -> None:
    # An optimizer step creating thousands of small state tensors, each a new peak, must
    # not re-classify at every one (that was O(n^2)); the step's memory files as optim.
    params = [nn.Parameter(torch.randn(10)) for _ in range(2000)]
    for p in params:
        p.grad = torch.randn(10)
    opt = torch.optim.AdamW(params, foreach=False)
    tracker = MemoryTracker().track_optimizer(opt).add_source(
        lambda: {Category.PARAMS: params, Category.GRADS: [p.grad for p in params]})
    calls = [0]
    inner = tracker._reclassify

    def counting() -> None:
        calls[0] += 1
        inner()

    tracker._reclassify = counting  # type: ignore[method-assign]
    with tracker:
        opt.step()
        peak = tracker.peak()
    assert calls[0] < 600, calls[0]  # ~1% growth steps, not one per state tensor (6000)
    state = 2000 * (2 * 10 * F32 + 4)  # exp_avg, exp_avg_sq, step
    assert tracker.current()[Category.OPTIM] == state
    assert peak[Category.OPTIM] >= state and peak[Category.OTHER] <= 10 * F32 * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_matches_formula() -> None:
    model = mlp().cuda()
    opt = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker(device="cuda").track_module(model).track_optimizer(opt)
    with tracker:
        model(torch.randn(8, 32, device="cuda")).sum().backward()  # backward: worker thread
        assert tracker.current()[Category.GRADS] == param_bytes(model)
        opt.step()
    # capturable=False keeps AdamW's `step` scalars on the CPU, outside device="cuda".
    assert tracker.current()[Category.OPTIM] == 2 * param_bytes(model)
    assert tracker.report()["cuda_max_memory_allocated"] > 0


# -- fake tensors ----------------------------------------------------------------------
def test_fake_large_model_tracker_inside_fake_mode() -> None:
    d, n = 8192, 4
    with FakeTensorMode():
        model = nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])  # ~1 GiB, not allocated
        tracker = MemoryTracker().track_module(model)
        with tracker:
            assert tracker.current()[Category.PARAMS] == n * (d * d + d) * F32
            model(torch.randn(2, d)).sum().backward()
            grads = tracker.current()[Category.GRADS]
    assert grads == n * (d * d + d) * F32
    assert tracker.peak_total() >= 2 * n * (d * d + d) * F32  # params + grads at the end


def test_fake_tracker_outside_fake_mode() -> None:
    tracker = MemoryTracker()
    with tracker, FakeTensorMode():
        model = nn.Linear(1024, 1024)
        tracker.track_module(model)
        assert tracker.current()[Category.PARAMS] == (1024 * 1024 + 1024) * F32


# -- FLOPs -----------------------------------------------------------------------------
def test_linear_flops_forward_and_backward() -> None:
    b, d_in, d_out = 4, 16, 8
    lin = nn.Linear(d_in, d_out)
    x = torch.randn(b, d_in, requires_grad=True)
    _, fwd, by_op = count_flops(lin, x)
    assert fwd == 2 * b * d_in * d_out
    assert by_op == {"aten.addmm": fwd}
    with FlopCounter() as fc:
        lin(x).sum().backward()
    assert fc.total == 3 * fwd
    assert fc.by_module["Global"] == fc.by_op
