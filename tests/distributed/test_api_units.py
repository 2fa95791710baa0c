"""ZeRO-3 units of a user model (``wrap_policy = blocks``, units.block_units): a transformers Llama
with untied embeddings gets its embedding and output head as units of their own beside the
decoder layers, and trains equal to plain single-process torch (fp64, 2 ranks, 3 AdamW steps),
the tied one keeps them in the root unit and trains equal too."""
import pytest
import torch

import shardlab
from shardlab import launch

LR, STEPS = 1e-2, 3


def _model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).double().train()


def _ids(step):
    return torch.randint(0, 640, (4, 8), generator=torch.Generator().manual_seed(step))


def _worker(ctx):
    out = {}
    for tied in (False, True):
        engine = shardlab.initialize(_model(tied), {
            "parallel": {"zero_stage": 3},
            "train": {"precision": "fp64", "lr": LR, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
                      "min_lr_ratio": 1.0, "device": "cpu"}})
        rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
        for s in range(STEPS):
            x = _ids(s)[rows]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        out[tied] = ([u.name for u in engine.engine.units[1:]], engine.full_state_dict(everywhere=True))
    return out


def _reference(tied: bool):
    model = _model(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for s in range(STEPS):
        x = _ids(s)  # each rank's mean loss over its 2 rows, averaged over the 2 ranks
        loss = (model(input_ids=x[:2], labels=x[:2]).loss + model(input_ids=x[2:], labels=x[2:]).loss) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def test_embedding_and_head_units_train_as_plain_torch():
    pytest.importorskip("transformers")
    got = launch.run(_worker, 2, timeout_s=180)[0]
    layers = ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert got[False][0] == ["model.embed_tokens", *layers, "lm_head"]
    assert got[True][0] == layers
    for tied in (False, True):
        ref = _reference(tied)
        for k, v in got[tied][1].items():
            assert (v - ref[k]).abs().max() <= 1e-10, (tied, k)
