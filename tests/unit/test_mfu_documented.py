"""MFU that cannot pass 100% for every config a documented ``shardlab train`` command uses
(README.md, docs/*.md and the Makefile; a config documented later is picked up by the same scan).

Why this is a real check, not a run at tiny scale (whose MFU would be a few percent whatever the
accounting): the reported MFU is FLOPs per token x tokens/s / peak. The peak cannot be beaten by
construction: a datasheet dense peak on a GPU, and on CPU the best matmul rate of this machine
(test_mfu.py), which a run that beats it replaces by its own rate (MFU 100%, said in the label).
A report above 100% can therefore only come from the numerator counting work the step does not
do (``make finetune`` reported 106%: 6 N for a LoRA run whose frozen weights get no weight
gradient). So for each documented config, at its documented size, the FLOPs per token shardlab
reports are compared with torch's FlopCounterMode count of one forward + backward of the very
model the run trains (LoRA adapters and frozen weights included): on the meta device (shapes
only, nothing computed: under a second even for 480M parameters) for dense transformers; MoE
routing and the CNN need values, and those configs are tiny: they run on CPU. The count may not
exceed torch's by more than 3% (the only work counted but not run: the first block's input
gradient under LoRA, the embedding needs none)."""
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardlab import config as C
from shardlab.errors import ConfigError
from shardlab.models import build_model
from shardlab.models.spec import add_adapters, get_spec, meta_model
from shardlab.train.metrics import flops_per_token

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]


def documented_configs() -> list[str]:
    found = set()
    for path in DOCS:
        found.update(re.findall(r"shardlab train (?:\S*/)?(configs/[\w.-]+\.toml)", path.read_text()))
    return sorted(found)


def _counted_per_token(cfg) -> float:
    """torch's FLOPs of one training step (forward + backward) per token (an image: per image)."""
    m, t = cfg.model, cfg.train
    spec = get_spec(m)
    on_meta = spec.task == "lm" and not m.n_experts
    model = meta_model(m) if on_meta else build_model(m, seed=0)
    if t.lora_rank:
        add_adapters(model, t)  # the base weights are frozen, as in the run
    dev = "meta" if on_meta else "cpu"
    if spec.task == "lm":
        x = torch.zeros(1, t.seq_len, dtype=torch.long, device=dev)
        if not on_meta:
            x = torch.randint(0, m.vocab_size, (1, t.seq_len), generator=torch.Generator().manual_seed(0))
        n, args = t.seq_len, (x, x)
    else:
        n = 4
        args = (torch.randn(n, 1, 28, 28), torch.randint(0, m.n_classes, (n,)))
    with FlopCounterMode(display=False) as fc:
        out = model(*args)
        (out if out.dim() == 0 else out.float().mean()).backward()
    return fc.get_total_flops() / n


def test_the_scan_finds_the_documented_configs():
    found = documented_configs()
    assert {"configs/tiny.toml", "configs/smollm2-lora.toml", "configs/tiny-moe.toml",
            "configs/cnn-fashion-mnist.toml"} <= set(found), found
    assert all((ROOT / c).exists() for c in found), found


@pytest.mark.parametrize("path", documented_configs())
def test_reported_flops_per_token_never_exceed_what_the_step_computes(path):
    cfg = C.load(ROOT / path)
    if cfg.checkpoint.base:  # the model's shape comes from the base (the run resolves it the same way)
        from shardlab.train.finetune import resolve_base
        try:
            resolve_base(cfg)
        except ConfigError as e:
            pytest.skip(f"{path}: base model not installed here ({e})")
    ours = flops_per_token(cfg.model, cfg.train.seq_len, cfg.train)
    counted = _counted_per_token(cfg)
    assert 0 < ours <= 1.03 * counted, (path, ours, counted, ours / counted)
