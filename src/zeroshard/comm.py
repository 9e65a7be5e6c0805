"""Every collective zeroshard issues, behind one small interface that also keeps the books.

[Note: logical vs wire bytes]
The ledger records two byte counts per collective, both *per rank*:

* ``logical_bytes`` is the ZeRO paper's volume (Rajbhandari et al. 2020, §7): an all-reduce
  of a tensor of S bytes counts 2S, a reduce-scatter or all-gather whose *full* (unsharded)
  tensor is S bytes counts S. Plain data parallelism is therefore 2Ψ per step, stages 1-2
  are Ψ + Ψ = 2Ψ, stage 3 is 3Ψ (Ψ counted in bytes of the communicated dtype).
* ``wire_bytes`` is what this rank actually sends for the collective as the backend runs
  it (gloo's algorithms exactly, others as a ring; see [Note: bytes by link] in
  comm_links.py, which also splits it into ``intra_wire_bytes`` and ``inter_wire_bytes``
  by node): a ring all-reduce 2S(N-1)/N, a ring reduce-scatter or all-gather S(N-1)/N,
  N broadcasts of S/N the same, N gloo reduces more.

[Note: collectives per backend]
gloo implements reduce-scatter as one all-reduce per rank, and its all-gather is slow.
Measured on our 2-core machines (25 MB fp32, bytes of the whole tensor per second):

    N=2: all_gather 0.67 GB/s, reduce_scatter 0.73, all_reduce 1.06,
         N async broadcasts 2.75, N async reduces 1.22
    N=3: all_gather 0.66 GB/s, reduce_scatter 0.50, all_reduce 0.57,
         N async broadcasts 1.57, N async reduces 0.91

So on gloo an all-gather is issued as N broadcasts (rank r broadcasts its slice) and a
reduce-scatter as N reduces (slice r summed onto rank r), all in flight at once, and the
result is bit-identical. The N broadcasts send the ring's S(N-1)/N per rank; the N reduces
send more (gloo's reduce is a ring reduce-scatter then a gather to the root: for slices of
2N MiB or less S(N-1)/N + S(N-1)/N^2, for large ones nearly S + S(N-1)/N^2): faster on one
machine, where bytes cost little and latency much, and counted as sent in the ledger. On
NCCL (and anything else) the native collectives are used. The choice is made once per
group (:func:`_backend`) and reported in the ledger as ``impl``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .comm_check import CHECK_TIMEOUT, OPS, PHASES, Check, issue, make_check_group, unit_key
from .comm_ledger import KEEP_STEPS, WINDOW_RECORDS, CommLedger, CommRecord
from .comm_links import sent_by
from .comm_wait import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    Pending,
    track,
    waiting_in,
)
from .peer_watch import WATCH

__all__ = ["CommRecord", "CommLedger", "Comm", "Pending", "CollectiveTimeout",
           "CollectiveMismatch", "CollectiveError", "CHECK_TIMEOUT", "KEEP_STEPS",
           "WINDOW_RECORDS"]


def _backend(group: dist.ProcessGroup | None) -> str:
    """The group's backend ("gloo" decomposes, see [Note: collectives per backend]); ""
    for groups that cannot say."""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # fake or custom groups
        return ""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: [Note: small pieces]
#: A gloo broadcast costs a fixed ~0.2-0.4 ms on our machines however small, and stages
#: 1-2's post-step gather moves one piece per parameter per rank: on gpt2-small 200
#: pieces, half of them biases and norms of 1-4 KiB. Broadcast one by one the gather took
#: 86 ms against 39 ms for the same bytes in 32 pieces; packing each rank's pieces under
#: this size into one buffer (a copy in on the owner, a copy out on the others, a few KiB)
#: brought it to 62 ms (interleaved, same process; ``benchmarks/ab-results.txt``). Large
#: pieces still go straight into place: copying them would cost more than it saves.
PACK_BELOW = 64 * 2**10


class Comm:
    """The collectives of one process group, recorded in a :class:`CommLedger`.

    ``group=None`` means the default (world) group. All methods are synchronous from the
    caller's point of view unless ``async_op=True`` is passed where offered.

    Collective checks and timeouts: see [Note: divergence] in comm_check.py.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ledger: CommLedger | None = None,
        label: str = "world",
        decompose: bool | None = None,
    ) -> None:
        self.group = group
        self.ledger = ledger if ledger is not None else CommLedger()
        self.label = label
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.backend = _backend(group)
        self.decompose = self.backend == "gloo" if decompose is None else decompose
        self.peers = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.size)
        ]
        here = self.ledger.nodes.node_of(self.global_rank)
        #: Whether each group rank is on this rank's node ([Note: bytes by link]).
        self.same_node = [self.ledger.nodes.node_of(p) == here for p in self.peers]
        self.timeout: float | None = None
        self.pack_below = PACK_BELOW  # bytes; see [Note: small pieces]
        self.check: bool | str = False
        self.check_group: dist.ProcessGroup | None = None
        self.unverified: list[Check] = []  # posted checks not yet compared
        self.unit_names: dict[int, str] = {}  # unit-name hashes seen, to decode peers'
        self._seq = (-1, 0)  # (step, index within step)
        track(self)  # see [Note: stranded groups] in comm_wait.py

    def enable_check(self, mode: bool | str = True) -> None:
        """Turn on the collective check (see [Note: divergence] in comm_check.py).
        Collective over the group's ranks: it creates the gloo group the descriptors travel
        on. A fake group (traced planning) has no peers to disagree with, so nothing is
        checked there."""
        self.check = False
        if self.size == 1 or not dist.is_available():
            return
        try:
            backend = str(dist.get_backend(self.group))
        except (RuntimeError, ValueError):
            return
        if backend == "fake":
            return
        self.check_group = make_check_group(self.peers, self.group is None and backend == "gloo")
        self.check = mode
        WATCH.bind(CollectiveMismatch)  # see [Note: asking the peers]

    # -- bookkeeping ---------------------------------------------------------------------
    def _sent(self, prim: str, parts: list[tuple[int, int]], elem: int = 1) -> dict[int, int]:
        """This rank's bytes to each group peer for ``prim`` issued over ``parts``."""
        return sent_by(self.backend, prim, parts, self.size, self.rank, elem)

    def _begin(
        self, op: str, impl: str, t: torch.Tensor, full_bytes: int, phase: str, unit: str,
        sent: dict[int, int], checked: bool = True, strict: bool = False,
        numel: int | None = None, calls: int = 1,
    ) -> tuple[str, Check | None]:
        """Record the collective (``sent``: this rank's bytes to each group peer) and post
        its check (see [Note: divergence] in comm_check.py, unless not ``checked``); its
        description and the check to verify before its result is used (``strict``:
        verified before the collective is issued)."""
        n = self.size
        logical = 2 * full_bytes if op == "all_reduce" else full_bytes
        intra = sum(b for q, b in sent.items() if self.same_node[q])
        inter = sum(sent.values()) - intra
        self.ledger.add(
            CommRecord(
                op=op,
                impl=impl,
                logical_bytes=logical,
                wire_bytes=intra + inter,
                group=self.label,
                group_size=n,
                phase=phase,
                unit=unit,
                dtype=str(t.dtype).replace("torch.", ""),
                intra_wire_bytes=intra,
                inter_wire_bytes=inter,
                calls=calls,
            )
        )
        desc = f"{op}({unit or '-'}, {phase}, {full_bytes} B)"
        check = None
        if self.check and n > 1 and not checked:
            self._verify_answered()  # a run's check, if the peers have answered it
        if self.check and n > 1 and checked:
            check = self._post(op, unit, phase, t.numel() if numel is None else numel)
            if self.check == "strict" or strict:
                check.verify()
                check = None
        return desc, check

    def know_names(self, names: list[str]) -> None:
        """Unit names a peer may mention, so mismatch reports can name them."""
        for n in names:
            self.unit_names[unit_key(n)] = n

    def _post(self, op: str, unit: str, phase: str, numel: int) -> Check:
        """Start exchanging this collective's descriptor over the check group. Checks
        already answered are compared first, so a divergence is reported before the next
        collective is issued wherever the peers have caught up."""
        self._verify_answered()
        step = self.ledger.step
        index = self._seq[1] + 1 if self._seq[0] == step else 0
        self._seq = (step, index)
        self.know_names([unit])
        ph = PHASES.index(phase if phase in PHASES else "other")
        # A forward without gradients (evaluation) is told apart from a training one.
        grad = int(torch.is_grad_enabled()) if phase == "forward" else 1
        mine = torch.tensor([step, index, OPS.index(op), unit_key(unit), ph, numel, grad],
                            dtype=torch.int64)
        table = torch.empty(self.size * 7, dtype=torch.int64)
        work = _all_gather_single(table, mine, self.check_group, True)
        number = issue(self.peers)
        what = (f"the check point before {unit}" if op == "barrier"
                else f"the check of {op}({unit}, {phase})")
        check = Check(self, work, table, what, unit, phase, number)
        self.unverified.append(check)
        return check

    def run_check(self, first: bool, numel: int) -> dict[str, Any]:
        """Keyword arguments for one collective of a run whose order and sizes the layout
        fixes (``numel``: the run's elements): the first is checked for the whole run, the
        rest not — unless checks are strict (see [Note: one check per run] in
        comm_check.py)."""
        if self.check == "strict":
            return {}
        return {"check_numel": numel} if first else {"checked": False}

    def _verify_answered(self) -> None:
        """Compare the posted checks the peers have answered, oldest first."""
        while self.unverified and self.unverified[0].ready():
            self.unverified.pop(0).verify()

    def sync_point(self, name: str, phase: str = "sync") -> None:
        """With ``check`` on, make ranks agree they reached ``name`` before going on
        (no-op otherwise): a blocking check, where one rank alone would start something
        the others are not doing — a stage-3 forward (evaluation on one rank), a state
        dict — so that every rank reports the divergence before any mismatched
        collective is issued (see [Note: divergence] in comm_check.py)."""
        if self.check and self.size > 1:
            self._post("barrier", name, phase, 0)
            while self.unverified:
                self.unverified.pop(0).verify()

    def _finish(self, works: list, out: torch.Tensor, desc: str, async_op: bool,
                check: Check | None = None, then: Callable[[], None] | None = None,
                ) -> Pending:
        pending = Pending(works, out, desc, self, check=check, then=then)
        if not async_op:
            pending.wait()
        return pending

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, *, phase: str = "other", unit: str = "",
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
        checked: bool = True, check_numel: int | None = None,
    ) -> Pending:
        """In-place all-reduce (sum by default); ``.wait()`` returns ``tensor``. Not
        ``checked``: no descriptor check (for a collective whose place in the order
        others already pin down; see TensorParallel.local_grads and [Note: one check per
        run]); ``check_numel``: the element count its descriptor states instead of its
        own."""
        nbytes = _nbytes(tensor)
        desc, check = self._begin("all_reduce", "all_reduce", tensor, nbytes, phase, unit,
                                  self._sent("all_reduce", [(nbytes, 0)]), checked,
                                  numel=check_numel)
        if self.size == 1:
            return Pending(None, tensor, "")
        with waiting_in(desc):
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._finish([work], tensor, desc, async_op, check)

    def reduce_scatter(
        self, full: torch.Tensor, *, phase: str = "backward", unit: str = "",
        async_op: bool = False, checked: bool = True, check_numel: int | None = None,
    ) -> Pending:
        """Sum ``full`` (numel divisible by N) across ranks; ``.wait()`` gives this rank's slice.

        The slice may be a view into ``full`` (gloo path): callers must not reuse ``full``
        before waiting, nor assume it is unchanged afterwards.
        """
        n = self.size
        if full.numel() % n:
            raise ValueError(f"reduce_scatter needs numel divisible by {n}, got {full.numel()}")
        shard = full.numel() // n
        impl = "reduce" if (self.decompose and n > 1) else "reduce_scatter"
        size, elem = _nbytes(full), full.element_size()
        sent = (self._sent("reduce", [(size // n, r) for r in range(n)], elem)
                if impl == "reduce" else self._sent("reduce_scatter", [(size, 0)]))
        desc, check = self._begin("reduce_scatter", impl, full, size, phase, unit, sent,
                                  checked, numel=check_numel, calls=n if impl == "reduce" else 1)
        if n == 1:
            return Pending(None, full, "")
        with waiting_in(desc):
            if impl == "reduce":
                # Slice r is summed onto rank r; other ranks' copies of it become scratch.
                work = [dist.reduce(full[r * shard : (r + 1) * shard], dst=self.peers[r],
                                    group=self.group, async_op=True) for r in range(n)]
                out = full[self.rank * shard : (self.rank + 1) * shard]
            else:
                out = torch.empty(shard, dtype=full.dtype, device=full.device)
                work = [_reduce_scatter_single(out, full, self.group, True)]
        return self._finish(work, out, desc, async_op, check)

    def all_gather(
        self, full: torch.Tensor, *, phase: str = "step", unit: str = "",
        async_op: bool = False, checked: bool = True, check_numel: int | None = None,
    ) -> Pending:
        """Fill ``full`` from every rank's slice; this rank's slice must already be in place.

        In-place: rank r's input is ``full[r*S:(r+1)*S]``. ``.wait()`` returns ``full``.
        """
        n = self.size
        if full.numel() % n:
            raise ValueError(f"all_gather needs numel divisible by {n}, got {full.numel()}")
        impl = "broadcast" if (self.decompose and n > 1) else "all_gather"
        size = _nbytes(full)
        sent = (self._sent("broadcast", [(size // n, r) for r in range(n)])
                if impl == "broadcast" else self._sent("all_gather", [(size, 0)]))
        desc, check = self._begin("all_gather", impl, full, size, phase, unit, sent,
                                  checked, numel=check_numel,
                                  calls=n if impl == "broadcast" else 1)
        if n == 1:
            return Pending(None, full, "")
        shard = full.numel() // n
        with waiting_in(desc):
            if impl == "broadcast":
                work = [dist.broadcast(full[r * shard : (r + 1) * shard], src=self.peers[r],
                                       group=self.group, async_op=True) for r in range(n)]
            else:
                lo = self.rank * shard
                work = [_all_gather_single(full, full[lo : lo + shard], self.group, True)]
        return self._finish(work, full, desc, async_op, check)

    def all_gather_from(
        self, own: torch.Tensor, others: torch.Tensor, *, phase: str = "forward",
        unit: str = "", async_op: bool = False,
    ) -> Pending:
        """All-gather of N slices of ``own.numel()`` elements where this rank's slice is
        ``own``, sent from where it lives, and the other ranks' land in ``others``
        ((N-1)·S elements, rank order, this rank's left out: rank q < rank at
        ``[q·S, (q+1)·S)``, rank q > rank one slice lower). Only where ``decompose``
        (gloo), where it is N broadcasts anyway: nothing is copied into a gathered buffer
        first and the buffer is (N-1)/N of one (see [Note: unit lifecycle] in
        engine/units.py). Logically one all-gather of N·S, checked and counted as one."""
        n, s = self.size, own.numel()
        if not self.decompose:
            raise ValueError("all_gather_from runs as broadcasts: only on a decomposing "
                             "(gloo) group; use all_gather with a gathered buffer")
        if others.numel() != (n - 1) * s:
            raise ValueError(f"all_gather_from: others has {others.numel()} elements, "
                             f"expected ({n} - 1) x {s}")
        sent = self._sent("broadcast", [(_nbytes(own), q) for q in range(n)])
        desc, check = self._begin("all_gather", "broadcast", own, n * _nbytes(own), phase,
                                  unit, sent, calls=n)
        if n == 1:
            return Pending(None, own, "")
        with waiting_in(desc):
            work = [dist.broadcast(own if q == self.rank else
                                   others[(q - (q > self.rank)) * s:][:s],
                                   src=self.peers[q], group=self.group, async_op=True)
                    for q in range(n)]
        return self._finish(work, others, desc, async_op, check)

    def all_gather_pieces(
        self, full: torch.Tensor, pieces: list[list[torch.Tensor]], *, phase: str = "step",
        unit: str = "", async_op: bool = False, checked: bool = True,
        check_numel: int | None = None,
    ) -> Pending:
        """All-gather where each rank's part is several contiguous pieces of ``full``
        (``pieces[q]``: rank q's views into ``full``, the same count and sizes on every
        rank; this rank's already hold its values). Only where ``decompose`` (gloo): each
        piece is broadcast from its owner straight into place, so nothing is packed before
        or copied out after — except pieces under ``pack_below`` bytes (see [Note: small
        pieces]). Logically one all-gather of ``full``, checked and counted as one."""
        n = self.size
        if not self.decompose:
            raise ValueError("all_gather_pieces runs as broadcasts: only on a decomposing "
                             "(gloo) group; use all_gather with a gathered buffer")
        plan = [_piece_plan(mine, self.pack_below) for mine in pieces]
        parts = [(_nbytes(t), q) for q, (alone, _) in enumerate(plan) for t in alone]
        parts += [(sum(map(_nbytes, small)), q) for q, (_, small) in enumerate(plan) if small]
        sent = self._sent("broadcast", parts)
        desc, check = self._begin("all_gather", "broadcast", full, _nbytes(full), phase, unit,
                                  sent, checked, numel=check_numel, calls=len(parts))
        if n == 1:
            return Pending(None, full, "")
        work, unpack = [], []
        with waiting_in(desc):
            for q, (alone, small) in enumerate(plan):
                for t in alone:
                    work.append(dist.broadcast(t, src=self.peers[q], group=self.group,
                                               async_op=True))
                if not small:
                    continue
                if q == self.rank:
                    pack = torch.cat([t.reshape(-1) for t in small])
                else:
                    pack = torch.empty(sum(t.numel() for t in small), dtype=full.dtype,
                                       device=full.device)
                    unpack.append((pack, small))
                work.append(dist.broadcast(pack, src=self.peers[q], group=self.group,
                                           async_op=True))
        then = functools.partial(_unpack, unpack) if unpack else None
        return self._finish(work, full, desc, async_op, check, then=then)

    def all_gather_into(
        self, full: torch.Tensor, shard: torch.Tensor, *, phase: str = "forward",
        unit: str = "",
    ) -> None:
        """Gather every rank's ``shard`` into ``full`` (out of place)."""
        n = self.size
        if full.numel() != shard.numel() * n:
            raise ValueError(
                f"all_gather_into: full has {full.numel()} elements, expected "
                f"{n} x {shard.numel()}"
            )
        lo = self.rank * shard.numel()
        full[lo : lo + shard.numel()].copy_(shard)
        self.all_gather(full, phase=phase, unit=unit).wait()

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
        in_splits: list[int], *, total: int, phase: str = "step", unit: str = "",
        async_op: bool = False,
    ) -> Pending:
        """``inp[in_splits[q] piece]`` goes to rank q, rank q's piece for this rank lands in
        ``out`` (rank order). The ranks send different amounts, so the check
        compares ``total`` (the elements the whole job exchanges, the same on every rank);
        the ledger counts what this rank sends to the others, logical and on the wire."""
        n = self.size
        if len(out_splits) != n or len(in_splits) != n or sum(in_splits) != inp.numel() or (
                sum(out_splits) != out.numel()):
            raise ValueError(f"all_to_all: splits {in_splits} -> {out_splits} do not fit "
                             f"{inp.numel()} -> {out.numel()} elements over {n} ranks")
        elem = inp.element_size()
        sent = {q: k * elem for q, k in enumerate(in_splits) if q != self.rank and k}
        desc, check = self._begin("all_to_all", "all_to_all", inp, sum(sent.values()), phase,
                                  unit, sent, numel=total)
        if n == 1:
            out.copy_(inp)
            return Pending(None, out, "")
        with waiting_in(desc):
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group,
                                          async_op=True)
        # ``inp`` (often a temporary the caller packed) lives until the exchange is done, as
        # the backend's work keeps it: a trace's fake group, whose work is done at once,
        # would otherwise free it early and under-count the step (memory/traced.py).
        return self._finish([work], out, desc, async_op, check, then=inp.size)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, phase: str = "other", unit: str = "",
        strict: bool = False,
    ) -> None:
        """``strict``: its check completes before the broadcast is issued — where one rank
        alone may be issuing it (a forward's buffers), so that a lone rank raises with
        nothing in flight and its peers' own collectives fail as soon as it ends."""
        nbytes = _nbytes(tensor)
        desc, check = self._begin("broadcast", "broadcast", tensor, nbytes, phase, unit,
                                  self._sent("broadcast", [(nbytes, src)]), strict=strict)
        if self.size == 1:
            return
        with waiting_in(desc):
            work = dist.broadcast(tensor, src=self.peers[src], group=self.group,
                                  async_op=True)
        self._finish([work], tensor, desc, False, check)


def _piece_plan(pieces: list[torch.Tensor],
                pack_below: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One rank's pieces: those broadcast alone, and those packed into one broadcast
    (see [Note: small pieces])."""
    small = [t for t in pieces if 0 < _nbytes(t) < pack_below]
    if len(small) < 2:  # nothing to gain from a pack
        small = []
    packed = {id(t) for t in small}
    return [t for t in pieces if t.numel() and id(t) not in packed], small


def _unpack(packs: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
    """Copy received packs of small pieces into place (see [Note: small pieces])."""
    for pack, pieces in packs:
        for t, v in zip(pieces, pack.split([t.numel() for t in pieces])):
            t.copy_(v.view_as(t))


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    # torch 2.13 prefers the *_single names; keep working on torch >= 2.6.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)
