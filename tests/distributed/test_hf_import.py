"""An imported Hugging Face Llama (GQA, tied and untied) under tensor parallel (tp=2) and FSDP
(dp_shard=2, ZeRO-3), and untied under a 2-stage 1f1b pipeline (pp=2): each rank loads only its
slices -- straight from the HF directory (``engine.load_pieces(HFReader(dir), None)``) or from
the checkpoint ``shardlab checkpoint import`` wrote -- and the loss equals the loss computed from
transformers' own logits."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from shardlab import launch  # noqa: E402
from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.config import Config  # noqa: E402
from shardlab.distributed.mesh import Mesh  # noqa: E402
from shardlab.distributed.topology import Topology  # noqa: E402
from shardlab.models import meta_model  # noqa: E402
from shardlab.models.hf import HFReader  # noqa: E402
from shardlab.parallelize import parallelize  # noqa: E402
from shardlab.checkpoint import save as ckpt  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check: ranks validate too)

TOL = 2e-5
LAYOUTS = {"tp2": {"tp": 2}, "fsdp2": {"dp_shard": 2, "zero_stage": 3}}


def _batch():
    t = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(7))
    return t[:, :-1], t[:, 1:]


def _rank(ctx, hf_dir, ck_dir, layout):
    reader = HFReader(hf_dir)
    cfg = Config()
    cfg.model = reader.cfg
    for k, v in LAYOUTS[layout].items():
        setattr(cfg.parallel, k, v)
    cfg.train.seq_len, cfg.train.global_batch = 16, 2 * (2 if "dp_shard" in LAYOUTS[layout] else 1)
    cfg.validate(2)
    mesh = Mesh.build(Topology.from_config(cfg.parallel))
    x, y = _batch()
    out = {}
    for source in ("hf", "ckpt"):
        engine = parallelize(meta_model(cfg.model), mesh, cfg, init=False)
        boxes = []
        src = reader if source == "hf" else ckpt.Reader(f"{ck_dir}/step_00000000")
        read = src.read

        def spy(key, offsets=None, sizes=None, dtype=None, read=read):
            boxes.append((key, tuple(sizes) if sizes is not None else None))
            return read(key, offsets, sizes, dtype)
        src.read = spy
        engine.load_pieces(src, None)
        with torch.no_grad():
            out[source] = float(engine.model(x, y))
        out[f"{source}_boxes"] = boxes
    return out


def _saved_and_imported(tmp_path, seed: int, rope_theta: float, tie: bool) -> float:
    """A tiny random GQA Llama saved by transformers to tmp_path/hf and imported to tmp_path/ck;
    returns transformers' loss on :func:`_batch`."""
    torch.manual_seed(seed)
    c = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, rope_theta=rope_theta,
                                 tie_word_embeddings=tie, max_position_embeddings=64, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    hf.save_pretrained(tmp_path / "hf")
    assert cli_main(["checkpoint", "import", str(tmp_path / "hf"), "--to", str(tmp_path / "ck")]) == 0
    x, y = _batch()
    with torch.no_grad():
        return float(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_imported_llama_loss_equals_transformers(tmp_path, layout, tie):
    want = _saved_and_imported(tmp_path, seed=0, rope_theta=500000.0, tie=tie)
    for rank, got in enumerate(launch.run(_rank, 2, str(tmp_path / "hf"), str(tmp_path / "ck"), layout,
                                          timeout_s=120)):
        assert abs(got["hf"] - want) <= TOL and abs(got["ckpt"] - want) <= TOL, (rank, got["hf"], got["ckpt"], want)
        wq = [s for k, s in got["hf_boxes"] if k == "model.layers.0.attention.wq.weight"]
        if layout == "tp2":  # each rank read its half of the query heads, no more
            assert wq == [(16, 32)], wq


def _rank_pp(ctx, hf_dir, ck_dir):
    """pp=2 (1f1b, 2 micro-batches) from the imported checkpoint: the step-0 loss (forward_backward,
    before any update) and the keys this rank read."""
    reader = ckpt.Reader(f"{ck_dir}/step_00000000")
    cfg = Config()
    cfg.model = HFReader(hf_dir).cfg
    cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.microbatches = 2, "1f1b", 2
    cfg.train.seq_len, cfg.train.global_batch = 16, 2
    cfg.validate(2)
    mesh = Mesh.build(Topology.from_config(cfg.parallel))
    engine = parallelize(meta_model(cfg.model), mesh, cfg, init=False)
    keys = []

    class Spy(type(reader)):  # both ways a load reads a piece (checkpoint/pieces.py: read_into when offered)
        def read(self, key, *args, **kwargs):
            keys.append(key)
            return super().read(key, *args, **kwargs)

        def read_into(self, key, *args, **kwargs):
            keys.append(key)
            return super().read_into(key, *args, **kwargs)
    reader.__class__ = Spy
    engine.load_pieces(reader, None)
    x, y = _batch()
    loss = engine.global_loss(engine.forward_backward(list(zip(x.chunk(2), y.chunk(2)))))
    return dict(loss=loss, keys=sorted(set(keys)), stage=mesh.coords["pp"])


def test_imported_llama_pp2_1f1b_step0_loss_equals_transformers(tmp_path):
    """An imported untied GQA Llama under a 2-stage 1f1b pipeline: the step-0 loss equals
    transformers' on the same batch (fp32, 1e-5) and each rank read only its stage's tensors."""
    want = _saved_and_imported(tmp_path, seed=1, rope_theta=10000.0, tie=False)
    got = launch.run(_rank_pp, 2, str(tmp_path / "hf"), str(tmp_path / "ck"), timeout_s=120)
    for r in got:
        assert abs(r["loss"] - want) <= 1e-5, (r["loss"], want)
    first, last = sorted(got, key=lambda r: r["stage"])
    assert "model.tok_embeddings.weight" in first["keys"] and "model.layers.0.attention.wq.weight" in first["keys"]
    assert not any(k.startswith(("model.layers.1.", "model.output.", "model.norm.")) for k in first["keys"]), first
    assert "model.output.weight" in last["keys"] and "model.layers.1.attention.wq.weight" in last["keys"]
    assert not any(k.startswith(("model.layers.0.", "model.tok_embeddings.")) for k in last["keys"]), last
