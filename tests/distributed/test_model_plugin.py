"""An architecture shardlab has never seen, defined only in this file, plugged in through
``model.arch = "test_model_plugin:TOY"`` (no file of shardlab changes) and run through the parity
matrix: data parallel, ZeRO-2, FSDP, tensor + sequence parallel and the pipeline all equal an
independent single-process float64 run of it. Parallelisms its spec leaves out are refused."""
import pytest
import torch.nn.functional as F
from torch import nn

from shardlab import config as C
from shardlab.analysis import verify
from shardlab.errors import ConfigError
from shardlab.models import ModelSpec, get_spec
from shardlab.train.data import prepare
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

ARCH = "test_model_plugin:TOY"


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.up = nn.Linear(d, 2 * d, bias=False)
        self.mlp.act = nn.GELU()
        self.mlp.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, positions):
        return x + self.mlp(self.norm(x))


class Loss(nn.Module):
    def forward(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class ToyLM(nn.Module):
    """A token MLP-mixer-free 'language model': embedding, residual MLP blocks, norm, head."""

    def __init__(self, cfg):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg.d_model) for i in range(cfg.n_layers)})
        self.norm_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.criterion = Loss()

    def forward(self, tokens, targets=None, positions=None):
        h = self.emb(tokens) if self.emb is not None else tokens
        for block in self.layers.values():
            h = block(h, positions)
        if self.head is None:
            return h
        logits = self.head(self.norm_f(h))
        return logits if targets is None else self.criterion(logits, targets)


def _std(name, shape, cfg):
    if "norm" in name:
        return None if name.endswith("weight") else 0.0
    return cfg.init_std


TOY = ModelSpec(
    name="toy", build=ToyLM, init_std=_std,
    flops_per_token=lambda cfg, seq: 6.0 * cfg.n_layers * 4 * cfg.d_model ** 2,
    blocks=lambda m: {f"layers.{k}": b for k, b in m.layers.items()},
    tp_plan={"emb": "vocab_embedding", "layers.*.norm": "sequence_parallel_norm", "layers.*.mlp": "gather_input",
             "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise", "norm_f": "sequence_parallel_norm",
             "head": "vocab_output", "criterion": "vocab_parallel_loss"},
    pp_first=("emb",), pp_last=("norm_f", "head"), ffn_dim=lambda cfg: 2 * cfg.d_model,
    verify_model={"n_kv_heads": 0, "tie_embeddings": False})

LAYOUTS = ["dp", "zero2", "fsdp", "tp2", "tp2-sp", "pp2-1f1b"]


def test_plugin_architecture_passes_the_parity_matrix():
    assert get_spec(ARCH) is TOY
    data_dir = str(prepare(verify.layout_config("dp", 2, 2, ARCH).data))
    rows = verify.run_layouts(LAYOUTS, 2, data_dir, 2, {}, arch=ARCH)
    assert [r["layout"] for r in rows] == LAYOUTS
    for r in rows:
        assert r["ok"], r
        assert r["loss_diff"] <= verify.TOL and r["param_diff"] <= verify.TOL


@pytest.mark.parametrize("key,value,field", [("cp", 2, "parallel.cp"), ("activation_checkpointing", "selective",
                                                                          "parallel.activation_checkpointing")])
def test_what_the_spec_leaves_out_is_refused(key, value, field):
    cfg = C.Config()
    cfg.model.arch, cfg.train.seq_len = ARCH, 32
    setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError) as e:
        cfg.validate(cfg.parallel.world_size)
    assert e.value.field == field and "model.arch=toy" in str(e.value)
