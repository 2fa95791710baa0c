"""Meta-device construction: no rank draws (materialises) a tensor, or a part of one, that it does
not own. Every initial value is drawn through ``models.spec.init_box``; the workers record each
call (name, global shape, box sizes) and the checks below compare them with what each layout
must own, counted independently from the model's shapes."""
import math

import pytest
import torch

from shardlab import config as C
from shardlab import launch
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.topology import Topology
from shardlab.models import count_params, meta_model
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "max_seq_len": 16}
LAYOUTS = {
    "fsdp2": ({"dp_shard": 2, "zero_stage": 3}, {}),
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2, "microbatches": 2}, {}),
    "ep2": ({"ep": 2, "dp_shard": 2}, {"n_experts": 4, "moe_top_k": 2}),
}


def _cfg(name):
    par, model = LAYOUTS[name]
    cfg = C.from_dict({"model": {**MODEL, **model}, "parallel": par,
                       "train": {"seq_len": 16, "global_batch": 4, "precision": "fp64"}})
    return cfg.validate(cfg.parallel.world_size)


def _worker(ctx, cfg):
    import shardlab.models.spec as L
    from shardlab.parallelize import parallelize

    calls, real = [], L.init_box

    def spy(name, shape, std, seed, offsets=None, sizes=None, *a, **k):
        calls.append((name, tuple(shape), tuple(sizes if sizes is not None else shape)))
        return real(name, shape, std, seed, offsets, sizes, *a, **k)
    L.init_box = spy
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device)
    engine = parallelize(meta_model(cfg.model, torch.float64), mesh, cfg)
    assert not any(p.is_meta for p in engine.parameters())
    return calls


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_rank_draws_what_it_does_not_own(name):
    cfg = _cfg(name)
    calls = launch.run(_worker, cfg.parallel.world_size, cfg, timeout_s=120)
    full = {n: tuple(p.shape) for n, p in meta_model(cfg.model).named_parameters()}
    drawn = [{} for _ in calls]
    for r, rank_calls in enumerate(calls):
        for n, shape, sizes in rank_calls:
            assert shape == full[n], (n, shape)
            drawn[r][n] = drawn[r].get(n, 0) + math.prod(sizes)
    if name == "fsdp2":   # every element drawn exactly once over the two ranks, half each
        total = count_params(meta_model(cfg.model))
        assert sum(sum(d.values()) for d in drawn) == total
        assert all(sum(d.values()) <= math.ceil(total / 2) + 2 for d in drawn)
    elif name == "tp2":   # sharded weights: half each; norms (replicated) whole
        for d in drawn:
            for n, k in d.items():
                whole = math.prod(full[n])
                assert k == (whole if n.endswith("norm.weight") else whole // 2), n
    elif name == "pp2":   # each stage draws only its own tensors; together, all of them once
        names = [set(d) for d in drawn]
        assert not names[0] & names[1] and names[0] | names[1] == set(full)
        assert all(k == math.prod(full[n]) for d in drawn for n, k in d.items())
    elif name == "ep2":   # experts: half of each expert tensor per rank; the rest replicated
        for d in drawn:
            for n, k in d.items():
                whole = math.prod(full[n])
                assert k == (whole // 2 if ".experts." in n else whole), n
    for d in drawn:       # nothing drawn twice, nothing beyond the tensor
        assert all(k <= math.prod(full[n]) for n, k in d.items())
