"""Flight recorder: hang and desync diagnosis of collectives and point-to-point messages.

Every :class:`~shardlab.distributed.collectives.Comm` call appends one entry to its Mesh's
:class:`Recorder`, a ring buffer of the last ``CAPACITY`` operations: group name and members,
op, shapes and dtypes, reduce op, a sequence number, the call site (the first stack frame
outside shardlab/distributed) and whether the call returned. Sequence numbers count collectives per
group, and point-to-point messages per (group, sender, receiver): every member of a group must have
issued the same collective under the same number, and the k-th receive of a channel pairs with its
k-th send. Recording is (dtype, shape) pairs and a deque append: an entry never holds a tensor.

Under ``launch.run`` and Ray each rank dumps its buffer as JSON (``rank<R>.json``) into a directory
the launcher passes (and into ``Recorder.run_dir`` when set), when its function returns (after
``Recorder.at_exit``: the shared transport's unreceived-send check) or raises; a Comm call that
raises dumps at once. On a failure the launcher reads the dumps (:func:`collect`) and prints
:func:`diagnose`: each rank's last operation and the ranks that are behind in, or disagree about,
a collective or a message. Under torchrun a rank whose Comm call fails prints that report itself
from the dumps in ``Recorder.run_dir`` (``shardlab train``: ``<run_dir>/flight``): flight_here.py.

Check mode (``parallel.check_collectives``): before each collective the group all-gathers a
256-byte fingerprint (op, seq, dtype, shapes, reduce op, splits) and every rank raises
:class:`CollectiveMismatch` at the first difference, one line naming both sides. Point-to-point
messages carry the fingerprint as a header message sent just before the data on the same
channel (order matching pairs header with header); the receiver compares it in ``wait()``.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import sys
import tempfile
import time
from collections import deque

import torch
import torch.distributed as dist

CAPACITY = 64
FP_BYTES = 256
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_HERE = os.path.dirname(os.path.abspath(__file__))


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (or unpaired messages): raised by check mode."""


def call_site() -> str:
    """``file:line in func`` of the first frame outside shardlab/distributed."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"


def meta(t) -> tuple:
    """(dtype, shape) of a tensor: what an entry keeps. Never the tensor itself: 64 entries holding
    their tensors kept every unsharded gradient and gathered unit of a ZeRO-3 step alive (about
    twice the whole model per rank, docs/data-parallel.md, Where the memory goes)."""
    return (t.dtype, tuple(t.shape))


def describe(t) -> str:
    dtype, shape = t if isinstance(t, tuple) else meta(t)
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


class Recorder:
    """One rank's ring buffer of operations (one per Mesh). ``check``: fingerprint mode."""

    def __init__(self, rank: int, capacity: int = CAPACITY, check: bool = False):
        self.rank, self.check = rank, check
        self.entries: deque = deque(maxlen=capacity)
        self.seq: dict = {}
        self.groups: dict = {}
        self.run_dir: str | None = None
        self.at_exit: list = []  # checks run when the launcher's rank function returns (shm_p2p.py)
        _LIVE.append(self)

    def enter(self, comm, op: str, tensors=(), extra=None, peer: int | None = None) -> list:
        """Record ``op`` on ``comm`` (before it runs); returns the entry (``entry[-1] = True``
        once it returned). ``peer``: group rank of a send's receiver / a recv's sender."""
        if peer is None:
            key = comm.name
        else:
            src, dst = (comm.global_rank, comm.ranks[peer]) if op == "send" else (comm.ranks[peer], comm.global_rank)
            key = (comm.name, src, dst)
        seq = self.seq[key] = self.seq.get(key, 0) + 1
        if comm.name not in self.groups:
            self.groups[comm.name] = comm.ranks
        entry = [seq, comm.name, op, tuple(map(meta, tensors)), extra, peer, call_site(), time.time(), False]
        self.entries.append(entry)
        return entry

    def to_json(self) -> dict:
        ops = []
        for seq, group, op, tensors, extra, peer, site, t, done in self.entries:
            rec = {"seq": seq, "group": group, "members": self.groups[group], "op": op,
                   "tensors": [describe(x) for x in tensors], "site": site, "time": t, "done": done}
            if extra is not None:
                rec["extra"] = extra
            if peer is not None:
                rec["peer"] = self.groups[group][peer]
            ops.append(rec)
        seqs = {g if isinstance(g, str) else f"{g[0]}:{g[1]}->{g[2]}": n for g, n in self.seq.items()}
        return {"rank": self.rank, "groups": self.groups, "seq": seqs, "ops": ops}

    def dump(self, directory: str | None = None, reason: str = "", keep: bool = True) -> list[str]:
        """Write ``rank<R>.json`` into ``directory``, the launcher's dump dir and (``keep``: a
        failure worth keeping) ``run_dir``."""
        paths = []
        for d in {x for x in (directory, _DUMP_DIR, self.run_dir if keep else None) if x}:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"rank{self.rank}.json")
            data = self.to_json()
            data["reason"] = reason
            with open(path + ".tmp", "w") as fh:
                json.dump(data, fh)
            os.replace(path + ".tmp", path)
            paths.append(path)
        return paths


_LIVE: list = []          # this process's recorders (rank processes build one or two Meshes)
_DUMP_DIR: str | None = None


def dump_all(reason: str = "", keep: bool = True) -> None:
    """Dump the most recent recorder with entries (launcher hook and Comm errors); ``keep=False``
    (a rank that returned): only into the launcher's temporary dump dir, not the run dir. A failure
    with no launch.run parent to collect the dumps (torchrun, Ray): :func:`report_here`."""
    for rec in reversed(_LIVE):
        if rec.entries:
            try:
                rec.dump(reason=reason, keep=keep)
            except OSError:
                pass
            if keep and _DUMP_DIR is None and rec.run_dir:
                from .flight_here import report_here
                report_here(rec, collect, diagnose)
            return


def _rank_main(dump_dir, fn, ctx, *args):
    global _DUMP_DIR
    _DUMP_DIR = dump_dir
    try:
        out = fn(ctx, *args)
        for check in [functools.partial(c, phase) for phase in (1, 2) for rec in _LIVE for c in rec.at_exit]:
            check()  # phase 1 of every check, then 2: raises naming a message sent and never received
    except BaseException as e:
        dump_all(f"{type(e).__name__}: {e}".splitlines()[0][:300])
        raise
    dump_all("returned", keep=False)
    return out


def wrap(fn, dump_dir: str):
    """The launcher's rank function: ``fn`` that dumps its recorder into ``dump_dir`` at the end."""
    return functools.partial(_rank_main, dump_dir, fn)


# -- check mode ----------------------------------------------------------------------------------

def _encode(d: dict, device) -> torch.Tensor:
    raw = json.dumps(d, separators=(",", ":")).encode()[:FP_BYTES]
    buf = torch.zeros(FP_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _decode(t: torch.Tensor) -> dict:
    raw = bytes(t.cpu().tolist()).rstrip(b"\0")
    try:
        return json.loads(raw)
    except ValueError:
        return {"op": "?", "bad": raw[:60].decode(errors="replace")}


def _show(fp: dict) -> str:
    args = ", ".join(fp.get("t", [])) + (f", {fp['x']}" if fp.get("x") else "")
    return f"{fp.get('op')}({args}) seq {fp.get('seq')} at {fp.get('site')}"


def _fingerprint(entry, group_name) -> dict:
    seq, _, op, tensors, extra, _, site = entry[:7]
    return {"op": op, "seq": seq, "g": group_name, "t": [describe(x) for x in tensors], "x": extra, "site": site}


def check_collective(comm, entry, device) -> None:
    """All-gather this rank's fingerprint over ``comm``; raise CollectiveMismatch on a difference."""
    mine = _fingerprint(entry, comm.name)
    out = torch.empty(comm.size * FP_BYTES, dtype=torch.uint8, device=device)
    _gather(out, _encode(mine, device), group=comm.group)
    fps = [_decode(x) for x in out.view(comm.size, FP_BYTES)]
    if all(fp.get("op") == "all_to_all" for fp in fps):  # splits differ per rank, but must pair up
        keys, pair = ("op", "seq", "g"), _splits_mismatch(fps)
        rows = lambda fp: (fp.get("x") or {}).get("row")  # noqa: E731 (dtype and trailing shape)
        bad = next((r for r, fp in enumerate(fps) if rows(fp) != rows(fps[0])), None)
        if bad is None and pair is not None:
            i, j = pair
            raise CollectiveMismatch(
                f"collective mismatch in group '{comm.name}': rank {comm.ranks[i]} {_show(fps[i])} sends "
                f"{fps[i]['x']['in'][j]} rows to rank {comm.ranks[j]} but rank {comm.ranks[j]} {_show(fps[j])} "
                f"expects {fps[j]['x']['out'][i]} (this is rank {comm.global_rank})")
    else:
        keys = ("op", "seq", "g", "t", "x")
        bad = None
    if bad is None:
        bad = next((r for r, fp in enumerate(fps) if any(fp.get(k) != fps[0].get(k) for k in keys)), None)
    if bad is None:
        return
    raise CollectiveMismatch(
        f"collective mismatch in group '{comm.name}': rank {comm.ranks[bad]} {_show(fps[bad])} vs rank "
        f"{comm.ranks[0]} {_show(fps[0])} (this is rank {comm.global_rank})")


def _splits_mismatch(fps):
    """(i, j) where rank i's in_splits[j] != rank j's out_splits[i], else None."""
    try:
        ins = [fp["x"]["in"] for fp in fps]
        outs = [fp["x"]["out"] for fp in fps]
        return next(((i, j) for i in range(len(fps)) for j in range(len(fps)) if ins[i][j] != outs[j][i]), None)
    except (KeyError, TypeError, IndexError):
        return (0, 0)


class CheckedRecv:
    """A receive in check mode: ``wait()`` waits for the sender's header, compares it with what
    this rank expects (op pairing, seq, dtype and shape), then waits for the data."""

    def __init__(self, comm, entry, header, head_work, data_work):
        self.comm, self.entry, self.header = comm, entry, header
        self.works = [head_work, data_work]

    def wait(self, *a, **k):
        if self.header is not None:
            self.works[0].wait()
            got, exp = _decode(self.header), _fingerprint(self.entry, self.comm.name)
            self.header = None
            if got.get("op") != "send" or got.get("seq") != exp["seq"] or got.get("t") != exp["t"]:
                peer = self.comm.ranks[self.entry[5]]
                raise CollectiveMismatch(
                    f"p2p mismatch in group '{self.comm.name}': rank {self.comm.global_rank} recv({', '.join(exp['t'])}) "
                    f"#{exp['seq']} from rank {peer} at {exp['site']} got rank {peer} {_show(got)}")
        self.works[1].wait(*a, **k)
        self.entry[-1] = True
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def send_header(comm, entry, device):
    return _encode(_fingerprint(entry, comm.name), device)


# -- launcher side -------------------------------------------------------------------------------

def new_dump_dir() -> str:
    return tempfile.mkdtemp(prefix="shardlab-flight-")


def collect(directory: str, nproc: int, alive=lambda r: False, wait_s: float = 2.0) -> dict:
    """{rank: dump} once every rank has dumped or died (at most ``wait_s``)."""
    deadline = time.time() + wait_s
    while True:
        found = {int(os.path.basename(p)[4:-5]) for p in glob.glob(os.path.join(directory, "rank*.json"))}
        if all(r in found or not alive(r) for r in range(nproc)) or time.time() > deadline:
            break
        time.sleep(0.05)
    dumps = {}
    for r in sorted(found):
        try:
            with open(os.path.join(directory, f"rank{r}.json")) as fh:
                dumps[r] = json.load(fh)
        except (OSError, ValueError):
            pass
    return dumps


def _op_line(op: dict) -> str:
    args = ", ".join(op["tensors"]) + (f", {op['extra']}" if op.get("extra") else "")
    peer = f" {'to' if op['op'] == 'send' else 'from'} rank {op['peer']}" if "peer" in op else ""
    state = "posted" if "peer" in op else ("returned" if op["done"] else "did not return")
    return f"{op['group']} {op['op']}({args}){peer} seq {op['seq']} at {op['site']} ({state})"


def diagnose(dumps: dict, nproc: int) -> list[str]:
    """Lines: each rank's last operation, then the ranks behind or disagreeing per group/channel."""
    lines = []
    for r in range(nproc):
        d = dumps.get(r)
        if d is None:
            lines.append(f"  rank {r}: no dump (killed before it could write one)")
        elif not d["ops"]:
            lines.append(f"  rank {r}: no communication recorded")
        else:
            lines.append(f"  rank {r}: last op {_op_line(d['ops'][-1])}")
    # collectives: per (group, members), each rank's count and what it did at each seq
    groups: dict = {}
    for r, d in dumps.items():
        for g, members in d["groups"].items():
            groups.setdefault((g, tuple(members)), {})[r] = d["seq"].get(g, 0)
    for (g, members), seqs in sorted(groups.items()):
        if len(members) < 2:
            continue
        for m in members:
            if m not in seqs and m in dumps:
                seqs[m] = 0
        top = max(seqs.values())
        leader = min(r for r, s in seqs.items() if s == top)
        op = _find(dumps[leader], g, top)
        what = f"{op['op']} seq {top}" if op else f"seq {top}"
        behind = sorted(r for r, s in seqs.items() if s < top)
        if behind:
            lines.append(f"  group {g} {list(members)}: rank(s) {behind} missing from {what} "
                         f"(entered by rank {leader}; they are at seq {[seqs[r] for r in behind]})")
        for s in range(max(1, top - CAPACITY + 1), top + 1):
            ops = {r: _find(dumps[r], g, s) for r in seqs if seqs[r] >= s}
            sigs = {r: (o["op"], o["tensors"], o.get("extra")) for r, o in ops.items() if o}
            if len(set(map(repr, sigs.values()))) > 1 and not _a2a_only(sigs):
                desc = "; ".join(f"rank {r} {o['op']}({', '.join(o['tensors'])}"
                                 f"{', ' + str(o['extra']) if o.get('extra') else ''}) at {o['site']}"
                                 for r, o in ops.items() if o)
                lines.append(f"  group {g}: ranks disagree at seq {s}: {desc}")
                break
    # point to point: sends vs receives per channel
    chans: dict = {}
    for r, d in dumps.items():
        for key, n in d["seq"].items():
            if "->" in key:
                g, pair = key.rsplit(":", 1)
                src, dst = map(int, pair.split("->"))
                side = "send" if r == src else "recv"
                chans.setdefault((g, src, dst), {})[side] = n
    for (g, src, dst), c in sorted(chans.items()):
        ns, nr = c.get("send", 0), c.get("recv", 0)
        if ns > nr and dst in dumps:
            lines.append(f"  group {g}: rank {dst} is missing recv #{nr + 1} from rank {src} "
                         f"(rank {src} sent {ns}, rank {dst} received {nr})")
        elif nr > ns and src in dumps:
            lines.append(f"  group {g}: rank {src} is missing send #{ns + 1} to rank {dst} "
                         f"(rank {dst} posted {nr} recv(s), rank {src} sent {ns})")
    return lines


def _a2a_only(sigs) -> bool:
    return all(s[0] == "all_to_all" for s in sigs.values())


def _find(dump, group, seq):
    for op in reversed(dump["ops"]):
        if op["group"] == group and op["seq"] == seq and "peer" not in op:
            return op
    return None


def report(directory: str, nproc: int, alive=lambda r: False) -> str:
    """The launcher's diagnosis text ('' when no rank recorded anything)."""
    dumps = collect(directory, nproc, alive)
    if not any(d["ops"] for d in dumps.values()):
        return ""
    return "\n".join(["communication at the failure (flight recorder):", *diagnose(dumps, nproc),
                      f"  full dumps: {directory}"])


class Works:
    """Several works waited as one (a check-mode send: header and data)."""

    def __init__(self, works, entry):
        self.works, self.entry = works, entry

    def wait(self, *a, **k):
        for w in self.works:
            w.wait(*a, **k)
        self.entry[-1] = True
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def diagnose_failure(err, dump_dir: str, procs) -> None:
    """On a failed run: read the ranks' dumps (``procs``: the rank processes, waited for briefly;
    or their number, all ended: Ray), print each rank's last operation and the ranks missing from /
    disagreeing about a collective (docs/faults.md, Hangs and desyncs), append it to ``err``."""
    from ..errors import BAD_INPUT
    root = str(err).split("\n")[1] if "\n" in str(err) else ""
    if root.startswith(BAD_INPUT):  # bad input found by a rank: one line, no communication report
        return
    try:
        text = (report(dump_dir, procs) if isinstance(procs, int) else
                report(dump_dir, len(procs), alive=lambda r: procs[r].is_alive()))
    except Exception as e:  # diagnosis must never hide the failure itself
        text = f"flight recorder: could not read the dumps in {dump_dir}: {type(e).__name__}: {e}"
    if text:
        print(text, file=sys.stderr, flush=True)
        err.args = (f"{err.args[0]}\n{text}",)
