"""The shared-memory transport (shardlab/distributed/shm.py) on CPU: every collective equals an
independent computation from the known per-rank inputs and the gloo process group's result, at
N = 2 and 3 (odd), float64 and integers; uneven all_to_all, all_gather / reduce_scatter along
dim 1, arena growth, avg / max / min, the async variants, ledger bytes equal to the process
group's; Mesh selection; and short float64 trainings (DDP, FSDP, TP) whose losses equal the
process-group run and the single-process reference.

Workers return their failures as strings."""
import os

import pytest
import torch
import torch.distributed as dist

from shardlab.analysis.verify import plain_run
from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger
from shardlab.distributed.mesh import Mesh
from shardlab.distributed import shm_host
from shardlab.distributed.shm import X86, SharedComm
from shardlab.distributed.topology import Topology
from shardlab.launch import run
from shardlab.models import build_model
from shardlab.parallelize import parallelize

from tests.distributed.test_data_parallel import adamw, batches, make_cfg


def _data(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _check(name, got, want, errors, tol=1e-12):
    if got.shape != want.shape or got.dtype != want.dtype:
        errors.append(f"{name}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}")
    elif want.dtype.is_floating_point:
        err = (got - want).abs().max().item() if got.numel() else 0.0
        if not err <= tol * (1 + want.abs().max().item() if want.numel() else 1):
            errors.append(f"{name}: max err {err:.3g}")
    elif not torch.equal(got, want):
        errors.append(f"{name}: integers differ")


def _reduce(parts, op):
    if op in ("sum", "avg"):
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p
        return out / len(parts) if op == "avg" else out
    fn = torch.maximum if op == "max" else torch.minimum
    out = parts[0]
    for p in parts[1:]:
        out = fn(out, p)
    return out


def _gloo_all_reduce(x, op, group, n):
    y = x.clone()
    dist.all_reduce(y, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM), group=group)
    return y / n if op == "avg" else y


def _collective_checks(sh, pg, errors, chunked=False):
    """``sh``: the SharedComm, ``pg``: a plain Comm on the same group (gloo). ``chunked``: the
    transport's chunk is set small, so long messages go in many chunks and the arena stays small."""
    n, r = sh.size, sh.rank
    tag = f"N={n}{' chunked' if chunked else ''}"
    # all_reduce: sizes from below one element per rank to past the first arena (growth)
    for numel, dtype, op in [(1, torch.float64, "sum"), (n - 1, torch.float64, "sum"), (7, torch.int64, "sum"),
                             (1031, torch.int32, "sum"), (100_003, torch.float64, "sum"), (1031, torch.float64, "avg"),
                             (1031, torch.float64, "max"), (1031, torch.int64, "min"), (5, torch.float64, "sum")]:
        inputs = [_data(100 * numel + s, (numel,), dtype) for s in range(n)]
        want = _reduce(inputs, op)
        got = sh.all_reduce(inputs[r].clone(), op)
        _check(f"{tag} all_reduce {op} {dtype} numel={numel}", got, want, errors)
        _check(f"{tag} all_reduce {op} {dtype} numel={numel} vs gloo", got,
               _gloo_all_reduce(inputs[r], op, pg.group, n), errors)
    if not chunked and sh.cap < 100_003 * 8:
        errors.append(f"{tag}: the arena did not grow to 100003 float64 (cap {sh.cap})")
    # non-contiguous, in place
    inputs = [_data(s, (6, 2 * n + 1), torch.float64) for s in range(n)]
    x = inputs[r].t().contiguous().t()
    sh.all_reduce(x)
    _check(f"{tag} all_reduce non-contiguous", x, _reduce(inputs, "sum"), errors)
    # all_gather along dims 0 and 1 (and the async dim-0 form into a given buffer)
    inputs = [_data(50 + s, (3, 5), torch.float64) for s in range(n)]
    for dim in (0, 1):
        _check(f"{tag} all_gather dim={dim}", sh.all_gather(inputs[r], dim), torch.cat(inputs, dim), errors)
    out = torch.empty(3 * n, 5, dtype=torch.float64)
    got = sh.all_gather_async(inputs[r], out).wait()
    _check(f"{tag} all_gather_async", got, torch.cat(inputs), errors)
    if got.data_ptr() != out.data_ptr():
        errors.append(f"{tag} all_gather_async did not fill the given buffer")
    # reduce_scatter along dims 0 and 1, sum / avg / max, float and int
    for dim, dtype, op in [(0, torch.float64, "sum"), (1, torch.float64, "sum"), (0, torch.float64, "avg"),
                           (1, torch.int64, "sum"), (0, torch.float64, "max")]:
        shape = (2 * n, 3) if dim == 0 else (3, 2 * n)
        inputs = [_data(70 + s, shape, dtype) for s in range(n)]
        want = _reduce(inputs, op).chunk(n, dim)[r]
        _check(f"{tag} reduce_scatter {op} dim={dim} {dtype}", sh.reduce_scatter(inputs[r], dim, op), want, errors)
    inputs = [_data(90 + s, (4 * n, 2), torch.float64) for s in range(n)]
    _check(f"{tag} reduce_scatter_async avg", sh.reduce_scatter_async(inputs[r], "avg").wait(),
           _reduce(inputs, "avg").chunk(n)[r], errors)
    inputs = [_data(95 + s, (9,), torch.float64) for s in range(n)]
    x = inputs[r].clone()
    _check(f"{tag} all_reduce_async avg", sh.all_reduce_async(x, "avg").wait(), _reduce(inputs, "avg"), errors)
    # uneven all_to_all (some splits zero): rank i sends splits[i][j] rows to rank j
    splits = [[(i + 2 * j) % 4 for j in range(n)] for i in range(n)]
    inputs = [_data(120 + i, (sum(splits[i]), 3), torch.float64) for i in range(n)]
    want = torch.cat([inputs[i].split(splits[i])[r] for i in range(n)])
    for name, comm in (("shared", sh), ("gloo", pg)):
        got = comm.all_to_all(inputs[r], splits[r], [splits[i][r] for i in range(n)])
        _check(f"{tag} all_to_all uneven ({name})", got, want, errors)
    # broadcast from the last rank, int and float
    for dtype in (torch.int64, torch.float64):
        inputs = [_data(140 + s, (2, 33), dtype) for s in range(n)]
        x = inputs[r].clone()
        sh.broadcast(x, n - 1)
        _check(f"{tag} broadcast {dtype}", x, inputs[n - 1], errors)
    # a small all_reduce again after growth
    inputs = [_data(160 + s, (3,), torch.float64) for s in range(n)]
    _check(f"{tag} all_reduce after growth", sh.all_reduce(inputs[r].clone()), _reduce(inputs, "sum"), errors)


def _ledger_checks(group, ranks, rank, errors):
    """The same calls through both transports record the same bytes (ring model)."""
    led = {"shared": Ledger(), "pg": Ledger()}
    comms = {"shared": SharedComm("g", group, ranks, rank, led["shared"]),
             "pg": Comm("g", group, ranks, rank, led["pg"])}
    n = len(ranks)
    for c in comms.values():
        c.all_reduce(torch.ones(1000, dtype=torch.float64))
        c.all_gather(torch.ones(10, 3), dim=1)
        c.reduce_scatter(torch.ones(4 * n, dtype=torch.int64))
        c.all_to_all(torch.ones(2 * n, 5), [2] * n, [2] * n)
        c.broadcast(torch.ones(17), 0)
    a, b = ({k: (e.calls, e.bytes_sent, e.bytes_recv, e.source) for k, e in led[x].entries.items()} for x in ("shared", "pg"))
    if a != b:
        errors.append(f"ledger differs: shared {a} vs process group {b}")


def _worker(ctx):
    errors = []
    world = ctx.world_size
    pair = dist.new_group([0, 2])  # non-contiguous ranks: group-relative indices are exercised
    # the world on the shared-memory barrier, the pair on the process group's barrier
    for group, ranks, barrier in ((dist.group.WORLD, list(range(world)), "auto"), (pair, [0, 2], "process_group")):
        if ctx.rank not in ranks:
            continue
        sh = SharedComm("g", group, ranks, ctx.rank, Ledger(), host_barrier=barrier)
        pg = Comm("g", group, ranks, ctx.rank, Ledger())
        _collective_checks(sh, pg, errors)
        _ledger_checks(group, ranks, ctx.rank, errors)
        # the one-shot all-reduce (CUDA's default up to 4 ranks) on the host arena
        _collective_checks(SharedComm("o", group, ranks, ctx.rank, Ledger(), host_barrier=barrier, one_shot_ranks=8),
                           pg, errors)
        chunk, shm_host.CHUNK = shm_host.CHUNK, 4096  # every message longer than 4 KiB per rank goes in chunks
        try:
            small = SharedComm("c", group, ranks, ctx.rank, Ledger(), host_barrier=barrier)
            _collective_checks(small, pg, errors, chunked=True)
            one = SharedComm("o1", group, ranks, ctx.rank, Ledger(), host_barrier=barrier, one_shot_ranks=8)
            _collective_checks(one, pg, errors, chunked=True)  # chunks alternate the regions
            bounded = SharedComm("b", group, ranks, ctx.rank, Ledger(), host_barrier=barrier)
            x = _data(7, (len(ranks) * 50_000,), torch.float64)
            bounded.all_reduce(x.clone()), bounded.reduce_scatter(x), bounded.all_gather(x), bounded.broadcast(x.clone(), 0)
            if bounded.cap > 1 << 16:  # the smallest arena: 4 KiB chunks never grow it
                errors.append(f"chunked transport: 400 KB messages grew the arena to {bounded.cap} bytes per region")
        finally:
            shm_host.CHUNK = chunk
        left = [f for f in os.listdir("/dev/shm") if sh._token and f.startswith(sh._token)]
        if left:
            errors.append(f"arena files left in /dev/shm: {left}")
    # selection: shared when asked, and by default on one x86-64 host; the process group when asked
    for transport, cls in (("shared", SharedComm), ("auto", SharedComm if X86 else Comm), ("process_group", Comm)):
        mesh = Mesh.build(Topology(dp_shard=world), transport=transport)
        if type(mesh.comm("dp")) is not cls:
            errors.append(f"transport {transport}: got {type(mesh.comm('dp')).__name__}, want {cls.__name__}")
        if type(mesh.comm("tp")) is not Comm:  # a group of one stays the plain Comm
            errors.append(f"transport {transport}: the tp group of one got {type(mesh.comm('tp')).__name__}")
    return errors


def test_shared_collectives_equal_independent_results():
    errors = run(_worker, 3, timeout_s=120)
    assert not any(errors), "\n".join(e for errs in errors for e in errs)


LAYOUTS = [dict(zero_stage=0, bucket_cap_mb=0.001), dict(zero_stage=3), dict(tp=2), dict(ep=2)]


def _train(ctx, cfg, transport, comm_thread=False):
    """(losses, the groups on the shared transport, calls run on comm threads) of a float64 run."""
    mesh = Mesh.build(Topology.from_config(cfg.parallel), transport=transport, comm_thread=comm_thread)
    engine = parallelize(build_model(cfg.model, cfg.train.seed, dtype=torch.float64), mesh, cfg)
    opt = engine.make_optimizer(adamw(cfg))
    dp, r = mesh.size("dp"), mesh.local_rank("dp")
    losses = []
    for x, y in batches(cfg):
        per = x.shape[0] // dp
        micro = list(zip(x[r * per:(r + 1) * per].chunk(cfg.parallel.microbatches),
                         y[r * per:(r + 1) * per].chunk(cfg.parallel.microbatches)))
        local = engine.forward_backward(micro)
        engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(engine.global_loss(local))
    shared = sorted(k for k, c in mesh._comms.items() if isinstance(c, SharedComm))
    if transport == "shared" and cfg.parallel.ep > 1 and "ep" not in shared:
        raise AssertionError(f"the ep group did not run on the shared transport: {shared}")
    return losses, shared, sum(c._comm_thread.ran for c in mesh._comms.values() if getattr(c, "_comm_thread", None))


def _train_worker(ctx, cfgs):
    return [(_train(ctx, cfg, "shared"), _train(ctx, cfg, "process_group")) for cfg in cfgs]


def _cfg(layout):
    cfg = make_cfg(2, **layout)
    if cfg.parallel.tp > 1:
        cfg.parallel.dp_shard = 1
    if cfg.parallel.ep > 1:  # experts: the dispatch / combine all-to-alls with uneven splits
        cfg.model.n_experts, cfg.model.moe_top_k, cfg.model.ffn_hidden = 4, 2, 32
    return cfg


def test_training_on_shared_transport_matches_process_group():
    cfgs = [_cfg(layout) for layout in LAYOUTS]
    out = run(_train_worker, 2, cfgs, timeout_s=180)
    for cfg, layout, ((shared, used, _), (pg, _, _)) in zip(cfgs, LAYOUTS, out[0]):
        assert used, f"{layout}: no group ran on the shared transport"
        assert len(shared) == len(pg) == 3 and max(abs(a - b) for a, b in zip(shared, pg)) <= 1e-10, (layout, shared, pg)
        if cfg.parallel.ep == 1:  # and the single-process reference
            ref = plain_run(cfg, batches(cfg))[0]
            assert max(abs(a - b) for a, b in zip(shared, ref)) <= 1e-10, (layout, shared, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_collectives_on_one_gpu():
    """N ranks on one GPU: the CUDA IPC path (docs/collectives.md: not yet run on a GPU)."""
    errors = run(_gpu_worker, 2, device="cuda", timeout_s=120)
    assert not any(errors), "\n".join(e for errs in errors for e in errs)


def _gpu_worker(ctx):
    errors = []
    dev = ctx.device
    mesh = Mesh.build(Topology(dp_shard=ctx.world_size), dev)  # auto: ranks share the GPU
    sh = mesh.comm("dp")
    if not isinstance(sh, SharedComm):
        errors.append(f"auto on one GPU chose {type(sh).__name__}")
        return errors
    n, r = sh.size, sh.rank
    for numel in (5, 300_001):
        inputs = [_data(s, (numel,), torch.float32) for s in range(n)]
        _check(f"cuda all_reduce {numel}", sh.all_reduce(inputs[r].to(dev)).cpu(), _reduce(inputs, "sum"), errors, 1e-5)
    inputs = [_data(10 + s, (4, 3), torch.float32) for s in range(n)]
    _check("cuda all_gather dim 1", sh.all_gather(inputs[r].to(dev), 1).cpu(), torch.cat(inputs, 1), errors, 1e-6)
    _check("cuda reduce_scatter", sh.reduce_scatter(inputs[r].repeat(n, 1).to(dev)).cpu(),
           _reduce([x.repeat(n, 1) for x in inputs], "sum").chunk(n)[r], errors, 1e-5)
    splits = [[(i + j) % 3 + 1 for j in range(n)] for i in range(n)]
    inputs = [_data(20 + i, (sum(splits[i]), 2), torch.float32) for i in range(n)]
    got = sh.all_to_all(inputs[r].to(dev), splits[r], [splits[i][r] for i in range(n)]).cpu()
    _check("cuda all_to_all", got, torch.cat([inputs[i].split(splits[i])[r] for i in range(n)]), errors, 0)
    inputs = [_data(30 + s, (7,), torch.float64) for s in range(n)]  # a host tensor: the process group
    _check("cpu tensor on the cuda SharedComm", sh.all_reduce(inputs[r].clone()), _reduce(inputs, "sum"), errors)
    _check_gpu_streams(sh, dev, errors)
    # point-to-point of CUDA tensors through the boxes (shm_pair.py): one piece, and one of three
    for numel in (3, 5_000_000, 20_000_000):
        inputs = [_data(40 + s, (numel,), torch.float32) for s in range(n)]
        buf = torch.empty(numel, dtype=torch.float32, device=dev)
        works = sh.exchange([(inputs[r].to(dev), (r + 1) % n)], [(buf, (r - 1) % n)])
        for w in works:
            w.wait()
        _check(f"cuda sendrecv {numel}", buf.cpu(), inputs[(r - 1) % n], errors, 0)
    if not sh._channels.boxes or sh._channels.boxes[(r + 1) % n, True].pieces != 5:
        errors.append(f"cuda sendrecv: the boxes did not carry 5 pieces: {sh._channels.boxes}")
    return errors


def _check_gpu_streams(sh, dev, errors):
    """The comm-stream path (shm_cuda.py): events exchanged; asynchronous collectives queued beside
    compute on the caller's stream, without a host synchronisation, equal to the reference after
    ``wait()``; a message over shm_cuda.CHUNK in chunks."""
    from shardlab.distributed.shm_cuda import CHUNK
    n, r = sh.size, sh.rank
    if not sh._order or not sh._order.peers:
        errors.append("cuda: no interprocess events after the first collectives")
    ins = [[_data(50 + 7 * k + s, (1000 + k,), torch.float32) for s in range(n)] for k in range(3)]
    xs = [ins[k][r].to(dev) for k in range(3)]
    g_in = ins[0][r].to(dev) * 2  # not one of xs: those are being reduced in place, unwaited
    m = torch.randn(512, 512, device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        works = [sh.all_reduce_async(x) for x in xs]
        gath = sh.all_gather_async(g_in, out=torch.empty(n * g_in.numel(), device=dev))
        m = m @ m  # compute queued on the caller's stream meanwhile
    except RuntimeError as e:
        errors.append(f"cuda async collectives synchronised the host: {e}")
        return
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k, w in enumerate(works):
        _check(f"cuda all_reduce_async {k}", w.wait().cpu(), _reduce(ins[k], "sum"), errors, 1e-5)
    _check("cuda all_gather_async", gath.wait().cpu(), torch.cat([x * 2 for x in ins[0]]), errors, 1e-6)
    big = [_data(90 + s, (CHUNK // 4 + 12_345,), torch.float32) for s in range(n)]
    _check("cuda all_reduce over a chunk", sh.all_reduce(big[r].to(dev)).cpu(), _reduce(big, "sum"), errors, 1e-5)
    rs = sh.reduce_scatter_async(big[r][:n * 1000].to(dev))
    _check("cuda reduce_scatter_async", rs.wait().cpu(), _reduce([b[:n * 1000] for b in big], "sum").chunk(n)[r],
           errors, 1e-5)


def test_bench_comm_shared_column(tmp_path, capsys):
    """``shardlab bench comm --transport process_group,shared``: a shared column beside the
    backend's, recording the backend's (ring-model) bytes (of one call, also where ``--burst``
    times calls back to back); a bad transport fails before spawning."""
    import json

    from shardlab import cli
    out = tmp_path / "comm.json"
    assert cli.main(["bench", "comm", "--nproc", "2", "--ops", "all_reduce,all_to_all,sendrecv", "--sizes", "4K",
                     "--algorithms", "backend,ring", "--transport", "process_group,shared", "--iters", "1",
                     "--warmup", "0", "--burst", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "shared" in text and "2 calls back to back per sample" in text
    got = json.loads(out.read_text())["rows"]
    assert {r["burst"] for r in got} == {2}
    rows = {(r["op"], r["algorithm"]): r["sent_per_rank"] for r in got}
    # sendrecv has no algorithm choice: the backend's column and the shared one only
    assert set(rows) == {(op, a) for op in ("all_reduce", "all_to_all") for a in ("backend", "ring", "shared")} \
        | {("sendrecv", "backend"), ("sendrecv", "shared")}
    assert rows[("all_reduce", "shared")] == rows[("all_reduce", "backend")] == 4096
    assert rows[("sendrecv", "shared")] == rows[("sendrecv", "backend")] == 4096  # one message of 4 KiB
    assert cli.main(["bench", "comm", "--transport", "nvlink"]) == 2
    assert "--transport" in capsys.readouterr().err


@pytest.mark.parametrize("transport, places, want", [
    ("auto", [("h/1", "cuda:0"), ("h/1", "cuda:0")], True),      # N ranks on one GPU
    ("auto", [("h/1", "cuda:0"), ("h/1", "cuda:1")], False),     # one GPU each: NCCL
    ("auto", [("h/1", "cuda:0"), ("g/2", "cuda:0")], False),     # two hosts
    ("auto", [("h/1", "cpu"), ("h/1", "cpu")], X86),             # CPU, one host: the counter barrier's x86-64
    ("auto", [("h/1", "cpu"), ("g/2", "cpu")], False),           # CPU, two hosts: gloo
    ("process_group", [("h/1", "cpu"), ("h/1", "cpu")], False),
    ("shared", [("h/1", "cpu"), ("h/1", "cpu")], True),
    ("process_group", [("h/1", "cuda:0"), ("h/1", "cuda:0")], False),
    ("shared", [("h/1", "cpu"), ("g/2", "cpu")], "spans hosts"),
])
def test_transport_choice(transport, places, want):
    mesh = Mesh(Topology(dp_shard=2), 0, torch.device("cpu"), members={"dp": [0, 1], "tp": [0]},
                transport=transport, places=places)
    assert mesh._shared("tp") is False
    if transport == "auto" and places[0][1] == "cpu":  # an own algorithm asked for keeps the process group
        mesh.algorithm = "ring"
        assert mesh._shared("dp") is False
        mesh.algorithm = "backend"
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            mesh._shared("dp")
    else:
        assert mesh._shared("dp") is want


def _late_peer_worker(ctx, done):
    """Rank 1 sets the arena up with rank 0, then skips a collective and a message: rank 0's waits
    must end at the group's timeout (run's timeout_s, 3 s), naming what is missing."""
    import os
    import time
    sh = SharedComm("g", dist.group.WORLD, [0, 1], ctx.rank, Ledger())
    sh.all_reduce(torch.ones(4))
    if ctx.rank == 1:  # alive, but never arrives, until rank 0 is done (at most 20 s)
        t0 = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        return None
    out = {"timeout_s": sh.timeout_s}
    for what, call in (("barrier", lambda: sh.all_reduce(torch.ones(4))),
                       ("p2p", lambda: sh.irecv(torch.empty(4), 1).wait())):
        t0 = time.monotonic()
        try:
            call()
            out[what] = ("returned", time.monotonic() - t0)
        except RuntimeError as e:
            out[what] = (str(e), time.monotonic() - t0)
    open(done, "w").close()
    return out


def test_shared_waits_end_at_the_group_timeout(tmp_path):
    out = run(_late_peer_worker, 2, str(tmp_path / "done"), timeout_s=3)[0]
    assert out["timeout_s"] == 3.0
    msg, took = out["barrier"]
    assert "group ranks [1] did not arrive in 3 s" in msg and 3 <= took < 6, out
    msg, took = out["p2p"]
    assert "recv from group rank 1: no progress" in msg and 3 <= took < 6, out
