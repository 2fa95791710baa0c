"""shardlab.initialize honours ``parallel.activation_checkpointing`` and ``parallel.compile`` on a
user model (before 2026-12-07 both were accepted and silently did nothing), and has DeepSpeed's
``engine.compile``: each layout equals the plain single-process torch AdamW loop of test_api.py
(float64, <= 1e-10), the repeated blocks really are recomputed (their inner Linear runs twice
a step), the module really is compiled; what cannot apply is one ConfigError naming the field."""
import pytest
import torch
from torch import nn

import shardlab
from shardlab import launch
from shardlab.errors import ConfigError
from tests.distributed.test_api import PARITY_ATOL, STEPS, config, make_model, reference, train

CASES = [  # name, ZeRO stage, parallel fields, who compiles (engine.compile or the model's own) with which backend
    ("ddp, ac full", 0, {"activation_checkpointing": "full"}, None),
    ("zero3, ac op", 3, {"activation_checkpointing": "op"}, None),
    ("zero3, ac full, compile", 3, {"activation_checkpointing": "full", "compile": True}, None),
    ("zero3, compile each block", 3, {"compile": True, "compile_scope": "blocks"}, None),
    ("zero2, engine.compile", 2, {}, "engine:aot_eager"),
    ("zero3, engine.compile", 3, {}, "engine:aot_eager"),
    # your own model.compile() after initialize: before 2026-12-07 dynamo traced ZeRO-3's hooks and failed
    ("zero3, your model.compile()", 3, {}, "own:aot_eager"),
]


def _worker(ctx):
    out = {}
    for name, stage, extra, backend in CASES:
        cfg = config(stage, "blocks", 1)
        cfg["parallel"].update(extra)
        model = make_model(0)
        calls = [0]
        for block in model.blocks:
            block.fc.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        engine = shardlab.initialize(model, cfg)
        who, _, name_of_backend = (backend or "").partition(":")
        if who == "engine":
            engine.compile(backend=name_of_backend)
        elif who == "own":
            model.compile(backend=name_of_backend)
        train(engine, 0, STEPS)
        compiled = (engine.is_compiled or who == "own") and any(
            m._compiled_call_impl is not None for m in (model, *model.blocks))
        out[name] = (engine.full_state_dict(everywhere=True), calls[0] / (STEPS * len(model.blocks)), compiled)
    return out


def test_recompute_and_compile_of_a_user_model_match_plain_torch():
    results = launch.run(_worker, 2, timeout_s=300)
    ref = reference(STEPS)
    for name, stage, extra, backend in CASES:
        full, fc_calls_per_step, compiled = results[0][name]
        for k in ref:
            assert (full[k] - ref[k]).abs().max() <= PARITY_ATOL, (name, k)
        recomputed = extra.get("activation_checkpointing", "none") != "none"
        assert fc_calls_per_step == (2 if recomputed else 1), (name, fc_calls_per_step)
        assert compiled == (extra.get("compile", False) or backend is not None), name


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x).relu())


@pytest.mark.parametrize("mode, model, words", [
    ("selective", make_model, "attention cores"),
    ("full", Flat, "Flat has no repeated blocks"),
])
def test_recomputation_that_cannot_apply_is_refused(mode, model, words):
    with pytest.raises(ConfigError) as e:
        shardlab.initialize(model() if model is Flat else model(0), {"parallel": {"activation_checkpointing": mode}})
    assert e.value.field == "parallel.activation_checkpointing" and words in str(e.value), str(e.value)


def test_deepcompile_arguments_are_refused():
    engine = shardlab.initialize(make_model(0), {})
    for kwargs, field in (({"schedule": [(0, "pass")]}, "schedule"), ({"compiled_autograd_enabled": True},
                                                                       "compiled_autograd_enabled")):
        with pytest.raises(ConfigError) as e:
            engine.compile(**kwargs)
        assert e.value.field == field
    assert not engine.is_compiled


def test_a_deepspeed_activation_checkpointing_section_recomputes_nothing():
    """In DeepSpeed the section configures deepspeed.checkpointing calls in the model's code;
    initialize takes a DeepSpeed JSON that has one as DeepSpeed does (shardlab train: full)."""
    ds = {"train_batch_size": 4, "activation_checkpointing": {"partition_activations": False},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = shardlab.initialize(Flat(), ds)  # no repeated blocks: full would be refused
    assert engine.cfg.parallel.activation_checkpointing == "none"


@pytest.mark.parametrize("section, field, value, words", [
    ("train", "lora_rank", 8, "add them to yours"),
    ("train", "fault_tolerance", "replica", "live recovery"),
    ("train", "detect_anomaly", "first_module", "set_detect_anomaly"),
])
def test_loop_only_fields_are_refused_by_name(section, field, value, words):
    with pytest.raises(ConfigError) as e:
        shardlab.initialize(make_model(0), {section: {field: value}})
    assert e.value.field == f"{section}.{field}" and words in str(e.value), str(e.value)


def test_compile_scope_blocks_compiles_each_block():
    model = make_model(0)
    engine = shardlab.initialize(model, {"parallel": {"compile": True, "compile_scope": "blocks"}})
    assert engine.is_compiled and model._compiled_call_impl is None
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    with pytest.raises(ConfigError) as e:
        shardlab.initialize(Flat(), {"parallel": {"compile": True, "compile_scope": "blocks"}})
    assert e.value.field == "parallel.compile_scope" and "use model" in str(e.value)
