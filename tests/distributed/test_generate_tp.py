"""``shardlab generate --tp``: a tiny random Llama (GQA: 2 kv heads for 4 query heads, untied) and
a tiny GPT-2 (tied), saved as Hugging Face directories and generated from at tp=2 in float64. Each
step's full logits equal the single-process model's within 1e-10, greedy tokens are equal, the KV
cache (local heads only) equals recomputation under tp=2, and seeded sampling picks the tokens
tp=1 picks. A tp that does not divide the heads is one line, exit 2, before any rank starts."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from shardlab import launch  # noqa: E402
from shardlab.cli import main as cli_main  # noqa: E402
from shardlab.commands.generate_cmd import sharded_model  # noqa: E402
from shardlab.models.generate import generate  # noqa: E402
from shardlab.models.pretrained import load_model  # noqa: E402

TOL = 1e-10
V, N, PROMPT = 67, 6, [5, 17, 3, 44, 9]   # vocab 67: not divisible by 2 (a padded vocab slice)
SAMPLE = dict(temperature=0.9, top_k=20, seed=11)
RUNS = {"greedy": dict(use_cache=True), "greedy_nocache": dict(use_cache=False),
        "sampled": dict(use_cache=True, **SAMPLE)}


def _hf_dir(path, arch):
    torch.manual_seed(0)
    if arch == "llama":
        c = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(c)
    else:
        c = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                    bos_token_id=0, eos_token_id=0)
        hf = transformers.GPT2LMHeadModel(c)
    with torch.no_grad():  # randomise every tensor (HF inits norms to ones, biases to zeros)
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.5)
    hf.save_pretrained(path)
    return str(path)


def _runs(model, cfg, comm=None):
    return {name: generate(model, PROMPT, N, max_len=cfg.max_seq_len, keep_logits=True, comm=comm,
                           vocab_size=cfg.vocab_size, **kw) for name, kw in RUNS.items()}


def _rank(ctx, dirs):
    out = {}
    for arch, d in dirs.items():
        model, cfg, comm = sharded_model(d, 2, torch.float64)
        runs = _runs(model, cfg, comm)
        out[arch] = {name: (g.tokens, torch.stack(g.logits)) for name, g in runs.items()}
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_tp")
    return {arch: _hf_dir(root / arch, arch) for arch in ("llama", "gpt2")}


def test_tp2_generation_equals_single_process(dirs):
    results = launch.run(_rank, 2, dirs, timeout_s=120)
    for arch, d in dirs.items():
        model, cfg, _ = load_model(d, torch.float64)
        ref = {name: (g.tokens, torch.stack(g.logits)) for name, g in _runs(model, cfg).items()}
        assert ref["greedy"][0] == ref["greedy_nocache"][0]
        for rank, got in enumerate(results):
            for name in RUNS:
                tokens, logits = got[arch][name]
                assert logits.shape == (N, V), (arch, name, logits.shape)
                err = float((logits - ref[name][1]).abs().max())
                assert err <= TOL, (arch, name, rank, err)
                assert tokens == ref[name][0], (arch, name, rank, tokens, ref[name][0])
            cache_err = float((got[arch]["greedy"][1] - got[arch]["greedy_nocache"][1]).abs().max())
            assert cache_err <= TOL, (arch, rank, cache_err)  # tp=2: KV cache of local heads == recompute
        assert results[0][arch] is not None and all(  # both ranks picked the same tokens
            results[0][arch][n][0] == results[1][arch][n][0] for n in RUNS)
        assert len(set(ref["sampled"][0])) > 1  # sampling really sampled something non-trivial


def test_tp_not_dividing_heads_is_one_line_exit_2(dirs, capsys):
    assert cli_main(["generate", dirs["llama"], "--prompt", "hi", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--tp" in err and "tp=3" in err, err
