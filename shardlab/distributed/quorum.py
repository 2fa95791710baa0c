"""Replica quorums for live recovery (``train.fault_tolerance = "replica"``; docs/faults.md).

A job of R replica groups of K ranks each. Inside a replica the ranks form an ordinary
torch.distributed world of K (its own store, its own groups: any layout). Across replicas,
everything goes through one TCPStore that the launcher hosts (``launch_replicas.py``), and a
:class:`Lighthouse` in the launcher process that alone decides:

* **quorums** -- which replicas take part in the next step. A replica's local rank 0 asks
  (``req/<r>``: its step, whether it has finished); the lighthouse answers every asking replica
  (``resp/<r>/<gen>/<n>``, read by all K ranks of the replica) once every *active* replica asks,
  or ``JOIN_WAIT * timeout_s`` after the first asked (a hung replica is left out). A member behind the most
  advanced step is healed from a member at that step (``heal``: {joiner: source}). A request that
  cannot be answered with a quorum by then (the job's first start, finished replicas waiting for
  a replacement) is answered "ask again" (``retry``), so that no rank waits without a deadline.
* **decisions** -- every rank votes on each phase of a quorum (``vote/<q>/<phase>/<r>/<i>``:
  ok, fingerprint); the lighthouse writes one ``dec/<q>/<phase>``: ``commit`` (all voted ok and
  the fingerprints of each local index agree), ``diverged`` (they do not), ``abort`` (a vote
  says failed, a member died, or -- a safety net -- a vote is missing long after). One decider, so no two
  replicas can decide differently.

Cross-replica collectives use a fresh gloo group per quorum *configuration* (members and their
generations; a new one also after any abort): ``ProcessGroupGloo(PrefixStore("pg/<cfg>/<i>",
store), position, members)``, built by the survivors without touching their replica's own
groups -- as torchft reconfigures its gloo group over a fresh store prefix for every quorum.
"""
from __future__ import annotations

import datetime
import json
import threading
import time

import torch
import torch.distributed as dist

JOIN_WAIT = 4
"""A quorum waits for every active replica (one whose rank died or went silent is dropped by the
launcher within ``timeout_s``) at most ``JOIN_WAIT * timeout_s`` after the first one asked."""
VOTE_WAIT = 100
"""A phase is aborted when a vote is still missing ``VOTE_WAIT * timeout_s`` after it opened. Not the
failure detector (a step may compute for long): a member that dies or stops is dropped by the
launcher (exit status, heartbeat older than ``timeout_s``), which aborts its open phases at once."""
HEARTBEAT_S = 0.2
"""How often every rank writes its heartbeat (``hb/<r>/<i>``: generation and wall time)."""
ANSWER_WAIT = 2 * JOIN_WAIT
"""A rank waits at most ``ANSWER_WAIT * timeout_s + SLACK_S`` for the lighthouse's answer to its
request (it answers within ``JOIN_WAIT * timeout_s``, a quorum or "ask again"); past it the rank
fails with :class:`QuorumTimeout` (the launcher is gone or stuck) and its replica is replaced."""
DECISION_WAIT = VOTE_WAIT + 2 * JOIN_WAIT
"""A rank waits at most ``DECISION_WAIT * timeout_s + SLACK_S`` for a decision on its vote (the
lighthouse's own safety net aborts a phase after ``VOTE_WAIT * timeout_s``)."""
SLACK_S = 10.0
"""Seconds added to the ranks' waits for the lighthouse: a loaded machine's scheduling delays."""


def connect(port: int, timeout_s: float, host: str = "127.0.0.1"):
    """A client of the launcher's TCPStore, under the ``ft/`` prefix."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=max(timeout_s, 30.0)))
    return dist.PrefixStore("ft/", store)


class QuorumFailed(RuntimeError):
    """A cross-replica phase failed (a peer died, a timeout): the step is retried in a new quorum."""


class QuorumTimeout(RuntimeError):
    """The lighthouse did not answer in time (launcher gone or stuck): this rank fails."""


class Diverged(RuntimeError):
    """Replicas that should be bit-identical are not (fingerprints differ): the run stops."""


class Member:
    """One rank's side of the protocol: replica ``replica`` (generation ``gen``), local rank
    ``local`` of ``n_local``; ``port``: the launcher's TCPStore."""

    def __init__(self, port: int, replica: int, gen: int, local: int, n_local: int, timeout_s: float):
        store = connect(port, timeout_s)
        self.store, self.replica, self.gen, self.local, self.n_local = store, replica, gen, local, n_local
        self.timeout_s, self.n = timeout_s, 0
        self._pg, self._pg_cfg = None, None
        self._stop = threading.Event()
        # its own client: a TCPStore client is not safe to share between threads
        self._hb = threading.Thread(target=self._beat, args=(connect(port, timeout_s),), name="shardlab-ft-heartbeat",
                                    daemon=True)
        self._hb.start()

    def _beat(self, store) -> None:
        key = f"hb/{self.replica}/{self.local}"
        while not self._stop.is_set():
            try:
                store.set(key, f"{self.gen}:{time.time()}")
            except Exception:  # the launcher is gone: the rank dies with it (launch.die_with_parent)
                return
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()
        self._pg = None

    def quorum(self, step: int, last: int) -> dict:
        """Ask for the next quorum at ``step`` (``last``: the step training ends at; a replica at
        it waits for the others) and wait for the lighthouse's answer (same on all K ranks);
        asks again while the answer is "retry"."""
        while True:
            self.n += 1
            if self.local == 0:
                self.store.set(f"req/{self.replica}", json.dumps({"n": self.n, "gen": self.gen, "step": int(step),
                                                                  "last": int(last)}))
            q = json.loads(self._wait(f"resp/{self.replica}/{self.gen}/{self.n}", ANSWER_WAIT, "a quorum"))
            if not q.get("retry"):
                return q

    def vote(self, q: dict, phase: str, ok: bool, fingerprint: int = 0) -> str:
        """This rank's vote on ``phase`` of quorum ``q``; returns the lighthouse's decision."""
        self.store.set(f"vote/{q['id']}/{phase}/{self.replica}/{self.local}",
                       json.dumps({"ok": bool(ok), "fp": int(fingerprint)}))
        return self._wait(f"dec/{q['id']}/{phase}", DECISION_WAIT, f"the decision on {phase} of quorum {q['id']}").decode()

    def _wait(self, key: str, factor: float, what: str) -> bytes:
        limit = factor * self.timeout_s + SLACK_S
        try:
            self.store.wait([key], datetime.timedelta(seconds=limit))
            return self.store.get(key)
        except Exception as e:  # DistStoreError (timeout) or the store's connection gone
            raise QuorumTimeout(f"replica {self.replica} local rank {self.local}: no answer from the lighthouse "
                                f"on {what} within {limit:g} s ({type(e).__name__}); the launcher is gone or "
                                "stuck: this rank fails and its replica is replaced") from None

    def group(self, q: dict):
        """The gloo group of this local index over the quorum's members (rank = position in
        ``q["members"]``), built once per configuration."""
        if self._pg_cfg != q["cfg"]:
            self._pg = None  # the old configuration's group is dropped, never reused
            prefix = dist.PrefixStore(f"pg/{q['cfg']}/{self.local}/", self.store)
            self._pg = dist.ProcessGroupGloo(prefix, q["members"].index(self.replica), len(q["members"]),
                                             datetime.timedelta(seconds=JOIN_WAIT * self.timeout_s))
            self._pg_cfg = q["cfg"]
        return self._pg

    def drop_group(self) -> None:
        self._pg, self._pg_cfg = None, None


def wait(work) -> None:
    """Wait for a gloo work; any failure (peer gone, timeout) is a :class:`QuorumFailed`."""
    try:
        work.wait()
    except Exception as e:  # gloo raises RuntimeError/DistBackendError with the peer's story
        raise QuorumFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def average(q: dict, member: Member, tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` in place over the quorum's members: one flat all-reduce (sum) on the
    quorum's gloo group, divided by the number of members (the live replicas)."""
    if len(q["members"]) == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
                      for t in tensors])
    try:
        pg = member.group(q)
    except Exception as e:
        raise QuorumFailed(f"building the quorum's group failed: {type(e).__name__}: {e}") from None
    wait(pg.allreduce([flat]))
    flat /= len(q["members"])
    pos = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[pos:pos + n].view(t.shape))
            pos += n


class Lighthouse:
    """The launcher's quorum and decision maker (module doc). ``poll()`` is called in a loop;
    ``mark_dead`` / ``spawned`` come from the launcher's process supervision."""

    def __init__(self, store, n_replicas: int, n_local: int, timeout_s: float, clock=time.monotonic):
        self.store, self.R, self.K, self.timeout_s, self.clock = store, n_replicas, n_local, timeout_s, clock
        self.gen = [0] * n_replicas
        self.status = ["starting"] * n_replicas  # starting -> active -> dead -> starting (gen + 1)
        self.seen_n = [0] * n_replicas
        self.pending: dict[int, dict] = {}
        self.first_pending = None
        self.qid, self.cfg, self.last_members, self.aborted = 0, 0, None, False
        self.open: dict[tuple[int, str], dict] = {}  # (qid, phase) -> {members, since}
        self.log: list[dict] = []  # decisions and quorums with times, for the recovery table
        self.seen_t = [clock()] * n_replicas  # when each replica last asked or voted
        self.step_of = [0] * n_replicas  # the step each replica (this generation) last asked at
        self.best = 0  # the most advanced step any quorum was formed at
        self.lost: str | None = None
        """Set when every replica holding the run's state failed at once (the launcher ends the job)."""
        self.silent_s = (VOTE_WAIT + JOIN_WAIT) * timeout_s
        """An active replica that neither asks nor votes this long is hung (``silent``)."""
        self.done = False
        self.stop_at: int | None = None
        """Set by the launcher (the soak's end): training ends at this step instead of train.steps."""

    # -- supervision -----------------------------------------------------------------------
    def spawned(self, r: int, gen: int) -> None:
        self.gen[r], self.status[r], self.seen_n[r], self.seen_t[r] = gen, "starting", 0, self.clock()
        self.step_of[r] = 0
        self._unpend(r)

    def _unpend(self, r: int) -> None:
        self.pending.pop(r, None)
        if not self.pending:
            self.first_pending = None

    def mark_dead(self, r: int, why: str) -> None:
        self.status[r] = "dead"
        self._unpend(r)
        self.log.append({"t": self.clock(), "event": "dead", "replica": r, "gen": self.gen[r], "why": why})
        for (q, phase), o in list(self.open.items()):
            if r in o["members"]:
                self._decide(q, phase, "abort", o)

    def stale(self, hb_timeout_s: float) -> list[int]:
        """Active replicas one of whose ranks has not written a heartbeat for ``hb_timeout_s``."""
        out, now = [], time.time()
        for r in range(self.R):
            if self.status[r] != "active":
                continue
            for i in range(self.K):
                try:
                    gen, t = self.store.get(f"hb/{r}/{i}").decode().split(":")
                except Exception:
                    continue
                if int(gen) == self.gen[r] and now - float(t) > hb_timeout_s:
                    out.append(r)
                    break
        return out

    def silent(self) -> list[int]:
        """Active replicas that have neither asked nor voted for ``silent_s`` (their heartbeat
        thread beats, their training thread is stuck): the launcher fails them."""
        now = self.clock()
        return [r for r in range(self.R) if self.status[r] == "active" and now - self.seen_t[r] > self.silent_s]

    # -- the loop ----------------------------------------------------------------------------
    def poll(self) -> None:
        self._read_requests()
        self._maybe_form()
        self._decide_open()

    def _read_requests(self) -> None:
        keys = [f"req/{r}" for r in range(self.R)]
        for r, key in enumerate(keys):
            if self.status[r] == "dead" or not self.store.check([key]):
                continue
            req = json.loads(self.store.get(key))
            if req["gen"] != self.gen[r] or req["n"] <= self.seen_n[r]:
                continue
            self.seen_n[r], self.seen_t[r], self.step_of[r] = req["n"], self.clock(), req["step"]
            self.status[r] = "active"
            self.pending[r] = req
            for (q, phase), o in list(self.open.items()):  # a member asking again left that quorum
                if r in o["members"]:
                    self._decide(q, phase, "abort", o)
            if self.first_pending is None:
                self.first_pending = self.clock()

    def _retry(self) -> None:
        """Answer every pending request "ask again" (no quorum can form yet)."""
        for r, req in self.pending.items():
            self.store.set(f"resp/{r}/{self.gen[r]}/{req['n']}", json.dumps({"retry": True}))
        self.pending, self.first_pending = {}, None

    def _maybe_form(self) -> None:
        if not self.pending:
            return
        late = self.clock() - self.first_pending >= JOIN_WAIT * self.timeout_s
        if any(self.status[r] == "starting" and self.gen[r] == 0 for r in range(self.R)):
            return self._retry() if late else None  # the first start waits for every replica (a replacement is not)
        active = [r for r in range(self.R) if self.status[r] == "active"]
        everyone = all(r in self.pending for r in active)
        if not everyone and not late:
            return
        members = sorted(self.pending)
        reqs = [self.pending[r] for r in members]
        top = max(q["step"] for q in reqs)
        last = reqs[0]["last"] if self.stop_at is None else max(top, min(reqs[0]["last"], self.stop_at))
        finals = all(q["step"] >= last for q in reqs)
        if top < max((self.step_of[r] for r in range(self.R) if self.status[r] == "active"), default=0):
            # a live replica ahead of every asker has not asked yet: never train behind it (a
            # replacement alone would train from its start); it asks, or is dropped as dead
            return self._retry() if late else None
        if top < self.best:  # no live replica holds the state any more: never restart silently
            self.lost = (f"every replica holding step {self.best} failed at once (the survivors ask at step {top}): "
                         "the state is lost; resume from the last checkpoint with --resume")
            return None
        if finals and len(members) < self.R:  # finished replicas wait for a replacement to catch up
            return self._retry() if late else None
        if finals and all(q["step"] == top for q in reqs):
            self.done = True
        source = min(r for r, q in zip(members, reqs) if q["step"] == top)
        heal = {str(r): source for r, q in zip(members, reqs) if q["step"] < top}
        key = [(r, self.gen[r]) for r in members]
        if key != self.last_members or self.aborted:
            self.cfg += 1
        self.last_members, self.aborted = key, False
        self.qid += 1
        self.best = max(self.best, top)
        q = {"id": self.qid, "cfg": self.cfg, "members": members, "step": top, "heal": heal,
             "done": self.done, "replicas": self.R, "last": last}
        now = self.clock()
        if heal:
            self.open[(self.qid, "heal")] = {"members": members, "since": now}
        if top < last:
            self.open[(self.qid, "step")] = {"members": members, "since": now, "after_heal": bool(heal)}
        self.log.append({"t": now, "event": "quorum", "id": self.qid, "members": members, "step": top,
                         "heal": heal})
        for r in members:
            self.store.set(f"resp/{r}/{self.gen[r]}/{self.pending[r]['n']}", json.dumps(q))
        self.pending, self.first_pending = {}, None

    def _decide_open(self) -> None:
        now = self.clock()
        for (q, phase), o in list(self.open.items()):
            if phase == "step" and (q, "heal") in self.open:
                continue  # the step's clock starts when the heal is decided
            keys = [f"vote/{q}/{phase}/{r}/{i}" for r in o["members"] for i in range(self.K)]
            if self.store.check(keys):
                for r in o["members"]:
                    self.seen_t[r] = now
                votes = [json.loads(self.store.get(k)) for k in keys]
                if not all(v["ok"] for v in votes):
                    self._decide(q, phase, "abort", o)
                    continue
                fps = {}
                for k, v in zip(keys, votes):
                    fps.setdefault(k.rsplit("/", 1)[1], set()).add(v["fp"])
                bad = [i for i, s in fps.items() if len(s) > 1]
                self._decide(q, phase, f"diverged: local rank(s) {bad}" if bad else "commit", o)
            elif now - o["since"] > VOTE_WAIT * self.timeout_s:  # a safety net: the dead are dropped sooner
                self._decide(q, phase, "abort", o)

    def _decide(self, q: int, phase: str, decision: str, o: dict) -> None:
        self.open.pop((q, phase), None)
        if decision != "commit":
            self.aborted = True
            self.open.pop((q, "step"), None) if phase == "heal" else None
        if phase == "heal" and (q, "step") in self.open:
            self.open[(q, "step")]["since"] = self.clock()
        self.store.set(f"dec/{q}/{phase}", decision)
        if phase == "heal" and decision != "commit":
            self.store.set(f"dec/{q}/step", "abort")
        self.log.append({"t": self.clock(), "event": phase, "id": q, "decision": decision,
                         "members": list(o["members"])})
