"""Bad command lines argparse or the commands catch: one line naming the argument and the fix on
stderr, exit 2, nothing run (tests/unit/test_config.py holds the mistyped-option cases)."""
import pytest

from shardlab.cli import main as cli_main


@pytest.mark.parametrize("argv, expected", [
    (["train", "configs/tiny.toml", "--nproc", "two"],
     "shardlab train: argument --nproc: invalid int value: 'two' (see shardlab train --help)"),
    (["plan", "llama-8b", "--gpus", "8", "--efficiency", "fit"],
     "shardlab plan: argument --efficiency: invalid choice: 'fit' (choose from 'stated', 'fitted') "
     "(see shardlab plan --help)")])
def test_argparse_errors_are_one_line(argv, expected, capsys):
    """argparse printed its whole usage block before the error; the usage is in --help."""
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == expected


@pytest.mark.parametrize("argv, expected", [
    (["train", "configs/tiny.toml", "--run-dir", "", "--dry-run"],
     "config error: --run-dir: is empty; give a directory, or drop it for logging.run_dir"),
    (["plan", "llama-8b", "--gpus", "8", "--layout", " "],
     "config error: --layout: is empty; give a layout, e.g. --layout \"fsdp8 tp8 mb1x8\", or drop it to search")])
def test_empty_arguments_are_refused(argv, expected, capsys):
    """An empty --run-dir was ignored (the run went to the config's directory) and an empty
    --layout ran the whole search."""
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip() == expected


def test_a_command_s_warning_is_one_line(tmp_path, capsys):
    """A DeepSpeed key shardlab ignores was shown as Python shows warnings ("…/schema.py:367:
    UserWarning: …" and the source line under it); now one line starting "warning: "."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}')
    assert cli_main(["train", str(ds), "--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: DeepSpeed config: not supported by shardlab, ignored: "
                   "zero_optimization.zero_hpz_partition_size"], err
