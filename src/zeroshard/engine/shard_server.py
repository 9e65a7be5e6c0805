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

[Note: no waiting on askers]
A server answers one request at a time, and a blocking send completes only once the
receiver has posted its receive. So an asker posts the receives of a request's answer
(its status, and the data of an item) *before* sending the request, on tags of its own
for that request, and never waits for an END to be delivered (it is waited for at the
next state dict): a server then never waits on an asker, and askers waiting on servers
cannot form a cycle — before, three ranks each taking a state dict stalled, each one's
server sending a reply to an asker that was itself sending to another busy server. A
stale receive (a request that failed) cannot catch a later answer: each has its tags.

[Note: leaving together]
A rank that takes no state dict, or finished its own, may reach the end of its script
while a peer still reads from it — timm's last ``save_checkpoint`` runs on rank 0 alone
while the others go on to ``destroy_process_group()`` and exit; every rank taking
``model.state_dict()`` then exiting is the same race (a rank done reading may leave before
its peers have read from it). So (1) the server's group is made outside
torch.distributed's registry (a ``ProcessGroupGloo`` on a prefix of the default store),
so ``destroy_process_group()`` does not close it; and (2) at interpreter exit each rank
tells its peers it is leaving and serves on until each peer has said so too, has gone
(its connection closed), or nobody has read from it for ``LEAVE_IDLE_S`` — as torchrun's
ranks end together anyway. A rank still training while a peer exits (uneven data without
``join()``) thus learns of it up to ``LEAVE_IDLE_S`` later than before; a script ending
on an error does not wait at all. A process ended with ``os._exit`` or a signal skips (2), as it skips every
``atexit`` handler.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..comm_check import CHECK_TIMEOUT
from ..comm_wait import CollectiveError, CollectiveTimeout
from .state_clock import Ahead

if TYPE_CHECKING:
    from .flat import FlatBucket

#: The engine (engine.py imports this module, so it is not imported back, even for types).
Engine = Any

__all__ = ["ShardServer", "serves", "server_for", "key_code", "WEIGHTS"]

# Request: [op, engine, version, kind, bucket, key, numel, dtype, tag]; reply: [status,
# info] on ``tag``, data on ``tag + 1``. The asker posts both receives before it sends the
# request, so a server never waits on an asker (see [Note: no waiting on askers]).
_BEGIN, _ITEM, _END, _BYE = 1, 2, 3, 4
_OK, _AHEAD, _NO_ENGINE, _LATE, _NOT_HELD, _BAD, _FAILED = 0, 1, 2, 3, 4, 5, 6
_TAG_ASK, _TAG_FIRST = 7301, 1 << 16
#: ``kind`` of the model's weights; optimizer ``k`` (creation order) is ``1 + k``.
WEIGHTS = 0
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.int8, torch.bool]

_SERVERS: dict[tuple[int, ...], ShardServer] = {}  # by global ranks
#: Seconds an exiting rank serves on with nobody reading from it before it leaves without
#: its peers' goodbye ([Note: leaving together]).
LEAVE_IDLE_S = 10.0
_MADE: dict[tuple[int, ...], int] = {}  # servers made, by global ranks
_log = logging.getLogger("zeroshard")


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
    # One per group of ranks under one default group (a test harness re-creates that:
    # the old server's models are gone with it).
    key = tuple(comm.peers)
    server = _SERVERS.get(key)
    if server is None or server.world is not dist.GroupMember.WORLD:
        server = _SERVERS[key] = ShardServer(comm.peers)
        if len(_SERVERS) == 1:
            atexit.register(_leave_together)
    return server


def _leave_together() -> None:
    """At exit, wait for the peers to exit too ([Note: leaving together]) — not when the
    script ends on an error (its peers are to learn of it at once, by the connection)."""
    if getattr(sys, "last_value", None) is not None:
        return
    for server in list(_SERVERS.values()):
        server.leave()


class _Link:
    """Point-to-point messages over a gloo process group of the server's own, made
    outside torch.distributed's registry so that ``destroy_process_group()`` leaves it
    ([Note: leaving together]); ranks are global in and out."""

    def __init__(self, peers: list[int], number: int) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.peers = peers
        # ``number``: the servers this process made for these ranks before; a store kept
        # from an earlier default group must not hand this group its old addresses.
        store = dist.PrefixStore(
            f"zeroshard/shard-server/{','.join(map(str, peers))}/{number}/",
            c10d._get_default_store())
        self.pg = dist.ProcessGroupGloo(store, peers.index(dist.get_rank()), len(peers),
                                        timedelta(seconds=CHECK_TIMEOUT))

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self.pg.send([t], self.peers.index(dst), tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self.pg.recv([t], self.peers.index(src), tag)

    def recv_any(self, t: torch.Tensor, tag: int) -> int:
        work = self.pg.recv_anysource([t], tag)
        work.wait()
        return self.peers[work._source_rank()]


class ShardServer:
    """The serving thread and the asking side of one group of ranks (see the Note)."""

    def __init__(self, peers: list[int]) -> None:
        self.peers = list(peers)
        key = tuple(peers)
        self.world = dist.GroupMember.WORLD  # held: its identity tells a new default group
        _MADE[key] = _MADE.get(key, 0) + 1
        self.link = _Link(self.peers, _MADE[key])
        self.rank = dist.get_rank()
        self._left: set[int] = set()  # peers that said they are exiting
        self._last_ask = time.monotonic()  # when a request last arrived
        self._broken = False  # the link failed: a peer has gone
        self._engines: dict[int, weakref.ref[Engine]] = {}
        self._registered = threading.Condition()
        self._next = 0  # the next engine number this rank proposes
        self._pinned: dict[int, list[Any]] = {}  # held until every peer has read (pin)
        self._optimizers: dict[tuple[int, int], Any] = {}  # -> inner optimizer
        self._held: dict[tuple[int, int], Any] = {}  # (asker, engine) -> its clock
        self._tag = 0  # the request being answered: its reply's tag
        self._seq = 0  # the asking side's last request: tags of its own
        self._unsent: list[tuple[Any, torch.Tensor]] = []  # END messages in flight
        self.served: dict[int, int] = {}  # reads answered by state version (for tests)
        self._thread = threading.Thread(target=self._serve, name="zeroshard-shard-server",
                                        daemon=True)
        self._thread.start()

    def register(self, engine: Engine) -> int:
        """Number an engine, the same number on every rank of its group: the largest of
        the ranks' next numbers (a collective over the group, at shard time). Counting
        alone is not enough — a process that sharded a model its peers did not (a test
        harness's reused ranks, a model sharded on some ranks only) would number the next
        one differently, and be asked for another model's shards."""
        proposal = torch.tensor([self._next], dtype=torch.int64)
        dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=engine.comm.group)
        number = int(proposal)
        with self._registered:
            self._next = number + 1
            self._engines[number] = weakref.ref(engine)
            self._registered.notify_all()
        # a pin holds one version: once the shards change, no peer may read it any more
        engine.clock.changed = lambda: self._pinned.pop(number, None)
        return number

    def _engine(self, eid: int, wait: float) -> Engine | None:
        """Engine ``eid``, waiting up to ``wait`` seconds for this rank to finish sharding
        it (a peer done with shard() may ask before this rank has registered it)."""
        with self._registered:
            self._registered.wait_for(lambda: eid in self._engines, timeout=wait)
            ref = self._engines.get(eid)
        return ref() if ref is not None else None

    def register_optimizer(self, engine_id: int, optimizer: Any) -> int:
        """A ShardedOptimizer of engine ``engine_id``: its number within the engine. Its
        inner optimizer (the shards' state) is held for as long as the engine lives, not
        the ShardedOptimizer: a script that returns from its main() drops the optimizer
        at once (no cycle) while a peer may still read it (timm's last checkpoint on rank
        0 alone); the engine, in a cycle, lives to the end, and its end releases it."""
        k = sum(1 for e, _ in self._optimizers if e == engine_id)
        self._optimizers[(engine_id, k)] = optimizer.optim
        if k == 0:
            engine = self._engines[engine_id]()
            if engine is not None:
                weakref.finalize(engine, self._forget, engine_id)
        return k

    def _forget(self, engine_id: int) -> None:
        for key in [key for key in self._optimizers if key[0] == engine_id]:
            self._optimizers.pop(key, None)

    def pin(self, engine: Engine) -> None:
        """After this rank's own state dict (main thread): keep the model and its
        optimizers alive until every peer has read this version too — a rank done first
        may drop them (its function returns, its script ends) while a slower peer still
        reads from it. Released once the last peer's read ends."""
        eid = engine.server_id
        with self._registered:
            if engine.clock.all_read():
                return
            self._pinned[eid] = [engine]

    # -- serving (the server thread) ----------------------------------------------------
    def _serve(self) -> None:
        head = torch.zeros(9, dtype=torch.int64)
        while True:
            try:
                src = self.link.recv_any(head, _TAG_ASK)
            except Exception:  # a peer has gone (its process ended): nothing to serve
                with self._registered:
                    self._broken = True
                    self._registered.notify_all()
                return
            ask = [int(v) for v in head.tolist()]
            self._last_ask = time.monotonic()
            if ask[0] in (_BEGIN, _ITEM):  # reads asked for (not goodbyes), by version
                self.served[ask[2]] = self.served.get(ask[2], 0) + 1
            try:
                self._answer(int(src), ask)
            except Exception as e:  # never leave the asker waiting for its timeout
                self._failed(int(src), ask, e)
            if self._left >= set(self.peers) - {self.rank}:
                # Every peer is exiting: nobody will ask again. End here, not blocked in
                # a receive that a peer's exit would wake during this interpreter's
                # shutdown (a thread woken then aborts the process: SIGABRT, seen at
                # stages 2-3 in timm's trial, pytorch/pytorch#38228).
                return

    def _failed(self, src: int, ask: list[int], error: Exception) -> None:
        clock = self._held.pop((src, ask[1]), None)
        if clock is not None:
            clock.release()
        _log.error("zeroshard: rank %d could not serve rank %d's state-dict request %s: %r",
                   self.rank, src, ask, error)
        if ask[0] != _END:
            try:
                self._reply(src, _FAILED)
            except Exception:  # the asker has gone; its own error says so
                pass

    def _reply(self, dst: int, status: int, info: int = 0) -> None:
        self.link.isend(torch.tensor([status, info], dtype=torch.int64), dst,
                        self._tag).wait()

    def _answer(self, src: int, head: list[int]) -> None:
        op, eid, version, kind, bucket, key, numel, dtype, self._tag = head
        engine = self._engine(eid, CHECK_TIMEOUT if op == _BEGIN else 0.0)
        if op == _BYE:
            with self._registered:
                self._left.add(src)
                self._registered.notify_all()
            return
        if op == _END:
            clock = self._held.pop((src, eid), None)
            if clock is not None:
                clock.release()
                clock.read_by(src, version)
                with self._registered:
                    if clock.all_read():
                        self._pinned.pop(eid, None)
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
        self.link.isend(t, src, self._tag + 1).wait()

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
            inner = self._optimizers.get((eid, kind - 1))
            if inner is None:
                return None
            t = next((v for k, v in bucket_state(inner.state, b).items()
                      if key_code(k) == key and torch.is_tensor(v)), None)
        return None if t is None else t.detach().cpu().contiguous()

    def flush(self, timeout: float) -> None:
        """Wait for the END messages of earlier state dicts (main thread)."""
        unsent, self._unsent = self._unsent, []
        for sent, _ in unsent:
            try:
                sent.wait(timedelta(seconds=timeout))
            except Exception:  # that peer has gone: nothing is held there any more
                pass

    def leave(self) -> None:
        """Say this rank is exiting, then serve on until every peer has said so (or has
        gone, or nobody has read from it for ``LEAVE_IDLE_S``): see [Note: leaving
        together]."""
        others = [p for p in self.peers if p != self.rank]
        head = torch.tensor([_BYE, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
        for peer in others:
            try:
                self.link.isend(head, peer, _TAG_ASK).wait(timedelta(seconds=CHECK_TIMEOUT))
            except Exception:  # gone already
                pass
        with self._registered:
            while not (self._broken or self._left >= set(others)):
                idle = time.monotonic() - self._last_ask
                if not self._held and idle > LEAVE_IDLE_S:
                    return  # nobody reading, nobody asking: the peers train on
                self._registered.wait(timeout=0.5)
        self._thread.join(timeout=5.0)  # it ends after the last goodbye (see _serve)

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
             numel: int = 0, dtype: int = 0, into: torch.Tensor | None = None
             ) -> tuple[Any, torch.Tensor, Any, Any]:
        """Send a request, its answer's receives posted first (status, and ``into``'s
        data): (the send, the status buffer, its receive, the data's receive)."""
        server = self.server
        server._seq = (server._seq + 2) % (1 << 30)
        tag = _TAG_FIRST + server._seq
        reply = torch.zeros(2, dtype=torch.int64)
        head = torch.tensor([op, self.eid, self.version, kind, bucket, key, numel, dtype,
                             tag], dtype=torch.int64)
        try:
            status = server.link.irecv(reply, peer, tag) if op != _END else None
            data = server.link.irecv(into, peer, tag + 1) if into is not None else None
            return server.link.isend(head, peer, _TAG_ASK), reply, status, data
        except Exception as e:  # the connection is closed already
            raise self._gone(peer, e) from e

    def _wait(self, work: Any, peer: int) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise self._late(peer) from e
            raise self._gone(peer, e) from e
        if ok is False:
            raise self._late(peer)

    def _gone(self, peer: int, e: Exception) -> CollectiveError:
        return CollectiveError(
            f"rank {self.server.rank} takes {self.what} and asked rank {peer} for its "
            f"shards, but rank {peer} is no longer running (it exited or crashed: "
            f"{str(e).splitlines()[0][:200]}). Its part of the state is lost with it: "
            "take state dicts while every rank is still in the job")

    def _late(self, peer: int) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.server.rank} takes {self.what} and asked rank {peer} for its shards "
            f"of the state after step {self.version}; rank {peer} did not answer within "
            f"{self.timeout:g} s (timeout=): it is blocked somewhere it cannot finish that "
            "step, or has left the job. Raise timeout= if it is only slow")

    def _status(self, peer: int, asked: tuple[Any, torch.Tensor, Any, Any]
                ) -> tuple[int, int]:
        sent, reply, status, _ = asked
        self._wait(status, peer)
        self._wait(sent, peer)
        return int(reply[0]), int(reply[1])

    def begin(self) -> None:
        self.server.flush(self.timeout)
        asked = {}
        for peer in self.others:
            asked[peer] = self._ask(peer, _BEGIN)
            self._begun.append(peer)
        for peer in self.others:
            status, info = self._status(peer, asked[peer])
            if status == _AHEAD:
                raise RuntimeError(
                    f"rank {self.server.rank} takes {self.what} alone at state version "
                    f"{self.version}, but rank {peer} has already stepped its optimizer "
                    f"past it (version {info}): the state dict was taken between "
                    "backward() and optimizer.step(), where another rank may have stepped "
                    "already. Take it after optimizer.step() (or on every rank)")
            if status == _LATE:
                raise self._late(peer)
            if status == _FAILED:
                raise RuntimeError(f"rank {peer} failed to serve {self.what}: its log "
                                   "says why (zeroshard: rank ... could not serve ...)")
            if status != _OK:
                raise RuntimeError(
                    f"rank {peer} does not know the model rank {self.server.rank} asks "
                    f"for in {self.what} (status {status}): were the models sharded in "
                    "the same order on every rank?")

    def end(self) -> None:
        if self._begun == self.others:
            self.engine.clock.asked()
            self.server.pin(self.engine)
        for peer in self._begun:  # not waited for here: see [Note: no waiting on askers]
            try:
                sent, head, _, _ = self._ask(peer, _END)
                self.server._unsent.append((sent, head))
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
        asked = {q: self._ask(peers[q], _ITEM, kind, bucket, key_code(key), b.shard_numel,
                              code, into=rows[q])
                 for q in range(b.world) if q != b.rank}
        for q, ask in asked.items():
            status, info = self._status(peers[q], ask)
            if status != _OK:  # _FAILED: the peer's log says why
                raise RuntimeError(
                    f"rank {peers[q]} could not serve its shard of bucket {b.name!r} "
                    f"({'weights' if kind == WEIGHTS else key}) for {self.what}: status "
                    f"{status}, {info} elements where {b.shard_numel} were expected")
            self._wait(ask[3], peers[q])
        return out
