"""The planner's per-rank model state is the engines' own: it asks them for their ownership rules
(``zero.flat_groups`` and ``zero.shard_size``, ``units.unit_params``, ``pipeline.sharded.shard_group``)
instead of restating them, and its parameter, gradient and optimizer bytes equal what the engines
hold after a real step, on sizes that no shard group divides (every flat buffer padded)."""
import pytest

from shardlab.analysis import calibrate as cal
from shardlab.analysis.plan_memory import model_state
from shardlab.analysis.verify import layout_config
from shardlab.models import build_model, count_params

FP32 = {"precision": "fp32", "seq_len": 8, "global_batch": 12}
# odd sizes: vocabulary 97, MLP 45; d_model 32 for N = 3 (3 does not divide the embedding), 30 (3
# heads of 10) for N = 4 (4 divides no d_model x k with k odd)
ODD3 = {"vocab_size": 97, "d_model": 32, "ffn_hidden": 45, "max_seq_len": 8}
ODD4 = {"vocab_size": 97, "d_model": 30, "n_heads": 3, "n_kv_heads": 1, "ffn_hidden": 45, "max_seq_len": 8}
LAYOUTS = {  # nproc -> (layout, parallel overrides, train overrides)
    3: (ODD3, [("zero1", {"bucket_cap_mb": 0.005}, {}), ("zero2", {"bucket_cap_mb": 0.005}, {}),
               ("zero1", {}, {"param_dtype": "bf16"}), ("fsdp", {}, {}), ("fsdp", {"wrap_policy": "size:2000"}, {})]),
    4: (ODD4, [("pp2-zero1", {"microbatches": 2}, {}), ("pp2-fsdp", {"microbatches": 2}, {}),
               # bf16 stages, fp32 masters (pipeline/sharded.py): the default fp32 reduce and a bf16 one
               ("pp2-zero1", {"microbatches": 2}, {"param_dtype": "bf16"}),
               ("pp2-fsdp", {"microbatches": 2}, {"param_dtype": "bf16", "reduce_dtype": "bf16"}),
               ("ep2-fsdp", {}, {}), ("ep2-zero2", {"bucket_cap_mb": 0.005}, {})]),
}


@pytest.mark.parametrize("nproc", sorted(LAYOUTS))
def test_planned_model_state_equals_the_engines(nproc):
    model, rows = LAYOUTS[nproc]
    cfgs = []
    for name, par, train in rows:
        cfg = layout_config(name, nproc, extra={"model": model, "train": {**FP32, **train}, "parallel": par})
        assert cfg is not None, name
        cfgs.append(cfg)
    padded = [c for c in cfgs if c.parallel.zero_stage == 1 and c.parallel.pp == 1 and not c.train.param_dtype]
    for cfg in padded:  # the sizes exercise the padding: a ZeRO-1 rank holds more than 4 psi
        assert model_state(cfg)["params"] > 4 * count_params(build_model(cfg.model, 0)), cfg.parallel
    for cfg, ranks in zip(cfgs, cal.measure_layouts(cfgs, nproc, warmup=1, steps=0)):
        for m in ranks:
            want = model_state(cfg, m.stage)
            assert (want["params"], want["grads"], want["optim"]) == (m.params, m.grads, m.optim), \
                (cfg.parallel, cfg.train.param_dtype, m.rank)
