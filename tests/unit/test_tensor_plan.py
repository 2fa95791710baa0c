"""Tensor-parallel checks that need no processes: the plan, config errors, the tp=1 no-op."""
import pytest
import torch

from shardlab.config import Config, ConfigError, ModelConfig
from shardlab.distributed.mesh import Mesh
from shardlab.distributed.placement import Placement, replicas
from shardlab.models import build_model
from shardlab.models.llama import TP_PLAN as LLAMA_TP_PLAN
from shardlab.parallel import tensor


def test_plan_styles_exist_and_patterns_match_the_model():
    assert set(LLAMA_TP_PLAN.values()) <= set(tensor.STYLES)
    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2), seed=0)
    names = [n for n, _ in model.named_modules()]
    from fnmatch import fnmatchcase
    for pattern in LLAMA_TP_PLAN:
        assert any(fnmatchcase(n, pattern) for n in names), pattern
    # "layers.*.attention" must hit the attention modules only, not their children or the norms
    hits = [n for n in names if fnmatchcase(n, "layers.*.attention")]
    assert hits == ["layers.0.attention", "layers.1.attention"]


@pytest.mark.parametrize("model,tp,field", [
    (dict(n_heads=4, d_model=32), 8, "parallel.tp"),                      # heads not divisible
    (dict(n_heads=12, n_kv_heads=3, d_model=96), 4, "model.n_kv_heads"),  # 3 kv heads over 4 ranks
    (dict(n_heads=4, d_model=32, ffn_hidden=90), 4, "model.ffn_hidden"),
])
def test_check_names_the_field(model, tp, field):
    with pytest.raises(ConfigError) as e:
        tensor.check(ModelConfig(**model), tp)
    assert e.value.field == field


def test_kv_heads_replicated_when_tp_exceeds_them_is_accepted():
    tensor.check(ModelConfig(n_heads=8, n_kv_heads=2, d_model=64), 4)


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    cfg = Config()
    cfg.model = ModelConfig(d_model=32, n_heads=4, max_seq_len=30)
    cfg.parallel.tp, cfg.parallel.sequence_parallel, cfg.train.seq_len = 4, True, 30
    cfg.train.global_batch = 4
    with pytest.raises(ConfigError) as e:
        cfg.validate(4)
    assert e.value.field == "train.seq_len"


def test_tp1_is_a_no_op():
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2)
    model = build_model(cfg.model, seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert tensor.apply(model, Mesh.single(), cfg, LLAMA_TP_PLAN) is model
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_replicated_kv_slices_count_once_in_the_grad_norm():
    class FakeMesh:
        world_size = 8
        def size(self, name):
            return {"tp": 4}[name]
    pl = Placement("w", (16, 8), 0, 0, 4, ("tp",), copies=2)
    assert replicas(pl, FakeMesh()) == 4   # 2 dp copies x 2 tp ranks holding the same kv head
