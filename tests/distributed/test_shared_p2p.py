"""Point-to-point on the shared-memory transport (shardlab/distributed/shm_p2p.py) at N = 3, CPU:
messages of many sizes and dtypes arrive in issue order and equal the sender's data (generated
independently from the sender's rank and the message index); messages far longer than a ring
stream through it, also when two ranks send each other such messages before either waits; a
receive of the wrong size fails naming both sizes; a non-contiguous group (ranks 0 and 2) uses
group-relative peers; the ledger records what the process group's Comm records; a send that no
receive matches raises at the group's next collective or barrier on every rank (the pair's ranks
name it).

Workers return their failures as strings."""
import time

import torch
import torch.distributed as dist

from shardlab.distributed import shm_pair
from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger
from shardlab.distributed.shm import SharedComm
from shardlab.launch import run

CAP = 4096  # small rings: most messages below stream through several times
SIZES = [(0, torch.float64), (1, torch.float64), (1000, torch.float64), (3 * CAP + 5, torch.float32),
         (257, torch.int64), (10 * CAP, torch.float64), (3, torch.bool)]


def _msg(sender: int, i: int) -> torch.Tensor:
    n, dtype = SIZES[i % len(SIZES)]
    g = torch.Generator().manual_seed(1000 * sender + i)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-10**9, 10**9, (n,), generator=g)


def _ring_checks(sh, errors, tag):
    """Each rank sends 2 x len(SIZES) messages to the next rank and receives as many from the
    previous one: all receives posted first, then the sends, then the waits."""
    n, r = sh.size, sh.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    count = 2 * len(SIZES)
    bufs = [torch.empty_like(_msg(prv, i)) for i in range(count)]
    recvs = [sh.irecv(b, prv) for b in bufs]
    sends = [sh.isend(_msg(r, i), nxt) for i in range(count)]
    for w in recvs + sends:
        w.wait()
    for i, b in enumerate(bufs):
        if not torch.equal(b, _msg(prv, i)):
            errors.append(f"{tag}: message {i} from group rank {prv} differs")


def _crossing_checks(sh, errors, tag):
    """Every rank sends 10 rings' worth to both neighbours and receives as much from both, all
    through ``exchange`` before waiting: each must drain its receives while its sends are stuck."""
    n, r = sh.size, sh.rank
    peers = sorted({(r + 1) % n, (r - 1) % n})
    out = {p: torch.full((10 * CAP // 8,), float(100 * r + p), dtype=torch.float64) for p in peers}
    inc = {p: torch.empty(10 * CAP // 8, dtype=torch.float64) for p in peers}
    works = sh.exchange([(out[p], p) for p in peers], [(inc[p], p) for p in peers])
    for w in works:
        w.wait()
    for p in peers:
        if not torch.equal(inc[p], torch.full_like(inc[p], float(100 * p + r))):
            errors.append(f"{tag}: exchange from group rank {p} differs")


def _ledger_checks(group, ranks, rank, errors):
    led = {"shared": Ledger(), "pg": Ledger()}
    comms = {"shared": SharedComm("g", group, ranks, rank, led["shared"], p2p_cap=CAP),
             "pg": Comm("g", group, ranks, rank, led["pg"])}
    n, me = len(ranks), ranks.index(rank)
    for c in comms.values():
        buf = torch.empty(300, dtype=torch.float32)
        works = [c.irecv(buf, (me - 1) % n), c.isend(torch.ones(300), (me + 1) % n)]
        works += c.exchange([(torch.ones(7, dtype=torch.int64), (me + 1) % n)],
                            [(torch.empty(7, dtype=torch.int64), (me - 1) % n)])
        for w in works:
            w.wait()
    a, b = ({k: (e.calls, e.bytes_sent, e.bytes_recv) for k, e in led[x].entries.items()} for x in ("shared", "pg"))
    if a != b:
        errors.append(f"ledger differs: shared {a} vs process group {b}")


def _worker(ctx, slot=0):
    """``slot`` > 0: every message goes through a box of two slots of that many bytes (the path
    of CUDA tensors, shm_pair.py), run on host memory; the rings carry headers and piece records."""
    shm_pair.HOST_SLOT = slot
    errors = []
    pair = dist.new_group([0, 2])  # non-contiguous: group-relative peers
    for group, ranks in ((dist.group.WORLD, list(range(ctx.world_size))), (pair, [0, 2])):
        if ctx.rank not in ranks:
            continue
        sh = SharedComm("g", group, ranks, ctx.rank, Ledger(), p2p_cap=CAP)
        tag = f"ranks {ranks}"
        _ring_checks(sh, errors, tag)
        _crossing_checks(sh, errors, tag)
        _ring_checks(sh, errors, tag + " again")  # rings reused after wrapping
        if sh._channels is None or sh._channels.setup:
            errors.append(f"{tag}: the rings were not set up")
        pieces = sum(b.pieces for b in sh._channels.boxes.values()) if sh._channels else 0
        if bool(pieces) != bool(slot):
            errors.append(f"{tag}: {pieces} pieces went through boxes (slot {slot})")
        _ledger_checks(group, ranks, ctx.rank, errors)
    # a receive of the wrong size: the receiver fails naming both sizes (a fresh comm)
    sh = SharedComm("mismatch", dist.group.WORLD, list(range(ctx.world_size)), ctx.rank, Ledger(), p2p_cap=CAP)
    if ctx.rank == 0:
        sh.isend(torch.ones(8, dtype=torch.float64), 1).wait()
    elif ctx.rank == 1:
        try:
            sh.irecv(torch.empty(4, dtype=torch.float64), 0).wait()
            errors.append("a receive of 32 bytes took a 64-byte message")
        except RuntimeError as e:
            if "64 bytes" not in str(e) or "expects 32" not in str(e):
                errors.append(f"mismatch error does not name both sizes: {e}")
    _unreceived_checks(ctx.rank, errors)
    dist.barrier()
    return errors


def _expect_unreceived(rank, call, raisers, parts, errors, tag):
    """``call()`` raises on the ranks in ``raisers`` with every one of ``parts``, at once (< 2 s),
    and returns on the others."""
    t0 = time.perf_counter()
    try:
        call()
        if rank in raisers:
            errors.append(f"{tag}: rank {rank} did not raise")
    except RuntimeError as e:
        if rank not in raisers or not all(p in str(e) for p in parts) or time.perf_counter() - t0 > 2:
            errors.append(f"{tag}: rank {rank}: {e} after {time.perf_counter() - t0:.1f} s")


def _unreceived_checks(rank, errors):
    """A send with no matching receive raises at the group's next barrier or collective on every
    rank (the pair's name it), instead of waiting in the ring for a later receive to take it; sends
    whose receives were posted before the collective (and waited after it) are not flagged."""
    world = list(range(dist.get_world_size()))
    sh = SharedComm("ok", dist.group.WORLD, world, rank, Ledger(), p2p_cap=CAP)
    n = len(world)
    for i in range(20):  # receive posted before the collective, sent before it, waited after it
        buf = torch.empty(i + 1, dtype=torch.float64)
        works = [sh.irecv(buf, (rank - 1) % n), sh.isend(torch.full((i + 1,), float(rank + i), dtype=torch.float64), (rank + 1) % n)]
        sh.all_reduce(torch.ones(3)) if i % 2 else sh.barrier()
        for w in works:
            w.wait()
        if not torch.equal(buf, torch.full_like(buf, float((rank - 1) % n + i))):
            errors.append(f"legit exchange {i}: wrong data")
    # the pair 2 -> 0 is set up: rank 2 sends 48 bytes rank 0 never asks for; the next collective names it
    if rank == 2:
        sh.isend(torch.ones(6, dtype=torch.float64), 0).wait()
    where = "before its all_reduce(float64, 24 bytes, sum)"
    _expect_unreceived(rank, lambda: sh.all_reduce(torch.ones(3, dtype=torch.float64)), {0, 1, 2},
                       [f"ok: group rank 2 sent 1 message(s) to group rank 0 that it did not receive {where}",
                        "send #21 of 48 bytes from 2 to 0"] if rank != 1 else
                       [f"ok: the group's ranks sent 61 point-to-point messages but asked for 60 {where}"],
                       errors, "collective")
    _exit_checks(rank, errors)
    # a fresh group: rank 0 sends 64 bytes, rank 1 never set up the pair; the barrier names it
    # (before, a later receive of 64 bytes took this stale message)
    sh = SharedComm("fresh", dist.group.WORLD, world, rank, Ledger(), p2p_cap=CAP)
    sh.all_reduce(torch.ones(2))  # the group's arena (made through the process group) exists first
    if rank == 0:
        sh.isend(torch.ones(8, dtype=torch.float64), 1).wait()
    _expect_unreceived(rank, sh.barrier, {0, 1, 2}, ["fresh: group rank 0 sent 1 message(s) to group rank 1 that it did "
                                                     "not receive before its barrier() (send #1 of 64 bytes"] if rank == 0
                       else ["fresh: the group's ranks sent 1 point-to-point messages but asked for 0"], errors, "barrier")
    if rank == 1:  # take it now: rank 0's ring name (a gloo send) completes, so dist.barrier can follow
        sh.irecv(torch.empty(8, dtype=torch.float64), 0).wait()


def test_shared_point_to_point_equals_sent_data():
    errors = run(_worker, 3, timeout_s=120)
    assert errors == [[], [], []]


def test_shared_point_to_point_through_boxes():
    """The same checks with every message in pieces through two 1000-byte slots (the protocol
    of CUDA tensors, whose slots are device memory: shm_pair.py)."""
    errors = run(_worker, 3, 1000, timeout_s=120)
    assert errors == [[], [], []]


def _exit_checks(rank, errors):
    """When the rank's function returns (flight.py runs ``Recorder.at_exit``): a message that lies
    unreceived in a ring raises on its receiver at once, and on its sender once the receiver
    returned too. Called here by hand on a fresh group: rank 1 sends 24 bytes rank 2 never takes."""
    world = list(range(dist.get_world_size()))
    sh = SharedComm("exit", dist.group.WORLD, world, rank, Ledger(), p2p_cap=CAP)
    sh.all_reduce(torch.ones(2))
    if rank in (1, 2):  # the pair is set up by an exchanged message first
        buf = torch.empty(1)
        works = [sh.isend(torch.ones(1), 3 - rank), sh.irecv(buf, 3 - rank)]
        for w in works:
            w.wait()
    if rank == 1:
        sh.isend(torch.ones(3, dtype=torch.float64), 2).wait()
    dist.barrier()  # the send is in the ring before rank 2 looks (a later send only its sender can name)
    def check():
        if sh._channels is not None:
            sh._channels.at_exit(1)
            sh._channels.at_exit(2)
    want = {1: "exit: group rank 1 sent group rank 2 a message of 24 bytes that it never received",
            2: "exit: group rank 1 sent group rank 2 a message of 24 bytes that it never received"}
    try:
        check()
        if rank in want:
            errors.append(f"exit check: rank {rank} did not raise")
    except RuntimeError as e:
        if want.get(rank, "?") not in str(e):
            errors.append(f"exit check: rank {rank}: {e}")
    if sh._channels is not None:
        sh._channels.broken = True  # checked by hand above: not again when the function returns


def _pipeline_worker(ctx, cfg, slot):
    """A pp=2 run on the shared transport with every stage message in pieces through the boxes."""
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.topology import Topology
    from shardlab.models import build_model
    from shardlab.parallelize import parallelize
    from tests.distributed.test_data_parallel import adamw, batches
    shm_pair.HOST_SLOT = slot
    mesh = Mesh.build(Topology.from_config(cfg.parallel), transport="shared")
    engine = parallelize(build_model(cfg.model, cfg.train.seed, dtype=torch.float64), mesh, cfg)
    opt = engine.make_optimizer(adamw(cfg))
    losses = []
    for x, y in batches(cfg):
        local = engine.forward_backward(list(zip(x.chunk(cfg.parallel.microbatches), y.chunk(cfg.parallel.microbatches))))
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(engine.global_loss(local))
    chans = mesh.comm("pp")._channels
    return losses, sum(b.pieces for b in chans.boxes.values()) if chans else 0


def test_pipeline_through_boxes_matches_one_process():
    """1F1B and DualPipeV on 2 ranks, activations and gradients in 512-byte pieces through the
    boxes (the path of CUDA tensors, on host slots): losses equal a single-process run (1e-10)."""
    from shardlab.analysis.verify import plain_run
    from tests.distributed.test_data_parallel import batches, make_cfg
    for schedule, m in (("1f1b", 2), ("dualpipev", 4)):
        cfg = make_cfg(2, pp=2, pp_schedule=schedule, microbatches=m)
        cfg.parallel.dp_shard, cfg.model.n_layers = 1, 4  # DualPipeV: 2 x pp stages
        ref = plain_run(cfg, batches(cfg))[0]
        for losses, pieces in run(_pipeline_worker, 2, cfg, 512, timeout_s=120):
            assert pieces > 0, f"{schedule}: no piece went through a box"
            assert len(losses) == len(ref) and max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-10, (schedule, losses, ref)
