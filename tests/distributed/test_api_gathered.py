"""``shardlab.zero.GatheredParameters`` (DeepSpeed's ``deepspeed.zero.GatheredParameters``) on a
ZeRO-3 engine, 2 ranks, float64: inside it ``engine.module`` holds the trained values (equal to a
plain single-process torch loop); with ``modifier_rank`` an edit made by that rank is what the
next steps train from (equal to the plain loop with the same edit); without it edits are dropped.
Outside it, ``state_dict`` / ``save_pretrained`` of the placeholders is refused in one line (it
wrote a model of empty tensors without a word)."""
import pytest
import torch

import shardlab
from shardlab import launch
from tests.distributed.test_api import PARITY_ATOL, config, make_model, reference, train

EDIT_AT, TOTAL = 2, 4


def plain_with_edit():
    """The plain loop of test_api.reference, with blocks.0.fc.weight set to 0.25 after EDIT_AT steps
    (the optimizer's moments kept, as the engine keeps them)."""
    def edit(step, model):
        if step == EDIT_AT:
            with torch.no_grad():
                model.blocks[0].fc.weight.fill_(0.25)
    return reference(TOTAL, edit)


def _worker(ctx):
    engine = shardlab.initialize(make_model(0), config(3, "blocks", 1))
    train(engine, 0, EDIT_AT)
    out = {}
    try:
        engine.module.state_dict()
    except RuntimeError as e:
        out["refused"] = str(e)
    with shardlab.zero.GatheredParameters(engine.module.parameters()):
        out["inside"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
        engine.module.blocks[1].fc.weight.data.fill_(9.0)  # read-only: dropped on exit
    out["sizes_after"] = [p.numel() for p in engine.module.parameters()]
    with shardlab.zero.GatheredParameters(engine.module.blocks[0].fc.weight, modifier_rank=0):
        engine.module.blocks[0].fc.weight.data.fill_(0.25 if ctx.rank == 0 else -7.0)  # rank 0's is kept
    train(engine, EDIT_AT, TOTAL)
    out["final"] = engine.full_state_dict()
    return out


def test_gathered_parameters_read_and_modify():
    got = launch.run(_worker, 2, timeout_s=60)
    ref_at_edit, ref_final = reference(EDIT_AT), plain_with_edit()
    for r in (0, 1):
        assert "GatheredParameters" in got[r]["refused"] and "\n" not in got[r]["refused"]
        inside = got[r]["inside"]
        assert set(inside) == set(ref_at_edit)
        for k, v in ref_at_edit.items():  # every rank holds the whole trained value inside
            assert (inside[k] - v).abs().max() <= PARITY_ATOL, (r, k)
        assert got[r]["sizes_after"] and all(n == 0 for n in got[r]["sizes_after"])  # placeholders again
    final = got[0]["final"]
    assert not torch.equal(final["blocks.1.fc.weight"], torch.full_like(final["blocks.1.fc.weight"], 9.0))
    for k, v in ref_final.items():
        assert (final[k] - v).abs().max() <= PARITY_ATOL, k


def _modifier_worker(ctx):
    engine = shardlab.initialize(make_model(0), config(3, "blocks", 1))
    with pytest.raises(ValueError, match="modifier_rank"):
        with shardlab.zero.GatheredParameters(engine.module.parameters(), modifier_rank=5):
            pass
    with shardlab.zero.GatheredParameters(engine.module.parameters(), enabled=False):
        sizes = [p.numel() for p in engine.module.parameters()]
    return sizes


def test_gathered_parameters_bad_modifier_and_disabled():
    got = launch.run(_modifier_worker, 2, timeout_s=60)
    assert all(n == 0 for n in got[0]) and got[0] == got[1]
    with pytest.raises(AttributeError, match="shardlab.initialize shards it"):
        shardlab.zero.Init()


def _hf_worker(ctx, directory):
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    engine = shardlab.initialize(LlamaForCausalLM(cfg).double(), {"parallel": {"zero_stage": 3},
                                 "train": {"precision": "fp64", "lr": 1e-2, "warmup_steps": 0, "device": "cpu"}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with shardlab.zero.GatheredParameters(engine.module.parameters()):
        if ctx.rank == 0:
            engine.module.save_pretrained(directory)
    dist.barrier()
    return engine.full_state_dict()


def test_save_pretrained_under_zero3(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM
    full = launch.run(_hf_worker, 2, str(tmp_path), timeout_s=120)[0]
    back = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).state_dict()
    assert set(full) <= set(back)
    for k, v in full.items():
        assert v.numel() > 0 and torch.equal(back[k], v), k
