"""Config: loading, overrides, validation errors that name the field and the fix."""
import dataclasses
import json

import pytest

from shardlab import config as C
from shardlab.cli import main as cli_main


def test_every_field_has_a_docstring():
    for section in C.SECTIONS.values():
        for fl in dataclasses.fields(section):
            assert fl.metadata.get("doc"), f"{section.__name__}.{fl.name} has no docstring"


def test_toml_json_and_overrides(tmp_path):
    (tmp_path / "a.toml").write_text("[model]\nd_model = 64\nn_heads = 2\n[train]\nlr = 0.01\n")
    cfg = C.load(tmp_path / "a.toml", ["--train.lr=1e-4", "--parallel.tp", "2", "--parallel.compile=false"])
    assert cfg.model.d_model == 64 and cfg.train.lr == 1e-4 and cfg.parallel.tp == 2
    (tmp_path / "b.json").write_text(json.dumps({"model": {"n_layers": 3}, "logging": {"progress": False}}))
    cfg = C.load(tmp_path / "b.json")
    assert cfg.model.n_layers == 3 and cfg.logging.progress is False


@pytest.mark.parametrize("overrides,world,field,fragment", [
    (["--parallel.tp=2"], 4, "parallel", "set --nproc 2"),
    (["--model.n_heads=3"], 1, "model.n_heads", "does not divide d_model"),
    (["--parallel.tp=8", "--model.n_heads=4"], 8, "parallel.tp", "does not divide model.n_heads"),
    (["--parallel.pp=8"], 8, "parallel.pp", "cannot fill"),
    (["--parallel.pp=2", "--parallel.microbatches=1"], 2, "parallel.microbatches", "use >= 2"),
    (["--train.global_batch=6", "--parallel.dp_replicate=4"], 4, "train.global_batch", "multiple of 4"),
    (["--parallel.ep=2", "--parallel.dp_shard=2"], 2, "parallel.ep", "MoE"),
    (["--train.precision=fp8"], 1, "train.precision", "fp32"),
    (["--parallel.pp_schedule=1f1c"], 1, "parallel.pp_schedule", "did you mean '1f1b'"),
])
def test_validate_names_field_and_fix(overrides, world, field, fragment):
    with pytest.raises(C.ConfigError) as e:  # per-field ranges at load, cross-field checks at validate
        C.load(None, overrides).validate(world)
    assert e.value.field == field
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_keys_did_you_mean():
    with pytest.raises(C.ConfigError, match="did you mean 'lr'"):
        C.load(None, ["--train.lrr=1"])
    with pytest.raises(C.ConfigError, match="did you mean 'parallel'"):
        C.from_dict({"paralel": {"tp": 2}})
    with pytest.raises(C.ConfigError, match="expected int"):
        C.load(None, ["--parallel.tp=two"])


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("[model]\nn_heads = 3\n")
    assert cli_main(["config", "show", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.n_heads" in err
    assert cli_main(["train", str(tmp_path / "bad.toml"), "--nproc", "1"]) == 2
    assert cli_main(["config", "show", "configs/tiny.toml", "--train.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.5  # Peak learning rate." in out


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_train_refuses_fewer_than_one_rank(nproc, capsys):
    """--nproc 0 used to fall back to the degrees' product (0 read as unset); now one line, exit 2."""
    assert cli_main(["train", "configs/tiny.toml", "--nproc", nproc, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("config error: --nproc: must be >= 1")


def test_presets_validate():
    from pathlib import Path
    presets = sorted(Path(__file__).parents[2].glob("configs/*.toml"))
    assert presets
    for p in presets:
        C.load(p).validate()


@pytest.mark.parametrize("argv", [["plot", "runs/none", "--model.d_model=64"],
                                  ["schedule", "--pp", "2", "--microbatches", "4", "--train.lr=1"],
                                  ["checkpoint", "inspect", "runs/none", "--parallel.tp=2"]])
def test_commands_without_a_config_refuse_overrides(argv, capsys):
    """A --section.key=value a command would ignore is refused in one line naming it (exit 2)."""
    from shardlab.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and argv[-1].split("=")[0] in err and "takes no" in err


@pytest.mark.parametrize("zero, line", [("0", "dp_replicate = 2"), ("3", "dp_shard = 2")])
def test_config_show_spreads_a_config_without_degrees_over_nproc_as_train_does(zero, line, capsys, tmp_path):
    """configs/tiny.toml gives no degrees; `shardlab train --nproc 2` runs it data-parallel, while
    `config show --nproc 2` refused it ("the job has 2 processes")."""
    argv = ["configs/tiny.toml", "--nproc", "2", f"--parallel.zero_stage={zero}"]
    assert cli_main(["config", "show", *argv]) == 0
    assert any(ln.startswith(line + "  #") for ln in capsys.readouterr().out.splitlines())
    assert cli_main(["train", *argv, "--dry-run", "--run-dir", str(tmp_path / "r")]) == 0
    assert f"layout {line.replace(' = ', '=')}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["doctor", "--jsn"], "config error: --jsn: unknown option of shardlab doctor (did you mean '--json'?)"),
    (["train", "configs/tiny.toml", "--nprocs", "2", "--dry-run"],
     "config error: --nprocs: unknown option of shardlab train (did you mean '--nproc'?); "
     "config overrides are written --section.key=value"),
    (["plan", "llama-8b", "--gpus", "8", "--globalbatch=8"],
     "config error: --globalbatch: unknown option of shardlab plan (did you mean '--global-batch'?)"),
    (["doctor", "--zzzzzzzz"], "config error: --zzzzzzzz: unknown option of shardlab doctor; its options: "
     "--json --no-ranks --nproc --timeout")])
def test_a_mistyped_option_is_named_with_the_closest_one(argv, expected, capsys):
    """An unknown option without a dot used to be called a malformed override ("overrides are
    written --section.key=value"), also on commands that take none (doctor, plan)."""
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip() == expected


def test_initialize_checks_the_declared_ranges():
    """shardlab.initialize's config path refuses out-of-range fields like validate() does."""
    from shardlab.api import resolve_config
    with pytest.raises(C.ConfigError) as e:
        resolve_config({"train": {"lr": -1.0}}, 2)
    assert e.value.field == "train.lr" and "must be > 0" in str(e.value)


@pytest.mark.parametrize("degrees", [{"tp": 2, "dp_replicate": 2}, {"pp": 2, "dp_replicate": 2, "microbatches": 2},
                                     {"ep": 2, "dp_shard": 2}])
def test_ddp_reduce_dtype_outside_plain_data_parallel_is_refused_before_launch(degrees):
    """A rank used to raise NotImplementedError after the launch; now validate() names the field."""
    from shardlab.config import Config
    cfg = Config()
    cfg.train.reduce_dtype = "bf16"
    for k, v in degrees.items():
        setattr(cfg.parallel, k, v)
    if "ep" in degrees:
        cfg.model.n_experts = 2
    with pytest.raises(C.ConfigError) as e:
        cfg.validate()
    assert e.value.field == "train.reduce_dtype"
    cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.ep = 1
    cfg.model.n_experts = 0
    cfg.validate()  # plain data parallel keeps it
