"""model.arch: picking an architecture, plug-ins by import path, and the one-line errors."""
import pytest

from shardlab import config as C
from shardlab.cli import main as cli_main
from shardlab.errors import ConfigError
from shardlab.models import get_spec, specs


def test_unknown_arch_is_one_line_exit_2(capsys):
    assert cli_main(["train", "configs/tiny.toml", "--nproc", "1", "--model.arch=llamma"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.arch" in err and "did you mean 'llama'" in err


def test_unimportable_plugin_names_the_field():
    with pytest.raises(ConfigError) as e:
        get_spec("no_such_package.models:SPEC")
    assert e.value.field == "model.arch"


def test_plugin_must_be_a_model_spec():
    with pytest.raises(ConfigError) as e:
        get_spec("shardlab.models.spec:register")
    assert e.value.field == "model.arch" and "not a ModelSpec" in str(e.value)


def test_every_registered_arch_validates_its_defaults():
    for name, spec in specs().items():
        assert spec.name == name or ":" in name  # plug-ins are registered by import path
        cfg = C.Config()
        cfg.model.arch = name
        if spec.task == "classify":
            cfg.data.dataset = "fashion-mnist"
        cfg.validate(1)
