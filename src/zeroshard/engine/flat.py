"""Flat, padded buffers: the unit of communication, laid out so each rank's piece of a
parameter is a dim-0 chunk (what ``torch.chunk`` and DTensor's ``Shard(0)`` give it).

[Note: flat buckets]
A :class:`FlatBucket` holds a run of parameters of one dtype. Parameter p of shape
``(R, *rest)`` (a 0-dim parameter counts as ``(1,)``) has rows of ``C = prod(rest)``
elements and is cut along dim 0 into N chunks of ``c = ceil(R / N)`` rows — rank q owns
rows ``[q·c, min((q+1)·c, R))``, possibly none: exactly ``torch.chunk``, so a rank's
piece is a DTensor ``Shard(0)`` local tensor (see [Note: parameters the user sees] in
params.py). Each chunk is padded to ``c·C`` elements. Two layouts of the same elements:

* **shard** (one rank's, S = Σ c·C elements): this rank's chunk of every parameter, end
  to end, at ``slot.shard_offset``. Masters, optimizer state and reduced gradients
  live in it; a rank's piece of p is ``shard[shard_offset : shard_offset + rows_q·C]``.
* **gathered** (N·S, rank-major): rank q's shard at ``[q·S, (q+1)·S)``. One collective
  serves the whole bucket: an all-gather fills it from the shards, a reduce-scatter sums
  it into them. Gradients are copied into it as backward produces them.
* **full** (N·S, parameter-major): p's ``N·c`` rows (padded) end to end at
  ``slot.offset``, so p's compute tensor is a contiguous view
  ``full[offset : offset + numel].view(shape)``, as torch expects.

Gathered and full hold the same elements in two orders; going from one to the other is
one strided copy per parameter (:meth:`FlatBucket.gathered_to_full`, the price FSDP2
pays too: its copy-out). With N = 1 (stage 0, or a world of one) the two orders
coincide and nothing is copied. A rank's chunk of p is contiguous in *full* as well, so
building shards from whole weights (initialisation) needs no gathered buffer.

Stages 0-2 cut buckets by size in reverse registration order (the order backward
produces gradients, as DDP does), so reducing a bucket can start while backward still
runs. Stage 3 cuts one bucket per unit (a transformer block, or the root). Sharding per
bucket rather than per model (Megatron's distributed optimizer does the same) means
every bucket can be reduced the moment it is complete.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["BucketReduction", "ChunkLayout", "FlatBucket", "FlatParam", "GradMarks",
           "HostCopies", "cut_buckets"]


class FlatParam:
    """One parameter of a bucket, and everything the engine knows about it.

    Its place in the bucket (``bucket``, ``index``, the offsets and the row arithmetic
    of [Note: flat buckets]) is fixed when the bucket is cut; the rest is filled in by
    the file that owns it:

    * ``param`` — the *compute* parameter: the tensor forward reads and autograd gives
      gradients to (a view of ``full``); replaced only once, when meta parameters
      become real (:meth:`FlatBucket.replace_meta_params`);
    * params.py (see [Note: parameters the user sees]): ``user`` (what the modules hold
      between forwards; ``param`` itself where no swap is needed), ``spec`` (the user
      DTensor's spec), ``leaves`` (the autograd leaves its gradient arrives on: ``param``
      and one alias per further home of a tied parameter, or a tensor-parallel face),
      ``homes`` (each (module, attribute) that holds it, with the leaf and the user
      parameter it holds in turn);
    * params.py too: ``tp`` (its place on the tp mesh, tensor_parallel.py's TpSpec, or
      None; read by state/layout.py);
    * backward.py: ``nodes`` (the leaves' AccumulateGrad nodes, kept alive for their
      hooks) and the gradient state of the current backward: ``arrived`` (indices into
      ``leaves`` heard from) and ``valid`` (does the bucket's ``grad`` buffer hold this
      parameter's current gradient? A stale one is overwritten by the next gradient — a
      copy, not an add into zeros — or zeroed before a reduction, so buffers never need
      a memset between steps).
    """

    __slots__ = ("names", "param", "shape", "offset", "shard_offset", "world", "bucket",
                 "index", "numel", "rows", "row", "chunk_rows", "chunk", "user", "spec",
                 "leaves", "homes", "tp", "nodes", "arrived", "valid", "__weakref__")

    def __init__(self, names: tuple[str, ...], param: nn.Parameter, offset: int,
                 shard_offset: int, world: int, bucket: FlatBucket, index: int) -> None:
        self.names = names  # every name it is known by
        self.param = param
        self.shape: torch.Size = param.shape
        self.offset = offset  # start of its padded rows in the parameter-major (full) layout
        self.shard_offset = shard_offset  # start of its chunk inside every rank's shard
        self.world = world
        self.bucket = bucket
        self.index = index
        # The row arithmetic, computed once (the hot paths read it per gradient).
        self.numel: int = self.shape.numel()
        self.rows: int = self.shape[0] if len(self.shape) else 1
        self.row: int = self.numel // self.rows if self.rows else 0  # elements per row
        self.chunk_rows: int = -(-self.rows // world)
        self.chunk: int = self.chunk_rows * self.row  # elements of one rank's padded chunk
        self.user: nn.Parameter = param
        self.spec: object | None = None
        self.leaves: list[nn.Parameter] = [param]
        self.homes: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.tp: object | None = None
        self.nodes: list[object] = []
        self.arrived: set[int] = set()
        self.valid = False

    def __repr__(self) -> str:
        return f"FlatParam({self.names[0]!r}, {tuple(self.shape)}, bucket={self.bucket.name!r})"

    def rows_of(self, q: int) -> int:
        """Rows rank ``q`` really owns (``torch.chunk``: the last ones may own fewer, or
        none)."""
        return max(0, min(self.chunk_rows, self.rows - q * self.chunk_rows))

    def piece(self, q: int) -> tuple[int, int]:
        """Rank ``q``'s piece ``[lo, hi)`` in the flattened parameter's coordinates."""
        lo = min(q * self.chunk_rows, self.rows) * self.row
        return lo, lo + self.rows_of(q) * self.row

    def local_shape(self, q: int) -> torch.Size:
        if not len(self.shape):
            return torch.Size([self.rows_of(q)])
        return torch.Size([self.rows_of(q), *self.shape[1:]])


class ChunkLayout:
    """How the optimizer sees a bucket's masters (chunks.py alone writes it): the shard
    ranges of its chunks, each chunk's parameter group and slot, and the per-element
    optimizer state kept flat with each chunk's views of it."""

    __slots__ = ("ranges", "groups", "slot_of", "state", "views")

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.groups: list[int] = []  # optimizer parameter group of each chunk
        self.slot_of: list[int] = []  # the slot (parameter) each chunk belongs to
        self.state: dict[str, torch.Tensor] = {}  # per-element optimizer state, flat
        self.views: dict[str, tuple[torch.Tensor, ...]] = {}  # ... and its chunks


class BucketReduction:
    """A bucket's gradient reduction (reduction.py's Reducer alone writes it: launch,
    complete, stash, forget, rearm)."""

    __slots__ = ("shard", "pending", "launched", "reduced")

    def __init__(self) -> None:
        self.shard: torch.Tensor | None = None  # this rank's reduced slice, reduce dtype
        self.pending: tuple | None = None  # the reduction in flight (comm.Pending, buffer)
        self.launched = False  # its reduction was started this backward
        self.reduced = False  # stage 1: this rank's slice of ``grad`` holds a reduced value


class HostCopies:
    """Offload's host tensors for a bucket (offload.py's Offload alone writes it)."""

    __slots__ = ("grad", "fresh", "weights")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None  # pinned host copy of the reduced slice
        self.fresh = False  # ``grad`` already holds this step's reduced slice
        self.weights: torch.Tensor | None = None  # pinned compute-dtype staging


class GradMarks:
    """Which of a bucket's parameters got a gradient (backward.py writes ``ready`` and
    ``unused``; ``used`` also by step_grads.py's adoption of assigned ``.grad``)."""

    __slots__ = ("ready", "used", "unused")

    def __init__(self, slots: int) -> None:
        self.ready = 0  # parameters whose gradient arrived this backward
        # Per-slot "got a gradient" flags, written by the gradient hooks and by the
        # step's adoption of assigned .grad. Host memory: a write into a CUDA tensor from
        # Python is a host-to-device copy that waits for the stream (the GPU check
        # measured one such wait per parameter per step). Sent once a step.
        self.used = torch.zeros(slots, dtype=torch.float32)
        # slots no rank produced a gradient for in the last synchronised backward
        self.unused: set[int] = set()


class FlatBucket:
    """One bucket's layout (see [Note: flat buckets]) plus the tensors that hold it.

    Buffer lifetimes (who allocates, who frees) are documented on the engine that drives
    the bucket; this class only knows the layout, the slicing and the copies. Its tensors
    are assigned by the file that makes each (listed in the constructor); what one
    mechanism keeps per bucket is a record of its own (``chunking``, ``reduction``,
    ``host``, ``marks``), written by that mechanism's file.
    """

    def __init__(
        self, index: int, name: str, params: list[tuple[tuple[str, ...], nn.Parameter]],
        world: int, rank: int, requires_grad: bool = True,
    ) -> None:
        if not params:
            raise ValueError(f"bucket {name!r} has no parameters")
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {name!r} mixes dtypes {sorted(map(str, dtypes))}")
        self.slots: list[FlatParam] = []
        offset = shard_offset = 0
        for names, p in params:
            s = FlatParam(names, p, offset, shard_offset, world, self, len(self.slots))
            self.slots.append(s)
            offset += world * s.chunk
            shard_offset += s.chunk
        self.index = index
        self.name = name
        self.dtype: torch.dtype = dtypes.pop()
        self.device = params[0][1].device
        self.world = world
        self.rank = rank
        self.requires_grad = requires_grad
        self.numel = sum(s.numel for s in self.slots)
        self.shard_numel = shard_offset
        self.padded_numel = world * shard_offset
        # The storage, each tensor assigned by the file that makes it: materialize.py
        # (``full``, ``master``, ``master_in_full``, ``shard16``), reduction.py (``grad``),
        # chunks.py (``chunks``, ``master_grad``), units.py (``gathering``), secondary.py
        # (``secondary``), refresh.py
        # (``edits_seen``).
        self.full: torch.Tensor | None = None  # compute-dtype weights, parameter-major
        self.grad: torch.Tensor | None = None  # compute-dtype gradients, gathered layout
        self.master: nn.Parameter | None = None  # what the optimizer steps, in chunks:
        self.chunks: list[nn.Parameter] = []  # views of master (see engine/chunks.py)
        # ... or, with ``master_in_full``, views of this rank's chunks of ``full`` (see
        # [Note: masters inside the weights]); then ``master`` is None.
        self.master_in_full = False
        self.master_grad: torch.Tensor | None = None  # shard layout, see set_master_grad
        self.edits_seen = -1  # Faces.edits when the compute weights were derived
        self.shard16: torch.Tensor | None = None  # stage 3: compute-dtype slice kept
        self.gathering: torch.Tensor | None = None  # stage 3: all-gather in flight
        self.secondary: torch.Tensor | None = None  # stage 3: secondary.py (hpZ)
        # What one mechanism keeps per bucket, written by that mechanism's file alone.
        self.chunking = ChunkLayout()  # chunks.py
        self.reduction = BucketReduction()  # reduction.py
        self.host = HostCopies()  # offload.py
        self.marks = GradMarks(len(self.slots))  # backward.py (and step_grads.py: ``used``)

    # -- layout ------------------------------------------------------------------------
    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_range(self) -> tuple[int, int]:
        lo = self.rank * self.shard_numel
        return lo, lo + self.shard_numel

    def shard_of(self, gathered: torch.Tensor) -> torch.Tensor:
        """This rank's shard inside a gathered-layout tensor."""
        lo, hi = self.shard_range
        return gathered[lo:hi]

    def local(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i``'s piece inside a shard-layout tensor, shaped as its DTensor local."""
        s = self.slots[i]
        n = s.rows_of(self.rank) * s.row
        return shard[s.shard_offset : s.shard_offset + n].view(s.local_shape(self.rank))

    def slot_view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i``'s whole parameter inside a full-layout tensor."""
        s = self.slots[i]
        return full[s.offset : s.offset + s.numel].view(s.shape)

    def views(self, full: torch.Tensor) -> Iterable[tuple[FlatParam, torch.Tensor]]:
        for i, s in enumerate(self.slots):
            yield s, self.slot_view(full, i)

    def slots_in_shard(self) -> Iterable[tuple[FlatParam, int, int]]:
        """(slot, lo, hi): each parameter's piece in this rank's shard coordinates."""
        for s in self.slots:
            n = s.rows_of(self.rank) * s.row
            if n:
                yield s, s.shard_offset, s.shard_offset + n

    # -- the masters (see [Note: masters inside the weights]) -------------------------------
    @property
    def master_dtype(self) -> torch.dtype:
        return self.master.dtype if self.master is not None else self.full.dtype

    @property
    def master_device(self) -> torch.device:
        return self.master.device if self.master is not None else self.full.device

    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        """A writable view of the masters' shard-layout range ``[lo, hi)``; inside
        ``full`` the range must lie within one parameter's chunk (each is contiguous
        there, the shard as a whole is not)."""
        if self.master is not None:
            return self.master.detach()[lo:hi]
        s = next((s for s in self.slots if s.shard_offset <= lo and hi <= s.shard_offset + s.chunk),
                 None)
        if s is None:
            raise ValueError(f"bucket {self.name!r}: master range [{lo}, {hi}) spans two "
                             "parameters; inside the weights only one parameter's chunk is "
                             "contiguous")
        start = s.offset + self.rank * s.chunk + lo - s.shard_offset
        return self.full[start : start + hi - lo]

    # -- copies between the layouts ----------------------------------------------------
    def _rank_major(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Per slot, its N chunks inside a gathered tensor: an (N, c·C) strided view."""
        return list(gathered.view(self.world, self.shard_numel).split(
            [s.chunk for s in self.slots], dim=1))

    def _param_major(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [full[s.offset : s.offset + self.world * s.chunk].view(self.world, s.chunk)
                for s in self.slots]

    def gathered_to_full(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Copy-out after an all-gather (a no-op when the two are one tensor, N = 1)."""
        if gathered is full:
            return
        torch._foreach_copy_(self._param_major(full), self._rank_major(gathered))

    def slices_to_full(self, own: torch.Tensor, others: torch.Tensor,
                       full: torch.Tensor) -> None:
        """Copy-out after :meth:`Comm.all_gather_from`: this rank's chunks from ``own``
        (its shard), the other ranks' from ``others`` (theirs end to end, this rank's
        left out)."""
        sizes = [s.chunk for s in self.slots]
        rows = list(others.view(self.world - 1, self.shard_numel).unbind(0))
        rows.insert(self.rank, own)
        src, dst = [], []
        for q, row in enumerate(rows):
            src += row.split(sizes)
            dst += [full[s.offset + q * s.chunk : s.offset + (q + 1) * s.chunk]
                    for s in self.slots]
        torch._foreach_copy_(dst, src)

    def full_to_gathered(self, full: torch.Tensor, gathered: torch.Tensor) -> None:
        if gathered is full:
            return
        torch._foreach_copy_(self._rank_major(gathered), self._param_major(full))

    def shard_from_full(self, full: torch.Tensor, out: torch.Tensor | None = None,
                        rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s shard of a full-layout tensor (each chunk is contiguous there)."""
        q = self.rank if rank is None else rank
        if out is None:
            out = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        for s in self.slots:
            lo = s.offset + q * s.chunk
            out[s.shard_offset : s.shard_offset + s.chunk].copy_(full[lo : lo + s.chunk])
        return out

    def shard_to_full(self, shard: torch.Tensor, full: torch.Tensor,
                      rank: int | None = None) -> None:
        """Rank ``rank``'s (default this rank's) shard into its chunks of a full-layout
        tensor (casting if the dtypes differ); inverse of :meth:`shard_from_full`."""
        q = self.rank if rank is None else rank
        for s in self.slots:
            lo = s.offset + q * s.chunk
            full[lo : lo + s.chunk].copy_(shard[s.shard_offset : s.shard_offset + s.chunk])

    def rank_pieces(self, full: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per rank q, its chunk of each parameter inside a full-layout tensor: the
        contiguous pieces an all-gather straight into ``full`` moves."""
        return [[full[s.offset + q * s.chunk : s.offset + (q + 1) * s.chunk] for s in self.slots]
                for q in range(self.world)]

    def grad_region(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i``'s N chunks (padding included) inside a gathered-layout gradient."""
        s = self.slots[i]
        g = gathered.view(self.world, self.shard_numel)
        return g[:, s.shard_offset : s.shard_offset + s.chunk]

    def put_grad(self, gathered: torch.Tensor, i: int, grad: torch.Tensor, add: bool) -> None:
        """Copy (or add) a whole gradient into its chunks of a gathered-layout buffer;
        padding rows are zeroed by a copy and left alone (zero) by an add."""
        s = self.slots[i]
        region = self.grad_region(gathered, i)
        flat = grad.reshape(-1)
        if s.numel == self.world * s.chunk:  # no padding: one strided copy
            src = flat.view(self.world, s.chunk)
            region.add_(src) if add else region.copy_(src)
            return
        k, rem = divmod(s.numel, s.chunk) if s.chunk else (0, 0)
        op = torch.Tensor.add_ if add else torch.Tensor.copy_
        if k:
            op(region[:k], flat[: k * s.chunk].view(k, s.chunk))
        if rem:
            op(region[k, :rem], flat[k * s.chunk :])
        if not add:
            if rem:
                region[k, rem:].zero_()
            region[k + (1 if rem else 0) :].zero_()

    # -- the parameters ----------------------------------------------------------------
    def flatten(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new full-layout copy of the parameters' current values (padding zeroed)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=self.device)
        for s, view in self.views(flat):
            view.copy_(s.param.detach())
        return flat

    def point_params_at(self, full: torch.Tensor) -> None:
        """Make every compute parameter a view into ``full`` (keeps its identity)."""
        for s, view in self.views(full):
            s.param.data = view

    def replace_meta_params(self, model: nn.Module, full: torch.Tensor) -> None:
        """Swap meta parameters for real ones viewing ``full``, under every name.

        A meta tensor's ``.data`` cannot be pointed at real memory, so each parameter is
        replaced by a new ``nn.Parameter`` — set on every module that holds it, keeping
        tied weights tied.
        """
        for s, view in list(self.views(full)):
            # Not nn.Parameter(view): that would share ``full``'s version counter, so
            # every later write into the buffer (a gather) would look to autograd like an
            # in-place change of a saved weight. ``.data`` aliases memory only.
            new = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                               requires_grad=s.param.requires_grad)
            new.data = view
            for name in s.names:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, new)
            s.param = new
            s.user = new
            s.leaves = [new]
        self.device = full.device

    def grad_views(self, full: torch.Tensor) -> None:
        for s, view in self.views(full):
            s.param.grad = view


def cut_buckets(
    params: list[tuple[tuple[str, ...], nn.Parameter]], bucket_bytes: int, world: int,
    rank: int, start_index: int = 0, name_prefix: str = "bucket",
) -> list[FlatBucket]:
    """Cut ``params`` (in the order given) into size-bounded, single-dtype buckets.

    A parameter larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[FlatBucket] = []
    group: list[tuple[tuple[str, ...], nn.Parameter]] = []
    size = 0

    def close() -> None:
        nonlocal group, size
        if group:
            i = start_index + len(buckets)
            buckets.append(FlatBucket(i, f"{name_prefix}{i}", group, world, rank))
        group, size = [], 0

    for names, p in params:
        nbytes = p.numel() * p.element_size()
        if group and (size + nbytes > bucket_bytes or p.dtype != group[0][1].dtype):
            close()
        group.append((names, p))
        size += nbytes
    close()
    return buckets
