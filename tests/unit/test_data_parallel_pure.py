"""Pure checks of the data-parallel helpers: memory formula, buckets, flat-parameter layout."""
import torch
from torch import nn

from shardlab.analysis.measured_memory import formula
from shardlab.parallel.ddp import make_buckets
from shardlab.parallel.zero import FlatParam


def test_zero_formula_matches_paper_table():
    psi, n = 7_500_000_000, 64  # the ZeRO paper's example: 7.5B params, 64 GPUs
    gb = lambda s: formula(psi, n, s, "mixed").total / 1e9
    assert round(gb(0)) == 120 and round(gb(1), 2) == 31.41 and round(gb(2), 2) == 16.64
    assert round(gb(3), 2) == 1.88


def test_buckets_reverse_order_and_cap():
    ps = [nn.Parameter(torch.zeros(100)) for _ in range(5)]  # 400 bytes each
    b = make_buckets(ps, cap_bytes=900)
    assert [[id(p) for p in bk] for bk in b] == [[id(ps[4]), id(ps[3])], [id(ps[2]), id(ps[1])], [id(ps[0])]]


def test_flat_param_padding_and_views():
    ps = [torch.arange(6.0).view(2, 3), torch.arange(5.0)]
    for n in (1, 2, 3, 4):
        f = FlatParam(["a", "b"], ps, n, n - 1, 0.0)
        assert f.padded % n == 0 and f.padded - f.total < n
        flat = f.flatten(ps)
        assert [torch.equal(v, p) for v, p in zip(f.views(flat), ps)] == [True, True]
        assert f.own(flat).numel() == f.shard_size


def test_fsdp_mixed_precision_keeps_fp32_masters():
    """bf16 compute copies, fp32 shards and fp32 gradients; loss close to the fp32 model's."""
    from shardlab.config import Config
    from shardlab.distributed.mesh import Mesh
    from shardlab.models import build_model
    from shardlab.parallel.fsdp import FSDPEngine

    torch.set_num_threads(1)
    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 64, 32, 2, 4
    cfg.model.max_seq_len, cfg.train.precision, cfg.parallel.zero_stage = 16, "bf16", 3
    tok = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = tok[:, :-1], tok[:, 1:]
    want = float(build_model(cfg.model, 1)(x, y))
    engine = FSDPEngine(build_model(cfg.model, 1), Mesh.single(), cfg)
    loss = float(engine.forward_backward([(x, y)]))
    assert abs(loss - want) < 2e-2
    assert all(f.full.dtype == torch.bfloat16 and f.shard.dtype == torch.float32 for f in engine.flats)
    assert all(f.shard.grad.dtype == torch.float32 and f.shard.grad.abs().sum() > 0 for f in engine.flats)
    assert engine.gathered_bytes == 0  # every unit freed after backward


def test_memory_command_prints_every_stage(tmp_path, capsys):
    import argparse

    from shardlab.commands import memory_cmd as memory

    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 64\nd_model = 32\nn_layers = 2\nn_heads = 4\nmax_seq_len = 16\n"
                    "[train]\nseq_len = 16\nglobal_batch = 4\n[parallel]\nzero_stage = 3\n")
    parser = argparse.ArgumentParser()
    memory.configure(parser)  # the command's own options and defaults
    args = parser.parse_args([str(path), "--nproc", "4", "--no-run", "--device", "cpu"])
    args.overrides = []
    assert memory.main(args) == 0
    out = capsys.readouterr().out
    assert "4 data-parallel ranks" in out and "ZeRO-3  mixed" in out and "predicted per rank" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:2] in (["0", "0"], ["1", "0"], ["2", "0"], ["3", "0"])]
    assert len(rows) == 4 and all(float(r[5]) > 0 for r in rows), out  # one row per rank, activations > 0
