"""Every shell command in README.md and docs/*.md still works as written.

The commands are extracted from the fenced code blocks (``$ ``-prefixed lines where a block is a
transcript, else every line that starts with a command word; ``\\`` continuations joined,
``# comments`` dropped). Each one gets one of four checks, all in a fresh working directory
holding only links to configs/, examples/ and benchmarks/:

- RUN: run for real, in process, with small step counts appended (``--train.steps=2``,
  ``--max-new-tokens`` at most 4); the train/resume/inspect/export sequence shares one directory,
  as a reader following the page does (the README's ``--launcher ray`` example gets DRY here and
  runs from relative paths in tests/distributed/test_ray.py: ``DRY_BECAUSE``).
- DRY: every ``shardlab train`` not run: ``--dry-run`` (config, degrees, --resume, restart and
  Ray options: everything checked before a launch). A transcript's ``config error:`` line must be
  what the command prints, with exit code 2.
- PARSE: commands that take minutes, a GPU, a cluster or a prior run (``PARSE_ONLY``, each with its
  reason): the subcommand exists and every ``--flag`` is one of its options or a config key.
- FILE: ``python``/``bash`` scripts, ``make`` targets, pytest paths: the file / target exists and
  every ``--flag`` the docs pass appears in the script.
Synopsis lines (placeholders such as CONFIG, N, ``a|b``, ``[...]``) get PARSE.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shardlab import cli
from shardlab.config import Config

ROOT = Path(__file__).resolve().parents[1]
SKIP_LANGS = {"python", "py", "toml", "json", "text", "yaml", "ini"}

RUN = {  # exactly as written (+ small step counts), in this order, in one shared directory
    "shardlab train configs/tiny.toml --nproc 2",
    "shardlab train configs/tiny.toml --resume",
    "shardlab train configs/tiny.toml --nproc 2 --parallel.tp=2 --resume",
    "shardlab checkpoint inspect runs/tiny/checkpoints",
    "shardlab checkpoint verify runs/tiny/checkpoints",
    "shardlab checkpoint export runs/tiny/checkpoints --to tiny.safetensors",
    "shardlab generate runs/tiny/checkpoints --prompt ROMEO: --max-new-tokens 40",
    "shardlab config show configs/tiny.toml --train.lr=1e-3",
    "shardlab schedule --pp 4 --microbatches 8 --schedule zb-h1 --out zb.png",
    "shardlab schedule --pp 4 --microbatches 8 --schedule dualpipev",
    "shardlab plan llama-8b --gpus 8 --gpu h100 --global-batch 8 --seq 8192",
    "shardlab plan deepseek-v3 --gpus 2048 --gpu h800 --layout \"ddp128 ep64 pp16 dualpipev mb1x120 ac-full\" "
    "--dualpipe-overlap",
    "shardlab generate smollm2 --chat --prompt \"What is the capital of France?\" --max-new-tokens 20",
}
PARSE_ONLY = {  # command prefix -> why it is not run here
    "shardlab generate smollm2 --prompt 'KING RICHARD:'": "the same model as the chat generate that runs",
    "shardlab verify": "a parity matrix of every layout: minutes (tests/distributed/test_verify.py runs it)",
    "shardlab bench": "a benchmark: minutes (tests/unit/test_bench_comm.py runs a small one)",
    "shardlab memory": "a measured run per layout (tests/distributed/test_memory.py)",
    "shardlab doctor": "a 2-rank probe (tests/unit/test_doctor.py runs it)",
    "shardlab launch": "your own script as N ranks (tests/distributed/test_api_examples.py runs the examples)",
    "shardlab generate smollm2 --prompt 'The three": "the same model as the generate commands that run",
    "shardlab plan path/to/config.json": "path/to/config.json stands for your own Hugging Face config.json",
    "shardlab plan llama-405b": "16,384 GPUs: a long search",
    "shardlab plan deepseek-v3 --gpus 2048 --gpu h800 --pp 16": "a search over 326 MoE layouts: ~2 minutes "
                                                               "(tests/unit/test_planner_tiers.py runs one layout)",
    "shardlab checkpoint export runs/smollm2-lora": "needs the LoRA run of `make finetune` (minutes)",
    "shardlab checkpoint inspect runs/smollm2-lora": "needs the LoRA run of `make finetune` (minutes)",
    "shardlab generate runs/smollm2-lora": "needs the LoRA run of `make finetune` (minutes)",
    "shardlab schedule --pp 4 --microbatches 8 --schedule interleaved": "same code as the schedules that run",
}
DRY_BECAUSE = {  # a shardlab train that gets --dry-run here although it is quick, and where it runs
    "shardlab train configs/tiny.toml --nproc 2 --launcher ray --max-restarts 1":
        "Ray from a relative cache and run dir: tests/distributed/test_ray.py runs it (Ray takes ~25 s to start)",
}
NEEDS_STATE = {  # transcripts whose output depends on what the page did before
    "shardlab train configs/tiny.toml --nproc 2 --resume --model.d_model=64":
        "resumes the demo's run with another model (tests/distributed/test_resume_errors.py)",
    "shardlab train configs/tiny.toml --nproc 2 --train.lr=1e-3":
        "a second run into the demo's run directory (tests/distributed/test_resume_errors.py)",
    "shardlab train configs/tiny.toml --nproc 2 --logging.run_dir=runs/t --train.steps=4 --resume":
        "an interrupted run the page sets up first (tests/distributed/test_resume_errors.py)",
    "shardlab checkpoint verify runs/tiny/checkpoints/step_00000200":
        "a checkpoint the page damages on purpose (tests/unit/test_checkpoint_io.py)",
    "shardlab train configs/tiny.toml --nproc 2 --train.steps=30 --run-dir /tmp/bl --resume":
        "resumes the run of the line before it",
    "shardlab train configs/tiny.toml --nproc 4 --parallel.pp=2 --parallel.dp_replicate=2 --parallel.microbatches=2 "
    "--resume": "resumes the run of the line before it (the same resume runs in test_run_as_written)",
    "shardlab train configs/llama-480m-zero3.toml --nproc 8 --resume --train.steps=6":
        "resumes the 482M run of the line before it (16 GB, minutes: docs/benchmarks.md, Memory peaks)",
}


def _norm(text: str) -> str:
    """One spelling per command: quoting as shlex.join writes it."""
    return shlex.join(shlex.split(text))


RUN = {_norm(t) for t in RUN}
PARSE_ONLY = {_norm(k + ("'" if k.count("'") % 2 else "")).rstrip("'"): v for k, v in PARSE_ONLY.items()}


@dataclass
class Cmd:
    where: str
    text: str
    expect: list[str] = field(default_factory=list)  # a transcript's output lines


def extract() -> list[Cmd]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines, i = path.read_text().splitlines(), 0
        while i < len(lines):
            m = re.match(r"\s*```(\w*)", lines[i])
            if not m:
                i += 1
                continue
            j = next(k for k in range(i + 1, len(lines)) if lines[k].lstrip().startswith("```"))
            if m.group(1) not in SKIP_LANGS:
                out += _block(f"{path.relative_to(ROOT)}:{i + 2}", lines[i + 1:j])
            i = j + 1
    return out


def _is_command(line: str) -> bool:
    words = line.split()
    while words and re.match(r"^[A-Z_]+=\S*$", words[0]):  # VAR=value prefixes
        words = words[1:]
    return bool(words) and words[0] in ("shardlab", "make", "python", "torchrun", "bash")


def _block(where: str, body: list[str]) -> list[Cmd]:
    transcript = any(b.startswith("$ ") for b in body)
    cmds: list[Cmd] = []
    k = 0
    while k < len(body):
        line = body[k].strip()
        k += 1
        if transcript and not line.startswith("$ "):
            if cmds and line:
                cmds[-1].expect.append(line)
            continue
        line = line[2:] if line.startswith("$ ") else line
        if not _is_command(line):
            continue
        while line.endswith("\\") and k < len(body):
            line = line[:-1] + " " + body[k].strip()
            k += 1
        words = shlex.split(line, comments=True)
        while re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes: the environment, not the command
            words = words[1:]
        cmds.append(Cmd(where, shlex.join(words)))
    return cmds


COMMANDS = extract()
PLACEHOLDER = re.compile(r"(^|[\s=])([A-Z][A-Z_]*(:[A-Z]+)?)(\s|$|\.)|\||\[|\.\.\.")


def _synopsis(text: str) -> bool:
    return bool(PLACEHOLDER.search(text.split(" # ")[0]))


def _subparsers():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def _known(sub: str, flag: str) -> bool:
    if flag in _subparsers()[sub]._option_string_actions:
        return True
    section, _, key = flag[2:].partition(".")  # a --section.key override
    return bool(key) and hasattr(getattr(Config(), section, None), key.split(".")[0])


def check_parse(c: Cmd) -> None:
    words = shlex.split(c.text)
    sub = words[1].split("|")[0]
    assert sub in _subparsers(), f"{c.where}: no subcommand {sub!r}: {c.text}"
    for w in words[2:]:
        if w.endswith(".py"):  # shardlab launch SCRIPT args: the rest are the script's
            assert (ROOT / w).exists() or _synopsis(c.text), f"{c.where}: {w} does not exist"
            break
        flag = w.split("=")[0].strip("[]")
        if flag.startswith("--") and not _synopsis(flag) and flag != "--section.key":
            assert _known(sub, flag), f"{c.where}: shardlab {sub} has no option {flag}: {c.text}"


def check_file(c: Cmd) -> None:
    words = [w for w in shlex.split(c.text) if not re.match(r"^[A-Z_]+=", w)]
    if words[0] == "make":
        assert re.search(rf"^{re.escape(words[1])}:", (ROOT / "Makefile").read_text(), re.M), c.where
        return
    if words[0] == "torchrun":
        inner = words[words.index("shardlab.cli") + 1:]
        return check_dry(Cmd(c.where, shlex.join(["shardlab", *inner])))
    if words[:3] == ["python", "-m", "pytest"]:
        for w in words[3:]:
            if not w.startswith("-"):
                assert (ROOT / w.split("::")[0]).exists(), f"{c.where}: {w} does not exist"
        return
    script = ROOT / words[1]
    assert script.exists(), f"{c.where}: {words[1]} does not exist"
    source = script.read_text()
    for w in words[2:]:
        if w.startswith("--"):
            assert f'"{w.split("=")[0]}"' in source or f"'{w.split('=')[0]}'" in source, \
                f"{c.where}: {words[1]} has no option {w}"


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    return rc, err.getvalue()


def check_dry(c: Cmd) -> None:
    argv = shlex.split(c.text)[1:]
    rc, err = _cli(argv + ["--dry-run"] if argv[0] == "train" else argv)
    errors = [e for e in c.expect if e.startswith("config error:")]
    if errors:
        assert rc == 2 and errors[0][:70] in err, f"{c.where}: expected {errors[0]!r}, got rc {rc}: {err}"
    else:
        assert rc == 0, f"{c.where}: {c.text} -> rc {rc}: {err}"


def _small(argv: list[str]) -> list[str]:
    if argv[0] == "train":
        return argv + ["--train.steps=2", "--train.eval_batches=1", "--train.eval_every=0"]
    if argv[0] == "generate" and "--max-new-tokens" in argv:
        i = argv.index("--max-new-tokens") + 1
        argv[i] = str(min(int(argv[i]), 4))
    return argv


def kind(c: Cmd) -> str:
    if not c.text.startswith("shardlab"):
        return "FILE"
    if any(c.text.startswith(p) for p in NEEDS_STATE) or _synopsis(c.text):
        return "PARSE"
    if c.expect and c.expect[0].startswith("config error:"):  # refused before any work: run it
        return "DRY"
    if any(c.text.startswith(p) for p in PARSE_ONLY):
        return "PARSE"
    if c.text in RUN:
        return "RUN"
    if c.text.startswith("shardlab train") or c.expect and c.expect[0].startswith("config error:"):
        return "DRY"
    return "PARSE"


def test_every_command_is_classified_and_the_run_list_is_current():
    texts = {c.text for c in COMMANDS}
    assert len(COMMANDS) > 60
    assert RUN <= texts, f"documented commands changed: {sorted(RUN - texts)}"
    unlisted = [c for c in COMMANDS if kind(c) == "PARSE" and not _synopsis(c.text)
                and not any(c.text.startswith(p) for p in NEEDS_STATE)
                and not any(c.text.startswith(p) for p in PARSE_ONLY)]
    assert not unlisted, f"run these or give a reason in PARSE_ONLY: {[(c.where, c.text) for c in unlisted]}"


@pytest.mark.parametrize("c", [c for c in COMMANDS if kind(c) in ("PARSE", "FILE")], ids=lambda c: c.where)
def test_parse_level(c):
    (check_file if kind(c) == "FILE" else check_parse)(c)


@pytest.mark.parametrize("c", [c for c in COMMANDS if kind(c) == "DRY"], ids=lambda c: c.where)
def test_dry_run(c, tmp_path, monkeypatch):
    for d in ("configs", "examples", "benchmarks"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.chdir(tmp_path)
    check_dry(c)


def test_run_as_written(tmp_path, monkeypatch):
    """The RUN commands, in the order the docs give them, in one fresh directory."""
    for d in ("configs", "examples", "benchmarks"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.chdir(tmp_path)
    order = sorted(RUN, key=lambda t: (t.startswith(("shardlab checkpoint", "shardlab generate runs")), "--resume" in t))
    for text in order:
        argv = _small(shlex.split(text)[1:])
        if argv[0] == "generate" and "smollm2" in argv:
            from shardlab.errors import ConfigError
            from shardlab.models.pretrained import packaged_gguf
            try:
                packaged_gguf("smollm2")
            except ConfigError:
                continue
        rc, err = _cli(argv)
        assert rc == 0, f"{text}: rc {rc}: {err[-2000:]}"
    assert (tmp_path / "tiny.safetensors").exists() and (tmp_path / "zb.png").exists()
    import json
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert summary["mfu"] is None or 0 < summary["mfu"] <= 1.0, summary["peak_label"]  # a documented config's MFU
