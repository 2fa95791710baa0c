"""``parallel.compile`` across layouts: each layout of configs/tiny.toml (and expert parallel on
configs/tiny-moe.toml) trains a few steps eager and compiled, and the table shows both final
training losses (or the error), side by side (docs/composition.md).

    PYTHONPATH=. python benchmarks/compile_sweep.py [--steps 4]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile

LAYOUTS = [
    ("tiny", "--nproc 1"),
    ("tiny", "--nproc 2"),
    ("tiny", "--nproc 2 --parallel.dp_shard=2 --parallel.zero_stage=1"),
    ("tiny", "--nproc 2 --parallel.dp_shard=2 --parallel.zero_stage=2"),
    ("tiny", "--nproc 2 --parallel.dp_shard=2 --parallel.zero_stage=3"),
    ("tiny", "--nproc 2 --parallel.tp=2"),
    ("tiny", "--nproc 2 --parallel.tp=2 --parallel.sequence_parallel=true"),
    ("tiny", "--nproc 2 --parallel.cp=2"),
    ("tiny", "--nproc 2 --parallel.cp=2 --parallel.cp_impl=ulysses"),
    ("tiny", "--nproc 2 --parallel.pp=2 --parallel.microbatches=4"),
    ("tiny", "--nproc 4 --parallel.pp=2 --parallel.dp_shard=2 --parallel.zero_stage=3 --parallel.microbatches=2"),
    ("tiny", "--nproc 2 --parallel.dp_shard=2 --parallel.zero_stage=3 --parallel.activation_checkpointing=full"),
    ("tiny", "--nproc 2 --parallel.activation_checkpointing=op"),
    ("tiny", "--nproc 2 --train.precision=bf16 --parallel.dp_shard=2 --parallel.zero_stage=3"),
    ("tiny-moe", "--nproc 2 --parallel.ep=2 --parallel.dp_shard=2"),
    ("tiny-moe", "--nproc 2 --parallel.ep=2 --parallel.dp_shard=2 --parallel.ep_dispatch=exact"),
    ("tiny-moe", "--nproc 2 --parallel.ep=2 --parallel.dp_shard=2 --parallel.ep_overlap=2"),
    ("tiny-moe", "--nproc 2 --parallel.ep=2 --parallel.dp_shard=2 --parallel.ep_dispatch=hierarchical"),
]


def final_loss(config: str, layout: str, compiled: bool, steps: int, run_dir: str) -> str:
    cmd = [sys.executable, "-m", "shardlab.cli", "train", f"configs/{config}.toml", *layout.split(),
           f"--parallel.compile={str(compiled).lower()}", f"--train.steps={steps}", "--run-dir", run_dir, "--overwrite"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.findall(r"train loss ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode == 0 and found:
        return found[-1]
    err = re.findall(r"(\w+Error[^\n]*)", out.stderr)
    return f"FAIL ({err[0][:60] if err else 'exit ' + str(out.returncode)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(f"| config | layout | eager loss | compiled loss | same |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for config, layout in LAYOUTS:
            eager, comp = (final_loss(config, layout, c, args.steps, f"{tmp}/run") for c in (False, True))
            print(f"| {config} | `{layout}` | {eager} | {comp} | {'yes' if eager == comp else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
