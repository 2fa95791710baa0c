"""Differentiable collectives: every forward and gradient equals a single-process computation
of the same global function (plain torch cat/sum/chunk on all ranks' data, float64)."""
import torch
import torch.distributed as dist

from shardlab import launch
from shardlab.distributed import autograd as dc
from shardlab.distributed.collectives import Comm
from shardlab.distributed.ledger import Ledger

TOL = 1e-12


def _data(tag: int, r: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * tag + r)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _grad(fn, *inputs):
    """Run fn on leaf copies of inputs and return (output, grads)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward()
    return [x.grad for x in leaves]


def _check(name, got, want, errors):
    if got.shape != want.shape or not torch.allclose(got, want, atol=TOL, rtol=0):
        errors.append(f"{name}: max err {(got - want).abs().max() if got.shape == want.shape else got.shape}")


def _worker(ctx):
    errors = []
    for algorithm in ("backend", "ring"):   # the backend's collectives and shardlab's own
        errors += [f"{algorithm}: {e}" for e in _checks(ctx, algorithm)]
    return errors


def _checks(ctx, algorithm):
    n, r = ctx.world_size, ctx.rank
    comm = Comm("world", dist.group.WORLD, list(range(n)), r, Ledger(), algorithm)
    errors = []
    shape = (2 * n, 3 * n)
    ws = [_data(1, s, shape) for s in range(n)]          # rank-specific output weights
    w = _data(2, 0, shape)                                # replicated output weight

    # copy_to_region: x replicated, L = sum_s <w_s, x>
    x = _data(3, 0, shape)
    (gx,) = _grad(lambda x: (dc.copy_to_region(x, comm) * ws[r]).sum(), x)
    (ref,) = _grad(lambda x: sum((x * ws[s]).sum() for s in range(n)), x)
    _check("copy_to_region", gx, ref, errors)

    # reduce_from_region: x_s partial, y = sum_s x_s replicated, L = <w, y>
    xs = [_data(4, s, shape) for s in range(n)]
    y = dc.reduce_from_region(xs[r], comm)
    _check("reduce_from_region fwd", y, sum(xs), errors)
    (gx,) = _grad(lambda x: (dc.reduce_from_region(x, comm) * w).sum(), xs[r])
    ref = _grad(lambda *xs: (sum(xs) * w).sum(), *xs)[r]
    _check("reduce_from_region", gx, ref, errors)

    for dim in (0, 1, -1):
        # scatter_to_region: x replicated, y_s = chunk_s(x), L = sum_s <chunk_s(ws_s), y_s>
        x = _data(5, 0, shape)
        wc = [ws[s].chunk(n, dim)[s] for s in range(n)]
        (gx,) = _grad(lambda x: (dc.scatter_to_region(x, comm, dim) * wc[r]).sum(), x)
        (ref,) = _grad(lambda x: sum((x.chunk(n, dim)[s] * wc[s]).sum() for s in range(n)), x)
        _check(f"scatter_to_region dim={dim}", gx, ref, errors)

        # gather_from_region: x_s slices, y = cat replicated, L = <W, y>
        xs = [_data(6, s, shape) for s in range(n)]
        W = torch.cat([w] * n, dim)
        _check(f"gather_from_region fwd dim={dim}", dc.gather_from_region(xs[r], comm, dim), torch.cat(xs, dim), errors)
        (gx,) = _grad(lambda x: (dc.gather_from_region(x, comm, dim) * W).sum(), xs[r])
        ref = _grad(lambda *xs: (torch.cat(xs, dim) * W).sum(), *xs)[r]
        _check(f"gather_from_region dim={dim}", gx, ref, errors)

        # all_gather (sequence parallel): y_s = cat(x) on each rank, L = sum_s <W_s, y_s>
        Ws = [torch.cat([ws[s]] * n, dim) * (s + 1) for s in range(n)]
        (gx,) = _grad(lambda x: (dc.all_gather(x, comm, dim) * Ws[r]).sum(), xs[r])
        ref = _grad(lambda *xs: sum((torch.cat(xs, dim) * Ws[s]).sum() for s in range(n)), *xs)[r]
        _check(f"all_gather dim={dim}", gx, ref, errors)

        # reduce_scatter: y_s = chunk_s(sum x), L = sum_s <chunk_s(ws_s), y_s>
        xs = [_data(7, s, shape) for s in range(n)]
        _check(f"reduce_scatter fwd dim={dim}", dc.reduce_scatter(xs[r], comm, dim), sum(xs).chunk(n, dim)[r], errors)
        (gx,) = _grad(lambda x: (dc.reduce_scatter(x, comm, dim) * wc[r]).sum(), xs[r])
        ref = _grad(lambda *xs: sum((sum(xs).chunk(n, dim)[s] * wc[s]).sum() for s in range(n)), *xs)[r]
        _check(f"reduce_scatter dim={dim}", gx, ref, errors)

    # all_to_all with uneven (and zero) splits: rank s sends splits[s][t] rows to rank t
    splits = [[(s * 3 + t * 2 + 1) % 4 for t in range(n)] for s in range(n)]
    xs = [_data(8, s, (sum(splits[s]), 5)) for s in range(n)]
    in_s, out_s = splits[r], [splits[s][r] for s in range(n)]
    wy = [_data(9, s, (sum(splits[t][s] for t in range(n)), 5)) for s in range(n)]

    def global_a2a(*xs):
        pieces = [x.split(splits[s]) for s, x in enumerate(xs)]
        return [torch.cat([pieces[s][t] for s in range(n)]) for t in range(n)]

    _check("all_to_all fwd", dc.all_to_all(xs[r], comm, in_s, out_s), global_a2a(*xs)[r], errors)
    (gx,) = _grad(lambda x: (dc.all_to_all(x, comm, in_s, out_s) * wy[r]).sum(), xs[r])
    ref = _grad(lambda *xs: sum((y * wy[t]).sum() for t, y in enumerate(global_a2a(*xs))), *xs)[r]
    _check("all_to_all", gx, ref, errors)
    return errors


def test_autograd_collectives_match_single_process():
    for errors in launch.run(_worker, 3):
        assert errors == []


def test_group_of_one_is_identity():
    comm = Comm("tp", None, [0], 0, Ledger())
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    for f in (dc.copy_to_region, dc.reduce_from_region, dc.all_to_all):
        assert f(x, comm) is x
    for f in (dc.scatter_to_region, dc.gather_from_region, dc.all_gather, dc.reduce_scatter):
        assert f(x, comm, 1) is x
