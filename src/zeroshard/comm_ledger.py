"""The books of every collective zeroshard issues: one :class:`CommRecord` per collective
and rank, kept per step in a :class:`CommLedger` that the engine writes and tests, the
benchmark and the planner read. What a record's byte counts mean: [Note: logical vs wire
bytes] in comm.py; how the wire bytes split by link: [Note: bytes by link] in
comm_links.py."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .comm_links import Nodes

__all__ = ["CommRecord", "CommLedger", "KEEP_STEPS", "WINDOW_RECORDS"]


@dataclass(frozen=True)
class CommRecord:
    """One collective as issued by one rank."""

    op: str  # "all_reduce" | "reduce_scatter" | "all_gather" | "broadcast"
    impl: str  # what was really issued: on gloo N "broadcast"s / "reduce"s (see Note)
    logical_bytes: int
    wire_bytes: int  # intra_wire_bytes + inter_wire_bytes
    group: str  # a label for the process group ("world", "shard", "replicate", ...)
    group_size: int
    phase: str  # "forward" | "backward" | "step" | "state" | "other"
    unit: str = ""  # the unit / bucket this collective served
    dtype: str = ""
    #: What this rank sends to ranks of its own node and of other nodes ([Note: bytes by
    #: link] in comm_links.py).
    intra_wire_bytes: int = 0
    inter_wire_bytes: int = 0
    #: Backend calls it was issued as: 1, N where gloo decomposes (N broadcasts / reduces),
    #: one per piece for a pieced all-gather ([Note: small pieces] in comm.py). Each costs
    #: a fixed latency the time model adds (timing/model.py).
    calls: int = 1


#: Completed steps whose records a ledger keeps, beside the open one. A step appends a
#: record (~300 B) per collective, ~100 on an 8-block model at stage 3: kept whole, a
#: million-step run's ledger would hold tens of GB of host memory for Python's collector
#: to walk. Older steps are dropped in batches of this many (``CommLedger.mark_step``).
KEEP_STEPS = 16
#: Records a named window keeps (see CommLedger.window): generation runs a forward per
#: token and no optimizer step closes them.
WINDOW_RECORDS = 4096


@dataclass
class CommLedger:
    """The records of every collective of the last :data:`KEEP_STEPS` to
    ``2 * KEEP_STEPS`` completed steps and of the open one (set-up traffic until it ages
    out), with a few summaries.

    The engine writes to it; tests, the benchmark and the planner read it. ``mark_step``
    lets readers ask for the traffic of the most recent step only.
    """

    records: list[CommRecord] = field(default_factory=list)
    _step_starts: list[int] = field(default_factory=lambda: [0])
    #: Optimizer steps completed (the engine resets it to 0 once set-up traffic is done).
    step: int = 0
    #: Records dropped with old steps (``records`` holds the rest).
    dropped: int = 0
    #: Named windows (``window()``): the last WINDOW_RECORDS records issued inside each.
    windows: dict[str, deque[CommRecord]] = field(default_factory=dict)
    _window: str | None = None
    #: Collectives recorded since the ledger was made (never reset): a rank that sees it
    #: move knows its peers joined a collective since (engine/state_clock.py).
    issued: int = 0
    #: Which node each rank is on: what tells a record's intra- from its inter-node bytes.
    nodes: Nodes = field(default_factory=Nodes.single)

    def add(self, record: CommRecord) -> None:
        self.issued += 1
        if self._window is not None:
            self.windows[self._window].append(record)
        else:
            self.records.append(record)

    @contextmanager
    def window(self, name: str) -> Iterator[deque[CommRecord]]:
        """Record the collectives issued inside in their own bounded window (``name``),
        not in the open step: generation (a forward per token, no step to close the
        records) neither grows the ledger without bound nor counts in a training step's
        traffic. Yields the window; ``windows[name]`` keeps it after."""
        prev = self._window
        records = self.windows.setdefault(name, deque(maxlen=WINDOW_RECORDS))
        self._window = name
        try:
            yield records
        finally:
            self._window = prev

    def clear(self) -> None:
        self.records.clear()
        self._step_starts = [0]
        self.step = 0

    def mark_step(self) -> None:
        """Close the current step: ``last_step()`` then returns its records. Once more than
        ``2 * KEEP_STEPS`` steps are held, the oldest are dropped down to ``KEEP_STEPS``
        (an index into ``records`` is good until the next ``mark_step``)."""
        self._step_starts.append(len(self.records))
        self.step += 1
        held = len(self._step_starts) - 1  # completed steps (set-up traffic counts as one)
        if held > 2 * KEEP_STEPS:
            cut = self._step_starts[held - KEEP_STEPS]
            del self.records[:cut]
            self._step_starts = [s - cut for s in self._step_starts[held - KEEP_STEPS:]]
            self.dropped += cut

    def last_step(self) -> list[CommRecord]:
        """Records of the last completed step (between the last two ``mark_step`` calls)."""
        if len(self._step_starts) < 2:
            return list(self.records)
        return self.records[self._step_starts[-2] : self._step_starts[-1]]

    def totals(self, records: list[CommRecord] | None = None) -> dict[str, int]:
        recs = self.records if records is None else records
        return {
            "logical_bytes": sum(r.logical_bytes for r in recs),
            "wire_bytes": sum(r.wire_bytes for r in recs),
            "intra_wire_bytes": sum(r.intra_wire_bytes for r in recs),
            "inter_wire_bytes": sum(r.inter_wire_bytes for r in recs),
            "calls": len(recs),
        }

    def by(self, key: str, records: list[CommRecord] | None = None) -> dict[str, dict[str, int]]:
        """Totals grouped by a record field, e.g. ``by("op")`` or ``by("phase")``."""
        recs = self.records if records is None else records
        groups: dict[str, list[CommRecord]] = defaultdict(list)
        for r in recs:
            groups[str(getattr(r, key))].append(r)
        return {k: self.totals(v) for k, v in groups.items()}
