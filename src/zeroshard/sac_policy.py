"""Selective activation checkpointing (SAC) policies that keep some ops' outputs and stay
exact when the region writes into a kept output in place.

[Note: in-place writes into a kept output]
torch's SAC (``create_selective_checkpoint_contexts``) keeps a chosen op's output by
reference and, in the recompute, hands that tensor back instead of running the op again.
If the forward later writes into the kept tensor in place, the recompute starts from the
*written* values and writes them again. torch guards this with the tensor's version
counter, but the guard misses an alias with a counter of its own: ``input.matmul(w.t())``
on a 3-D input is ``mm`` followed by ``_unsafe_view``, and ``out += bias`` on the view
bumps the view's counter, not the kept ``mm`` output's. That is how DeepSpeed ZeRO-3's
memory-efficient linear (``zero3_linear_wrap``, which replaces ``torch.nn.functional.linear``
in the whole process) computes: under op-level selective checkpointing the recompute
added every bias twice, and the gradients were wrong with no error (``zeroshard bench``'s
``zs-s3-selective-op`` row ended 0.03-0.6% off DDP's loss whenever a ``ds-z3`` row ran
in the same process; issue #65).

:class:`KeepOutputs` follows the storages of the outputs it keeps. An in-place op that
writes into one is kept too: the recompute then takes its result (the written values,
which the kept storage already holds) instead of writing again — exact. If an op that
is recomputed read the kept storage *before* the write, the recompute would hand it the
written values instead: no policy can make that exact, so the forward raises, naming the
op and the fix. A view of a kept storage (an op whose output shares it) is not a read.

torch's own guard would now refuse the kept in-place op (its version counter moves once
more as the op returns), so the contexts are built with ``allow_cache_entry_mutation``
and the guard is kept here instead, for every kept output: its version counter when kept
(one more for an in-place op's) must still be its counter when the recompute begins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["KeepOutputs", "keep_outputs_contexts"]


class KeepOutputs:
    """The SAC policy of one checkpointed call: keep the outputs of the ops ``keep(op,
    args)`` chooses, recompute the others, and stay exact under in-place writes into a
    kept output (see [Note: in-place writes into a kept output]). One instance per call:
    it follows that call's storages."""

    def __init__(self, keep: Callable[[Any, tuple], bool]) -> None:
        self.keep = keep
        # storage of a kept output -> the first recomputed op that read it, or None
        self.kept: dict[int, str | None] = {}
        # every kept output with the version its counter must have when recomputing
        self.versions: list[tuple[torch.Tensor, int, str]] = []

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy as Sac

        if self.keep(op, args):
            self.kept.update((s, None) for s in _storages(ctx.op_output) - self.kept.keys())
            self._note_versions(op, ctx.op_output, bump=False)
            return Sac.MUST_SAVE
        if not self.kept:
            return Sac.PREFER_RECOMPUTE
        written = _written(op, args, kwargs) & self.kept.keys()
        if written:
            readers = sorted({r for s in written if (r := self.kept[s]) is not None})
            if readers:
                raise RuntimeError(
                    f"selective activation checkpointing cannot recompute this region "
                    f"exactly: {op} writes in place into the output of a kept matmul that "
                    f"{readers[0]} read before the write, and the recompute would hand it "
                    "the written values. A replaced torch.nn.functional.linear does this "
                    "(DeepSpeed ZeRO-3's memory-efficient linear: set "
                    "zero_optimization.memory_efficient_linear=false, or restore "
                    "torch.nn.functional.linear); or use 'full' or block-level 'selective' "
                    "checkpointing")
            # its result is what the kept storage holds already; autograd bumps the
            # written tensor's counter once more as the op returns
            self._note_versions(op, ctx.op_output, bump=True)
            return Sac.MUST_SAVE
        read = _storages((args, kwargs)) & self.kept.keys()
        for s in read - _storages(ctx.op_output) if read else ():  # a view is not a read
            if self.kept[s] is None:
                self.kept[s] = str(op)
        return Sac.PREFER_RECOMPUTE

    def _note_versions(self, op: Any, output: Any, bump: bool) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and _storages(t):
                self.versions.append((_alias(t), t._version + bump, str(op)))

    def check_unchanged(self) -> None:
        """Before the recompute: no kept output was written since it was kept (torch's
        "Tensor cached during selective activation checkpoint has been mutated")."""
        for t, version, op in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"the output of {op} kept by selective activation checkpointing was "
                    "written in place after the forward kept it (its version "
                    f"{version} -> {t._version}), so the recompute would start from other "
                    "values. Write into a copy (out = out + x, not out += x), or use 'full' "
                    "checkpointing")
        self.versions.clear()


class _Recompute:
    """The recompute context, checking the kept outputs first."""

    def __init__(self, inner: Any, policy: KeepOutputs) -> None:
        self.inner, self.policy = inner, policy

    def __enter__(self) -> Any:
        self.policy.check_unchanged()
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def keep_outputs_contexts(keep: Callable[[Any, tuple], bool]) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a fresh :class:`KeepOutputs`
    per checkpointed call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = KeepOutputs(keep)
    forward, recompute = create_selective_checkpoint_contexts(
        policy, allow_cache_entry_mutation=True)  # guarded by policy.check_unchanged
    return forward, _Recompute(recompute, policy)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias sharing ``t``'s version counter. Inside a dispatch mode autograd's
    view kernel is excluded, and a plain detach() would get a counter of its own (torch's
    SAC detaches its cached outputs the same way)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _storages(tree: Any) -> set[int]:
    """The storages the tensors in ``tree`` live in (none for tensors without one:
    traced, functionalised)."""
    out = set()
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            try:
                out.add(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                pass
    return out


def _written(op: Any, args: tuple, kwargs: dict) -> set[int]:
    """The storages ``op`` writes in place (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.is_mutable:
        return set()
    out: set[int] = set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out |= _storages(value)
    return out
