"""State dicts served: ``model.state_dict()`` and ``optimizer.state_dict()`` on one rank
alone, the others training on, as under DDP.

[Note: state dicts served]
A DDP script saves on rank 0 alone (``if rank == 0: torch.save({"model":
model.state_dict(), "optimizer": optimizer.state_dict()}, path)``: timm's
CheckpointSaver, ``--recovery-interval``, most hand-written loops). At stages 1-3 (stages
1-2 under mixed precision for the weights) rank 0 does not hold the whole state, and a
collective it issues alone can only fail. So the whole state is *read* from the peers,
never gathered collectively:

* Each process runs one server thread per group of ranks that shards a model together,
  on a gloo group of its own made when the first such model is sharded. It waits in a
  receive from any rank, costs nothing while nobody asks (no collective, no poll, nothing
  in the ledger), and answers a request with this rank's shard of one bucket (the
  weights, or one key of an optimizer's state) from its engine's buffers.
* The asking rank — rank 0 alone, or every rank at once (the state dict is no longer a
  collective, so both are the same call) — first asks every peer to *hold* the version of
  the state it holds itself ([Note: the state clock] in state_clock.py), then fetches
  bucket by bucket into one gathered buffer (the output plus one bucket: the memory of
  the collective it replaces), then lets go. A peer that is training on is blocked at its
  next collective with the asking rank (a stage-3 forward's gather, a backward's
  reduction): its shards cannot change before the asking rank's next step, and a peer
  still finishing the step the asking rank finished is waited for. So the answer is the
  state after the asking rank's last step on every rank, read when asked: no copy kept,
  nothing cached.
* Errors name the rank: a peer that has left the job (its connection closed) is a
  :class:`CollectiveError` at once; one that does not answer within the model's timeout
  (``timeout=``, default CHECK_TIMEOUT) a :class:`CollectiveTimeout`; a peer already past
  the asking rank's step an error saying where to take the state dict.

Where it does not apply, the state dict stays a collective, as before: NCCL (a collective
queued on the device waits for rank 0 while the serving group needs the device too — a
known cross-communicator deadlock, so it is claimed only after a GPU test), tensor
parallelism (whole values join the tp pieces collectively) and whole-parameter optimizers'
state (Muon: each owner's entries are gathered). There rank 0 alone gets the divergence
error, whose hint says that rank 0 is taking a state dict alone.

The server's messages travel outside the communicators (not in the ledger, no collective
check); the peer watch sees the asking rank as running ([Note: asking the peers]), as it
waits in ``Work.wait`` under this module, never in a ``torch.distributed`` collective.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..comm_check import CHECK_TIMEOUT
from ..comm_wait import CollectiveError, CollectiveTimeout
from .state_clock import Ahead

if TYPE_CHECKING:
    from .engine import Engine
    from .flat import FlatBucket

__all__ = ["ShardServer", "serves", "server_for", "key_code", "WEIGHTS"]

# Request: [op, engine, version, kind, bucket, key, numel, dtype]; reply: [status, info].
_BEGIN, _ITEM, _END = 1, 2, 3
_OK, _AHEAD, _NO_ENGINE, _LATE, _NOT_HELD, _BAD = 0, 1, 2, 3, 4, 5
_TAG_ASK, _TAG_REPLY, _TAG_DATA = 7301, 7302, 7303
#: ``kind`` of the model's weights; optimizer ``k`` (creation order) is ``1 + k``.
WEIGHTS = 0
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.int8, torch.bool]

_SERVERS: dict[tuple[int, ...], ShardServer] = {}


def key_code(key: str) -> int:
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def serves(engine: Engine) -> bool:
    """Whether ``engine``'s state dicts are served rather than gathered (see the Note)."""
    return getattr(engine, "server", None) is not None


def server_for(engine: Engine) -> ShardServer | None:
    """The server of ``engine``'s sharding group (made on its first model), None where
    state dicts stay collectives: one rank, NCCL or another backend, tensor parallelism.
    Collective over the group the first time (it makes a process group)."""
    comm = engine.comm
    if comm.size == 1 or engine.tp is not None:
        return None
    try:
        if str(dist.get_backend(comm.group)) != "gloo":
            return None
    except (RuntimeError, ValueError):
        return None
    key = tuple(comm.peers)
    server = _SERVERS.get(key)
    if server is None or not server.alive():
        server = _SERVERS[key] = ShardServer(comm.peers, whole_world=comm.group is None)
    return server


class ShardServer:
    """The serving thread and the asking side of one group of ranks (see the Note)."""

    def __init__(self, peers: list[int], whole_world: bool) -> None:
        self.peers = list(peers)
        self.group = (dist.new_group(backend="gloo") if whole_world else
                      dist.new_group(self.peers, backend="gloo",
                                     use_local_synchronization=True))
        self.rank = dist.get_rank()
        self._engines: dict[int, weakref.ref[Engine]] = {}
        self._optimizers: dict[tuple[int, int], Callable[[], Any]] = {}
        self._held: dict[tuple[int, int], Any] = {}  # (asker, engine) -> its clock
        self.served = 0  # requests answered (tests assert none arrive unasked)
        self._thread = threading.Thread(target=self._serve, name="zeroshard-shard-server",
                                        daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the group still works: a destroyed default group leaves it unusable
        (see comm_check._alive). Read alike on every rank — never the thread's own
        state — since a new server is a collective."""
        try:
            dist.get_process_group_ranks(self.group)
        except (RuntimeError, ValueError, KeyError):
            return False
        return True

    def register(self, engine: Engine) -> int:
        """Number an engine: every rank of the group shards its models in the same order."""
        number = len(self._engines)
        self._engines[number] = weakref.ref(engine)
        return number

    def register_optimizer(self, engine_id: int, state: Callable[[], Any]) -> int:
        """``state()``: the optimizer's torch-style ``state`` dict (by chunk)."""
        k = sum(1 for e, _ in self._optimizers if e == engine_id)
        self._optimizers[(engine_id, k)] = state
        return k

    # -- serving (the server thread) ----------------------------------------------------
    def _serve(self) -> None:
        head = torch.zeros(8, dtype=torch.int64)
        while True:
            try:
                src = dist.recv(head, src=None, group=self.group, tag=_TAG_ASK)
            except Exception:  # the group is gone (process group destroyed, peer exited)
                return
            self.served += 1
            try:
                self._answer(int(src), [int(v) for v in head.tolist()])
            except Exception:  # the asker has gone; its error is raised there
                self._held.pop((int(src), int(head[1])), None)

    def _reply(self, dst: int, status: int, info: int = 0) -> None:
        dist.send(torch.tensor([status, info], dtype=torch.int64), dst=dst, group=self.group,
                  tag=_TAG_REPLY)

    def _answer(self, src: int, head: list[int]) -> None:
        op, eid, version, kind, bucket, key, numel, dtype = head
        ref = self._engines.get(eid)
        engine = ref() if ref is not None else None
        if op == _END:
            clock = self._held.pop((src, eid), None)
            if clock is not None:
                clock.release()
                clock.read_by(src, version)
            return
        if engine is None:
            return self._reply(src, _NO_ENGINE)
        if op == _BEGIN:
            timeout = engine.comm.timeout or CHECK_TIMEOUT
            try:
                engine.clock.hold(version, timeout)
            except Ahead:
                return self._reply(src, _AHEAD, engine.clock.version)
            except TimeoutError:
                return self._reply(src, _LATE, engine.clock.version)
            self._held[(src, eid)] = engine.clock
            return self._reply(src, _OK)
        if (src, eid) not in self._held:
            return self._reply(src, _NOT_HELD)
        t = self._tensor(engine, eid, kind, bucket, key)
        if t is None or t.numel() != numel or _DTYPES.index(t.dtype) != dtype:
            return self._reply(src, _BAD, -1 if t is None else t.numel())
        self._reply(src, _OK)
        dist.send(t, dst=src, group=self.group, tag=_TAG_DATA)

    def _tensor(self, engine: Engine, eid: int, kind: int, bucket: int, key: int
                ) -> torch.Tensor | None:
        """This rank's shard the request names, contiguous, on the CPU."""
        from .chunks import bucket_state

        if not 0 <= bucket < len(engine.all_buckets):
            return None
        b = engine.all_buckets[bucket]
        if kind == WEIGHTS:
            t = b.master if b.master is not None else b.shard16
        else:
            state = self._optimizers.get((eid, kind - 1))
            if state is None:
                return None
            t = next((v for k, v in bucket_state(state(), b).items()
                      if key_code(k) == key and torch.is_tensor(v)), None)
        return None if t is None else t.detach().cpu().contiguous()

    # -- asking (the main thread) -------------------------------------------------------
    @contextmanager
    def session(self, engine: Engine, what: str) -> Iterator[Fetch]:
        """Hold every peer at this rank's version for the reads inside; ``what`` names
        the call in errors."""
        fetch = Fetch(self, engine, what)
        try:
            fetch.begin()
            yield fetch
        finally:
            fetch.end()


class Fetch:
    """One state dict's reads from the peers (see :meth:`ShardServer.session`)."""

    def __init__(self, server: ShardServer, engine: Engine, what: str) -> None:
        self.server = server
        self.engine = engine
        self.what = what
        self.eid: int = engine.server_id
        self.version = engine.clock.version
        self.timeout = engine.comm.timeout or CHECK_TIMEOUT
        self.others = [p for p in engine.comm.peers if p != server.rank]
        self._begun: list[int] = []

    def _ask(self, peer: int, op: int, kind: int = 0, bucket: int = 0, key: int = 0,
             numel: int = 0, dtype: int = 0) -> None:
        head = torch.tensor([op, self.eid, self.version, kind, bucket, key, numel, dtype],
                            dtype=torch.int64)
        self._wait(dist.isend(head, dst=peer, group=self.server.group, tag=_TAG_ASK), peer)

    def _wait(self, work: Any, peer: int) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise self._late(peer) from e
            raise CollectiveError(
                f"rank {self.server.rank} takes {self.what} and asked rank {peer} for its "
                f"shards, but rank {peer} is no longer running (it exited or crashed: "
                f"{str(e).splitlines()[0][:200]}). Its part of the state is lost with it: "
                "take state dicts while every rank is still in the job") from e
        if ok is False:
            raise self._late(peer)

    def _late(self, peer: int) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.server.rank} takes {self.what} and asked rank {peer} for its shards "
            f"of the state after step {self.version}; rank {peer} did not answer within "
            f"{self.timeout:g} s (timeout=): it is blocked somewhere it cannot finish that "
            "step, or has left the job. Raise timeout= if it is only slow")

    def _status(self, peer: int) -> tuple[int, int]:
        reply = torch.zeros(2, dtype=torch.int64)
        self._wait(dist.irecv(reply, src=peer, group=self.server.group, tag=_TAG_REPLY), peer)
        return int(reply[0]), int(reply[1])

    def begin(self) -> None:
        for peer in self.others:
            self._ask(peer, _BEGIN)
            self._begun.append(peer)
        for peer in self.others:
            status, info = self._status(peer)
            if status == _AHEAD:
                raise RuntimeError(
                    f"rank {self.server.rank} takes {self.what} alone at state version "
                    f"{self.version}, but rank {peer} has already stepped its optimizer "
                    f"past it (version {info}): the state dict was taken between "
                    "backward() and optimizer.step(), where another rank may have stepped "
                    "already. Take it after optimizer.step() (or on every rank)")
            if status == _LATE:
                raise self._late(peer)
            if status != _OK:
                raise RuntimeError(
                    f"rank {peer} does not know the model rank {self.server.rank} asks "
                    f"for in {self.what} (status {status}): were the models sharded in "
                    "the same order on every rank?")

    def end(self) -> None:
        if self._begun == self.others:
            self.engine.clock.asked()
        for peer in self._begun:
            try:
                self._ask(peer, _END)
            except Exception:  # the peer is gone; nothing is held there any more
                pass
        self._begun = []

    def gathered(self, b: FlatBucket, local: torch.Tensor, kind: int, key: str = ""
                 ) -> torch.Tensor:
        """Every rank's ``local`` shard of ``b`` in the gathered layout (``world`` rows of
        ``shard_numel``), on the CPU: this rank's copied, the others' read from them."""
        out = torch.empty(b.padded_numel, dtype=local.dtype)
        rows = out.view(b.world, b.shard_numel)
        rows[b.rank].copy_(local.reshape(-1))
        bucket = self.engine.all_buckets.index(b)
        code = _DTYPES.index(local.dtype)
        peers = self.engine.comm.peers
        asked = [q for q in range(b.world) if q != b.rank]
        for q in asked:
            self._ask(peers[q], _ITEM, kind, bucket, key_code(key), b.shard_numel, code)
        for q in asked:
            status, info = self._status(peers[q])
            if status != _OK:
                raise RuntimeError(
                    f"rank {peers[q]} could not serve its shard of bucket {b.name!r} "
                    f"({'weights' if kind == WEIGHTS else key}) for {self.what}: status "
                    f"{status}, {info} elements where {b.shard_numel} were expected")
            self._wait(dist.irecv(rows[q], src=peers[q], group=self.server.group,
                                  tag=_TAG_DATA), peers[q])
        return out
