"""LoRA under data parallel, ZeRO-1/2/3, the pipeline and tensor (+ sequence) parallel equals one
process (float64): the base weights stay frozen (bit-equal to their initial values), only adapters
train and hold optimizer state, checkpoints under ZeRO/FSDP keep the frozen base."""
import pytest
import torch

from shardlab import config as C
from shardlab.analysis import verify
from shardlab.errors import ConfigError
from shardlab.models import lora
from shardlab.train.data import prepare
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

LORA = {"train": {"lora_rank": 4, "lora_alpha": 8.0,
                  "lora_targets": ["layers.*.attention.wq", "layers.*.attention.wo", "layers.*.feed_forward.*"]}}
LAYOUTS = ["dp", "zero1", "zero2", "fsdp", "pp2-1f1b", "tp2", "tp2-sp"]  # TP: column and row adapters


def test_lora_layouts_match_one_process():
    cfg = verify.layout_config("dp", 2, 2, extra=LORA)
    data_dir = str(prepare(cfg.data))
    rows = verify.run_layouts(LAYOUTS, 2, data_dir, 2, {}, extra=LORA)
    for r in rows:
        assert r["ok"], r  # every parameter, frozen base included, equals the reference
    # the reference itself: base bit-equal to its initial values, adapters moved
    start = verify.reference_model(cfg)
    _, end = verify.reference(cfg, data_dir, 2)
    for name, p in start.named_parameters():
        if lora.is_adapter(name):
            assert not torch.equal(p.detach(), end[f"model.{name}"]), name
        else:
            assert torch.equal(p.detach(), end[f"model.{name}"]), name
    assert any(lora.is_adapter(n) for n, _ in start.named_parameters())


def test_only_adapters_take_gradients_and_optimizer_state():
    cfg = verify.layout_config("dp", 1, 1, extra=LORA)
    model = verify.reference_model(cfg)
    loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    loss.backward()
    opt = verify.reference_adamw(model, cfg.train)
    opt.step()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert {id(p) for p in opt.state} == {id(p) for n, p in model.named_parameters() if n in trainable}


@pytest.mark.parametrize("override,field", [({"lora_targets": ["nothing.*"]}, "train.lora_targets"),
                                             ({"lora_rank": -1}, "train.lora_rank")])
def test_bad_lora_settings_name_the_field(override, field):
    cfg = C.from_dict({"train": {"lora_rank": 4, **override}})
    with pytest.raises(ConfigError) as e:
        cfg.validate(1)
        verify.reference_model(cfg)
    assert e.value.field == field


def test_adapter_dropout_with_tensor_parallel_is_refused():
    cfg = C.from_dict({"train": {"lora_rank": 4, "lora_dropout": 0.1}, "parallel": {"tp": 2}})
    with pytest.raises(ConfigError) as e:
        cfg.validate(2)
    assert e.value.field == "train.lora_dropout"


def _base_then_lora(ctx, base_cfg, lora_cfg, directory):
    """Train the base 1 step and save; a LoRA trainer resumes from that base checkpoint (no adapter
    keys in it) and runs 1 step. Returns what the test compares."""
    from pathlib import Path
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.topology import Topology
    from shardlab.models.spec import init_tensor
    from shardlab.train.data import TokenData
    from shardlab.train.loop import Trainer
    data = TokenData(directory["data"])
    mesh = Mesh.build(Topology.from_config(base_cfg.parallel))
    base = Trainer(base_cfg, mesh, data)
    base.train_step()
    from shardlab.checkpoint.save import latest_valid
    base.save_checkpoint(Path(directory["ckpt"]))
    path = latest_valid(Path(directory["ckpt"]))  # every rank (save returns the path on rank 0 only)
    base_state = base.engine.full_state(base.optimizer, everywhere=True)
    base_eval = base.evaluate([base.loader.val_batches(1)[0]])
    mesh2 = Mesh.build(Topology.from_config(lora_cfg.parallel))
    tr = Trainer(lora_cfg, mesh2, data, init=False)
    tr.load_checkpoint(path)
    start = tr.engine.full_state(tr.optimizer, everywhere=True)
    lora_eval = tr.evaluate([tr.loader.val_batches(1)[0]])
    name = next(n for n in tr.adapter_shapes if n.endswith("lora_A"))
    drawn = init_tensor(name, tr.adapter_shapes[name], lora_cfg.model, lora_cfg.train.seed, torch.float64)
    tr.train_step()
    end = tr.engine.full_state(tr.optimizer, everywhere=True)
    return base_state, base_eval, start, lora_eval, name, drawn, end, tr.step


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_lora_on_a_base_checkpoint_without_adapters(tmp_path, layout):
    """Adapters added on top of a base checkpoint start from their seeded initial values (B = 0:
    the same function, the same loss), the base weights come from the checkpoint and stay frozen."""
    from shardlab import launch
    base_cfg = verify.layout_config(layout, 2, 3)
    lora_cfg = verify.layout_config(layout, 2, 3, extra=LORA)
    directory = {"data": str(prepare(base_cfg.data)), "ckpt": str(tmp_path / "ck")}
    base_state, base_eval, start, lora_eval, name, drawn, end, step = \
        launch.run(_base_then_lora, 2, base_cfg, lora_cfg, directory, timeout_s=120)[0]
    assert step == 2 and lora_eval == base_eval
    for k, v in base_state.items():
        if k.startswith("model."):
            assert torch.equal(start[k], v) and torch.equal(end[k], v), k  # loaded, then frozen
    assert torch.equal(start[f"model.{name}"], drawn)
    assert not torch.equal(end[f"model.{name}"], drawn)  # the adapter trained


def test_cli_lora_targets_matching_nothing_is_one_line_exit_2(tmp_path, capsys):
    """``shardlab train configs/tiny.toml --train.lora_targets=nothing.*``: one stderr line naming
    the field, exit 2, no traceback, nothing trained."""
    from pathlib import Path
    from shardlab.cli import main
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    assert main(["train", tiny, "--train.lora_rank=4", "--train.lora_targets=nothing.*", "--train.steps=1",
                 f"--logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.lora_targets" in err and "nothing.*" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
