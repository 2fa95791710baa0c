"""``shardlab checkpoint inspect DIR`` and ``shardlab checkpoint export DIR --to model.safetensors``.

DIR is one checkpoint (``.../step_00000100``) or a checkpoint directory (the newest valid one
is used). Checksums are verified first; a damaged checkpoint is refused with the file named.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..train import checkpoint as ckpt


def _resolve(path: str) -> Path:
    p = Path(path)
    if (p / "meta.json").exists():
        return p
    found = ckpt.latest_valid(p)
    if found is None:
        raise ConfigError("DIR", f"no valid checkpoint in {p}; pass a step_XXXXXXXX directory or the "
                                 "checkpoint directory of a run (logging.run_dir/checkpoints)")
    return found


def configure(parser):
    parser.add_argument("action", choices=["inspect", "export"])
    parser.add_argument("dir", help="a checkpoint (step_XXXXXXXX) or a directory of checkpoints")
    parser.add_argument("--to", default=None, help="export: output .safetensors path (consolidated weights)")
    parser.add_argument("--force", action="store_true", help="export: overwrite an existing output file")


def main(args) -> int:
    try:
        path = _resolve(args.dir)
        tensors, meta = ckpt.load(path)
    except ckpt.CheckpointError as e:
        raise ConfigError("DIR", f"refused: {e}") from None
    if args.action == "inspect":
        groups: dict[str, list] = {}
        for k, v in tensors.items():
            groups.setdefault(k.split(".", 1)[0], []).append((k, v))
        print(f"checkpoint {path}")
        print(f"  step {meta['step']}   layout {meta.get('layout')}   world size {meta.get('world_size')}   "
              f"engine {meta.get('engine')}")
        print(f"  data cursor {meta['data']['cursor']}   loss scaler {json.dumps(meta.get('scaler'))}")
        for name, items in sorted(groups.items()):
            n = sum(v.numel() for _, v in items)
            nbytes = sum(v.numel() * v.element_size() for _, v in items)
            print(f"  {name:<6} {len(items):>5} tensors  {n:>14,} elements  {nbytes / 2**20:>10.2f} MiB")
        print("  model tensors:")
        for k, v in sorted(tensors.items()):
            if k.startswith("model."):
                print(f"    {k[6:]:<48} {str(tuple(v.shape)):<20} {str(v.dtype).replace('torch.', '')}")
        return 0
    if not args.to:
        raise ConfigError("--to", "export needs an output path, e.g. --to model.safetensors")
    out = Path(args.to)
    if out.exists() and not args.force:
        raise ConfigError("--to", f"{out} exists; pass --force to overwrite it")
    from safetensors.torch import save_file
    weights = {k[len("model."):]: v.contiguous() for k, v in tensors.items() if k.startswith("model.")}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata={"source": str(path), "step": str(meta["step"])})
    print(f"wrote {len(weights)} tensors ({sum(v.numel() for v in weights.values()):,} parameters) to {out}")
    return 0
