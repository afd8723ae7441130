"""torch.distributed collectives between session workers: the server side of genie's c10d backend.

A client process whose tensors live on a remote device runs ``dist.all_reduce(t)`` through
:mod:`genie.distributed`; the data moves between the session workers that hold the tensors,
over a ``ProcessGroupGloo`` those workers form among themselves (NCCL among GPU servers is not
built: see docs/multi-gpu.md), never through the clients. The commands (codes in
:mod:`genie.wire.messages`):

- ``[CMD_DIST_HOST, req, group_id]`` (rank 0's session only): start the group's store
  (:class:`~genie.server.rendezvous.StoreServer`) on this node's bind address; replies ``{"port"}``.
- ``[CMD_DIST_JOIN, device, group_id, rank, world_size, store_node, store_port, nodes, timeout_s]``
  (fire-and-forget): join group ``group_id`` as ``rank``. The store's host is the address the
  cluster's membership gives for node ``store_node``, asked of this node (never an address from
  the client); gloo binds to this node's own address from the same membership
  (``GLOO_SOCKET_IFNAME`` overrides). ``nodes`` names each rank's node, for error messages.
  The group forms on the group's thread, off the session's command thread.
- ``[CMD_COLLECTIVE, device, group_id, seq, kind, tensors, params]`` (fire-and-forget): start
  collective ``seq`` (consecutive per group from 1) on the described tensors. Kinds and their
  ``tensors``: ``all_reduce`` ``[t, ...]`` ``{"op"}``; ``broadcast`` ``[t, ...]`` ``{"root"}``;
  ``all_gather`` ``[[out, ...], input]``; ``all_gather_into`` ``[out, input]``; ``reduce_scatter``
  ``[out, [input, ...]]`` ``{"op"}``; ``reduce_scatter_tensor`` ``[out, input]`` ``{"op"}``;
  ``barrier`` ``[]``; ``send``/``recv`` ``[t, ...]`` ``{"peer", "tag"}``; ``reduce`` ``[t]``
  ``{"op", "root"}``; ``gather`` ``[[out, ...], input]`` ``{"root"}`` (the output list empty except on
  the root); ``scatter`` ``[out, [input, ...]]`` ``{"root"}`` (the input list empty except on the
  root); ``all_to_all_single`` ``[out, input]`` ``{"out_splits", "in_splits"}`` (row counts per rank,
  or ``[]`` for equal parts); ``all_to_all`` ``[[out, ...], [input, ...]]`` (any sizes, as NCCL's: it
  runs as one all_to_all_single of the tensors laid end to end). ``op`` is one of
  ``sum avg max min product``. Every list of one tensor per rank holds exactly world-size tensors of
  one dtype; gather's and scatter's hold the element count of the rank's own tensor; split sizes add up
  to their tensor's rows. Collectives reach gloo in ``seq`` order (gloo runs them on its own
  threads): the command thread starts one itself once the group has formed and nothing is queued
  before it, else the group's thread does; the command thread goes on with the commands after it.
- ``[CMD_DIST_WAIT, req, group_id, seq, budget_s]``: with a request id, waits at most ``budget_s``
  for collective ``seq`` and replies ``None`` (done), ``{"pending": true}`` (ask again) or
  ``{"error", "node"}`` (failed; ``node`` names the lost peer's node where one is known). With
  ``req`` None it is part of the op stream: later commands run after the collective ended, and
  a failure is a deferred error of kind ``lost`` (what a work handle's future needs).
- ``[CMD_DIST_LEAVE, group_id]``: drop the group (its store, its gloo connections).

A peer lost mid-collective (its node killed: gloo's connection resets) fails the collective at
once; a peer that stops answering fails it at the group's timeout (the process group's
``timeout``), so nothing waits for ever.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from genie.errors import FrameError, GenieError, ProtocolError, QuotaExceededError
from genie.server.codec import is_int
from genie.server.collective_kinds import starter
from genie.server.per_session import PerSession
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.rendezvous import AuthStore, StoreServer
from genie.wire.messages import CMD_COLLECTIVE, CMD_DIST_HOST, CMD_DIST_JOIN, CMD_DIST_LEAVE, CMD_DIST_WAIT

if TYPE_CHECKING:
    from genie.server.executor import Executor

log = logging.getLogger("genie.server.collectives")

#: Most groups one session may be in, ranks in a group, collectives started but not yet waited for.
MAX_GROUPS = 64
MAX_WORLD = 4096
MAX_PENDING = 4096
#: Longest group timeout a client may ask for (seconds).
MAX_TIMEOUT = 3600.0
#: How long a node's membership may take to learn of the store's node (a node that joined a moment ago).
RESOLVE_WAIT = 30.0



# -- what a session worker asks its node (the node answers: genie.server.node_answers) -----------------

class NodeLink:
    """A session worker's questions to its node over the control pipe (``send``: the worker's sender)."""

    def __init__(self, send: Callable[[list[Any]], None], bind_host: str) -> None:
        self._send = send
        self.bind_host = bind_host
        self._answers: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._seq = 0

    def answered(self, seq: Any, value: Any) -> None:
        """The node answered question ``seq`` (the worker's control thread calls this)."""
        with self._cond:
            self._answers[seq] = value
            self._cond.notify_all()

    def ask(self, what: str, arg: Any, timeout: float = 10.0) -> Any:
        """Ask the node; its answer (GenieError when none comes within ``timeout``)."""
        with self._cond:
            self._seq += 1
            seq = self._seq
        self._send(["dist", seq, what, arg])
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._answers, timeout):
                raise GenieError(f"this node did not answer a session worker's {what} question within {timeout:g} s")
            return self._answers.pop(seq)


#: The worker's link to its node (genie.server.isolation.worker sets it); None with sessions in the node.
node_link: NodeLink | None = None


def _link() -> NodeLink:
    if node_link is None:
        raise ProtocolError("torch.distributed on remote devices needs session workers (isolation = process): "
                            "this node runs sessions in its own process")
    return node_link


def _address_of(node_id: str, deadline: float) -> str:
    """The address the membership gives for ``node_id``, waiting a while for a node that joined just now."""
    link = _link()
    while True:
        address = link.ask("address", node_id)
        if isinstance(address, str) and address:
            return address
        if time.monotonic() > deadline:
            raise ProtocolError(f"node {node_id!r:.80} is not a member of this cluster (or not yet known to this "
                                "node); a process group's store must live on one of the cluster's nodes")
        time.sleep(0.2)  # not a wait on a test: the membership learns of new nodes at heartbeats


# -- groups ------------------------------------------------------------------------------------------------

class Job:
    """One collective of a group: started in order by the group's thread, finished by whoever waits."""

    def __init__(self, seq: int, kind: str, label: str, start: Callable[[Any], Any], outputs: list[torch.Tensor],
                 after: Callable[[], None] | None = None):
        self.seq = seq
        self._after = after
        self.kind = kind
        self.label = label
        self._start = start
        self.outputs = outputs  # keeps the tensors alive (their storages may be freed by the client meanwhile)
        self.done = threading.Event()
        self.error: str | None = None
        self.lost_node: str | None = None

    def run(self, group: ServerGroup) -> None:
        """Start the collective on ``group``'s gloo (the group's thread); ``done`` is set when it ends."""
        if group.failure is not None:
            self.error = f"{self.label} cannot run: {group.failure}"
            self.done.set()
            return
        try:
            work = self._start(group.pg)
        except Exception as exc:  # gloo refuses it (a dtype, a layout, a size): nothing was sent
            self.error = f"{self.label} was refused by gloo: {_message(exc)}"
            self.outputs = []
            self.done.set()
            return
        if self.kind in ("send", "recv"):
            # gloo's send and recv complete their future only inside wait(): a thread waits for them.
            threading.Thread(target=lambda: self._finish(group, _waited(work)), name="genie-dist-p2p",
                             daemon=True).start()
            return
        future = work.get_future()
        # The callback runs inside gloo's completion (the work's lock held): it reads the future's outcome,
        # never work.wait(), which would take that lock again.
        future.add_done_callback(lambda f: self._finish(group, _outcome(f)))

    def _finish(self, group: ServerGroup, exc: BaseException | None) -> None:
        if exc is None and self._after is not None:
            try:
                self._after()
            except Exception as failed:  # a copy out of the staging tensor
                self.error = f"{self.label} failed on this node: {_message(failed)}"
        if exc is not None:
            self.error, self.lost_node = group.describe_failure(self.label, exc)
        self.outputs = []
        self.done.set()


def _waited(work: Any) -> BaseException | None:
    """The exception ``work.wait()`` raised, or None once it returned."""
    try:
        work.wait()
    except Exception as exc:
        return exc
    return None


def _outcome(future: Any) -> BaseException | None:
    """The exception a completed future holds, or None."""
    try:
        future.value()
    except Exception as exc:
        return exc
    return None


class ServerGroup:
    """One session's membership of a process group: its gloo group, formed and fed on its own thread."""

    def __init__(self, group_id: int, rank: int, world: int, nodes: list[str], timeout: float,
                 store_node: str, store_port: int) -> None:
        self.group_id = group_id
        self.rank = rank
        self.world = world
        self.nodes = nodes
        self.timeout = timeout
        self.pg: Any = None
        self.failure: str | None = None
        self.jobs: dict[int, Job] = {}
        self.next_seq = 1
        self._queue: deque[Job | None] = deque()
        self._cond = threading.Condition()
        self._formed = False  #: pg or failure is set: a job may start on the submitting thread
        self._running = False  #: the group's thread is starting a job it took from the queue
        self.started_here = 0  #: jobs started on the submitting (command) thread, for tests and benchmarks
        self._thread = threading.Thread(target=self._run, args=(store_node, store_port),
                                        name=f"genie-dist-{group_id}", daemon=True)
        self._thread.start()

    def label(self, seq: int, kind: str) -> str:
        return f"{kind} #{seq} of process group {self.group_id} (rank {self.rank} of {self.world})"

    def submit(self, job: Job) -> None:
        """Start ``job`` after every job submitted before it.

        Once the group has formed and its thread has nothing queued or starting, the job starts here, on the
        session's command thread: starting a gloo collective only hands it to gloo's threads, and a hand-over
        to the group's thread first cost a thread wake-up per collective (0.2 ms idle, several ms on a busy
        2-core host, measured per DDP step). Only the command thread submits, so nothing queues behind it
        meanwhile.
        """
        with self._cond:
            self.jobs[job.seq] = job
            self.next_seq = job.seq + 1
            here = self._formed and not self._queue and not self._running
            if not here:
                self._queue.append(job)
                self._cond.notify()
                return
            self.started_here += 1
        job.run(self)

    def close(self) -> None:
        """Stop the thread after what it started; gloo's connections close with the group."""
        with self._cond:
            self._formed = False  # nothing starts on a group being dropped
            self._queue.append(None)
            self._cond.notify()

    def describe_failure(self, label: str, exc: BaseException) -> tuple[str, str | None]:
        """(message, the lost peer's node or None) for a collective that failed with ``exc``."""
        text = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
        others = [n for r, n in enumerate(self.nodes) if r != self.rank]
        node = others[0] if len(set(others)) == 1 else None
        peers = f"node {node!r}" if node else "one of nodes " + ", ".join(repr(n) for n in sorted(set(others)))
        return (f"{label} failed: its peer on {peers} is gone (that node was lost, or its session ended) or did not "
                f"answer within the group's timeout of {self.timeout:g} s: {text}"), node

    def _run(self, store_node: str, store_port: int) -> None:
        try:
            pg = self._form(store_node, store_port)
        except Exception as exc:
            pg = None
            self.failure = (f"process group {self.group_id} could not form (rank {self.rank} of {self.world}): "
                            f"{_message(exc)}")
            log.warning("%s", self.failure)
        with self._cond:
            self.pg = pg
            self._formed = True
        while True:
            with self._cond:
                self._running = False
                self._cond.wait_for(lambda: bool(self._queue))
                job = self._queue.popleft()
                self._running = job is not None
            if job is None:
                break
            job.run(self)
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # the group is being dropped either way
                log.debug("aborting process group %d failed", self.group_id, exc_info=True)

    def _form(self, store_node: str, store_port: int) -> Any:
        deadline = time.monotonic() + min(self.timeout, RESOLVE_WAIT)
        link = _link()
        store_host = _address_of(store_node, deadline)
        secret = link.ask("secret", self.group_id)
        if not isinstance(secret, bytes):
            raise ProtocolError("this node gave no group secret")
        store = AuthStore(store_host, store_port, secret, self.timeout)
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
        if interface:
            device = dist.ProcessGroupGloo.create_device(interface=interface)
        else:
            device = dist.ProcessGroupGloo.create_device(hostname=_address_of(self.nodes[self.rank], deadline))
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [device]
        options._timeout = datetime.timedelta(seconds=self.timeout)
        return dist.ProcessGroupGloo(store, self.rank, self.world, options)


class SessionGroups:
    """The process groups of one session, and the stores it hosts, by group id."""

    def __init__(self) -> None:
        self.groups: dict[int, ServerGroup] = {}
        self.stores: dict[int, StoreServer] = {}

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        for store in self.stores.values():
            store.close()
        self.groups.clear()
        self.stores.clear()


_sessions: PerSession[SessionGroups] = PerSession(SessionGroups, SessionGroups.close)


def session_groups(executor: Executor) -> SessionGroups:
    """The groups of ``executor``'s session (made on first use; closed when the executor goes)."""
    return _sessions.get(executor)


def close_session(executor: Executor) -> None:
    """Drop every group and store of a session that ended."""
    groups = _sessions.pop(executor)
    if groups is not None:
        groups.close()


def _group_id(value: Any) -> int:
    if not is_int(value) or not 0 < value < (1 << 63):
        raise FrameError(f"a process group id must be an integer from 1 to 2**63-1, got {value!r:.40}")
    return int(value)


# -- commands ---------------------------------------------------------------------------------------------

def _host(ex: Executor, cmd: list[Any]) -> None:
    if len(cmd) != 3:
        raise FrameError("DIST_HOST must be [CMD_DIST_HOST, req, group_id]")
    req, group_id = cmd[1], _group_id(cmd[2])
    error, result = None, None
    try:
        groups = session_groups(ex)
        if group_id in groups.stores:
            raise ProtocolError(f"this session hosts process group {group_id}'s store already")
        if len(groups.stores) >= MAX_GROUPS:
            raise QuotaExceededError(f"a session may host at most {MAX_GROUPS} process group stores")
        link = _link()
        secret = link.ask("secret", group_id)
        if not isinstance(secret, bytes):
            raise ProtocolError("this node gave no group secret")
        store = groups.stores[group_id] = StoreServer(link.bind_host, secret)
        result = {"port": store.port}
    except (GenieError, OSError) as exc:
        error = _error(f"process group {group_id}", [], _kind_of(exc), _message(exc))
    ex.reply(req, error, result)


def _join(ex: Executor, cmd: list[Any]) -> None:
    if len(cmd) != 9 or not isinstance(cmd[7], list):
        raise FrameError("DIST_JOIN must be [CMD_DIST_JOIN, device, group_id, rank, world_size, store_node, "
                         "store_port, nodes, timeout_s]")
    _, device, group_id, rank, world, store_node, store_port, nodes, timeout = cmd
    group_id = _group_id(group_id)
    label = f"process group {group_id}"
    try:
        ex.begin(device)
        if not is_int(world) or not 1 <= world <= MAX_WORLD or not is_int(rank) or not 0 <= rank < world:
            raise ProtocolError(f"rank {rank!r:.20} of a world of {world!r:.20} ranks (at most {MAX_WORLD})")
        if len(nodes) != world or not all(isinstance(n, str) and len(n) <= 200 for n in nodes):
            raise ProtocolError("nodes must name each rank's node")
        if not isinstance(store_node, str) or not is_int(store_port) or not 0 < store_port < 65536:
            raise ProtocolError("the store must be a node id and a port")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
            raise ProtocolError(f"a group timeout must be between 0 and {MAX_TIMEOUT:g} s")
        groups = session_groups(ex)
        if group_id in groups.groups:
            raise ProtocolError(f"this session is in {label} already")
        if len(groups.groups) >= MAX_GROUPS:
            raise QuotaExceededError(f"a session may be in at most {MAX_GROUPS} process groups")
        groups.groups[group_id] = ServerGroup(group_id, rank, world, list(nodes), float(timeout), store_node,
                                              store_port)
    except GenieError as exc:
        ex.defer(_error(label, [], _kind_of(exc), _message(exc)))


def _collective(ex: Executor, cmd: list[Any]) -> None:
    if len(cmd) != 7 or not isinstance(cmd[5], list) or not isinstance(cmd[6], dict):
        raise FrameError("COLLECTIVE must be [CMD_COLLECTIVE, device, group_id, seq, kind, tensors, params]")
    _, device, group_id, seq, kind, tensors, params = cmd
    group = session_groups(ex).groups.get(_group_id(group_id))
    label = f"{kind!r:.40} #{seq!r:.20} of process group {group_id}"
    try:
        if group is None:
            raise ProtocolError(f"this session is not in process group {group_id}; send CMD_DIST_JOIN first")
        if not is_int(seq) or seq != group.next_seq:
            raise ProtocolError(f"collective #{seq!r:.20} of process group {group_id} is out of order; "
                                f"#{group.next_seq} is next")
        label = group.label(seq, str(kind))
        if sum(not j.done.is_set() for j in group.jobs.values()) >= MAX_PENDING:
            raise QuotaExceededError(f"{MAX_PENDING} collectives of process group {group_id} are running; wait "
                                     "for some (their work handles) before starting more")
        ex.begin(device)
        start, outputs, after = starter(str(kind), ex.resolve_values(tensors, device), params, group.world, group.rank)
    except (GenieError, RuntimeError) as exc:
        ex.defer(_error(label, [], _kind_of(exc), _message(exc)))
        if group is not None and is_int(seq) and seq == group.next_seq:
            failed = Job(seq, str(kind), label, lambda pg: None, [])
            failed.error = f"{label} was refused: {_message(exc)}"
            failed.done.set()
            group.jobs[seq] = failed
            group.next_seq = seq + 1
        return
    _forget_finished(group)
    group.submit(Job(seq, str(kind), label, start, outputs, after))


def _forget_finished(group: ServerGroup) -> None:
    """Jobs nobody waits for (a handle dropped unwaited) are forgotten once finished, past a bound."""
    if len(group.jobs) > MAX_PENDING:
        for seq in [s for s, j in group.jobs.items() if j.done.is_set()][: len(group.jobs) - MAX_PENDING]:
            del group.jobs[seq]


def _wait(ex: Executor, cmd: list[Any]) -> None:
    if len(cmd) != 5 or not isinstance(cmd[4], (int, float)):
        raise FrameError("DIST_WAIT must be [CMD_DIST_WAIT, req, group_id, seq, budget_s]")
    _, req, group_id, seq, budget = cmd
    group = session_groups(ex).groups.get(_group_id(group_id))
    job = group.jobs.get(seq) if group is not None and is_int(seq) else None
    if req is None:  # the op stream waits: what comes after runs after the collective
        if job is not None:
            if not job.done.wait(group.timeout + 5.0 if group is not None else 0.0):
                ex.defer(_error(job.label, [], "lost", f"{job.label} did not end within the group's timeout"))
            elif job.error is not None:
                ex.defer(_error(job.label, [], "lost", job.error))
            group.jobs.pop(seq, None)  # type: ignore[union-attr]
        return
    if group is None or job is None:  # waited for already (a future's stream wait), or never started here
        known = group is not None and is_int(seq) and 0 < seq < group.next_seq
        result = None if known else {"error": f"collective #{seq!r:.20} of process group {group_id} is unknown "
                                              "to this session", "node": None}
        ex.reply(req, None, result)
        return
    if not job.done.wait(max(0.0, min(float(budget), 60.0))):
        ex.reply(req, None, {"pending": True})
        return
    group.jobs.pop(seq, None)
    ex.reply(req, None, None if job.error is None else {"error": job.error, "node": job.lost_node})


def _leave(ex: Executor, cmd: list[Any]) -> None:
    if len(cmd) != 2:
        raise FrameError("DIST_LEAVE must be [CMD_DIST_LEAVE, group_id]")
    groups = session_groups(ex)
    group_id = _group_id(cmd[1])
    group = groups.groups.pop(group_id, None)
    if group is not None:
        group.close()
    store = groups.stores.pop(group_id, None)
    if store is not None:
        store.close()


#: The commands of this module by code: genie.server.commands lists them in the session's command table.
HANDLERS: dict[int, Callable[[Executor, list[Any]], None]] = {
    CMD_DIST_HOST: _host,
    CMD_DIST_JOIN: _join,
    CMD_COLLECTIVE: _collective,
    CMD_DIST_WAIT: _wait,
    CMD_DIST_LEAVE: _leave,
}
