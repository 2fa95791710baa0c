"""The planner's price of PyTorch's FSDP2 (``--fsdp2``, analysis/plan_features.py
``fsdp2_copy_bytes``) against the bytes FSDP2 itself moves on the compute stream: a tiny Llama
wrapped as torchtitan wraps it (``fully_shard`` on each block, then the root) with bf16 parameters
and an fp32 reduction, one forward + backward on 2 gloo ranks, the bytes read and written by the
all-gather copy-out (``fsdp::split_with_sizes_copy``) and the reduce-scatter copy-in
(``fsdp::chunk_cat``) counted as they run. The planner's side comes from its own memory model of
the same config (plan_memory.model_state: the gathered and reduce-scattered bytes of the units),
not from FSDP2's buffers."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardlab.analysis.plan_features import fsdp2_copy_bytes
from shardlab.analysis.plan_memory import model_state
from shardlab.config import Config
from shardlab.launch import run

COPIES = {"split_with_sizes_copy": "copy_out", "chunk_cat": "copy_in"}


class _Copies(TorchDispatchMode):
    """Bytes read + written by FSDP2's two copy operators, by kind."""

    def __init__(self):
        super().__init__()
        self.bytes = {"copy_out": 0, "copy_in": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = COPIES.get(func.overloadpacket.__name__) if func.namespace == "fsdp" else None
        if kind:  # out= operators: the inputs are read, the out tensors written
            ts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in ts)
        return out


def _cfg() -> Config:
    cfg = Config()
    m = cfg.model
    m.arch, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden = "llama", 256, 64, 2, 4, 2, 128
    m.max_seq_len = cfg.train.seq_len = 16
    cfg.train.precision, cfg.train.param_dtype, cfg.train.reduce_dtype = "bf16", "bf16", "fp32"
    cfg.train.global_batch = 2
    cfg.parallel.zero_stage, cfg.parallel.dp_shard = 3, 2
    return cfg


def _worker(ctx, cfg):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardlab.models.spec import build_model, get_spec
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_model(cfg.model, 0)
    for block in get_spec(cfg.model).blocks(model).values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len))
    with _Copies() as c:
        model(x, x).backward()
    return c.bytes


def test_fsdp2_moves_the_priced_bytes():
    cfg = _cfg()
    mem = model_state(cfg)
    got = run(_worker, 2, cfg, timeout_s=180)
    gathered, reduced, root = mem["gathered_total"], mem["reduce_total"], mem["root_gathered"]
    assert 0 < root < gathered
    for b in got:
        # copy-out: every block unit gathered twice (forward, backward), the root once, each read + written
        assert b["copy_out"] == pytest.approx(2 * (2 * (gathered - root) + root), rel=0.01), (b, gathered, root)
        # copy-in: the bf16 gradients read, the fp32 reduce-scatter input written
        assert b["copy_in"] == pytest.approx(gathered + reduced, rel=0.01), (b, gathered, reduced)
        assert b["copy_out"] + b["copy_in"] == pytest.approx(fsdp2_copy_bytes(gathered, reduced, 2, root), rel=0.01)
