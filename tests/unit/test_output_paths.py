"""A file a command writes at its end (a plot, a timeline, a JSON of measurements) is checked
before its work starts: a missing folder, a directory, or another suffix is one line naming the
flag, exit 2, and nothing runs. Each of these used to end a finished command in a traceback
(FileNotFoundError, matplotlib's ValueError), its result unwritten."""
from pathlib import Path

import pytest

from shardlab.cli import main as cli_main

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
COMMANDS = {  # flag, argv before it, the suffix it takes
    "schedule --out": (["schedule", "--pp", "2", "--microbatches", "4"], "--out", ".png"),
    "plot --out": (["plot", "RUN"], "--out", ".png"),
    "plan --plot": (["plan", "llama-8b", "--gpus", "8"], "--plot", ".png"),
    "bench comm --json": (["bench", "comm", "--nproc", "2", "--sizes", "1K", "--iters", "1"], "--json", ".json"),
    "bench comm --plot": (["bench", "comm", "--nproc", "2", "--sizes", "1K", "--iters", "1"], "--plot", ".png"),
    "memory --timeline": (["memory", TINY, "--nproc", "2"], "--timeline", ".png"),
    # a safetensors file written as x.pt or x.bin (it was) fails later in torch.load, far from here
    "checkpoint export --to": (["checkpoint", "export", "RUN"], "--to", ".safetensors"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_output_path_is_refused_before_the_work(command, tmp_path, capsys, monkeypatch):
    argv, flag, suffix = COMMANDS[command]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "start", "step": 0}\n')
    argv = [str(run) if a == "RUN" else a for a in argv]
    monkeypatch.setattr("shardlab.launch.run", lambda *a, **k: pytest.fail("ranks were started"))
    cases = {tmp_path / "no" / f"x{suffix}": f"the folder {tmp_path / 'no'} does not exist; create it or write elsewhere",
             run: f"{run} is a directory; give a file, e.g. {run / ('out' + suffix)}",
             tmp_path / "x.txt": f"give a {suffix} file"}
    for path, why in cases.items():
        assert cli_main([*argv, flag, str(path)]) == 2, path
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"config error: {flag}: ") and err.endswith(why) and "\n" not in err, err
    assert not (tmp_path / "no").exists() and not (tmp_path / "x.txt").exists()
