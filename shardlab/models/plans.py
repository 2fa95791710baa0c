"""Parallelisation plans as data: which module (by global name pattern) gets which style.

The model files know nothing of distribution; a parallel module reads a plan and swaps or
hooks the named modules. Patterns are ``fnmatch`` patterns over ``model.named_modules()``
names (``*`` also matches dots), applied in the order written (the embedding before the tied
output head).

Tensor-parallel styles (implemented in ``shardlab/parallel/tensor.py``):

  vocab_embedding         embedding rows split over tp (vocab padded to a multiple of tp);
                          output all-reduced, or reduce-scattered along the sequence with SP
  gather_input            the module's first input enters the tensor-parallel region once for
                          all the column layers inside it: f (identity / all-reduce of the
                          gradient), or with SP the sequence all-gather (reduce-scatter back)
  colwise                 Linear split by output features, no communication inside
  colwise_kv              colwise by key/value heads; heads replicated when tp > n_kv_heads
  rowwise                 Linear split by input features; output all-reduced (g), or
                          reduce-scattered along the sequence with SP
  sequence_parallel_norm  with SP the norm runs on sequence shards and its weight gradient is
                          summed over tp; without SP the norm is left as it is
  vocab_output            output head split by vocab (column-parallel; logits stay sharded)
  vocab_parallel_loss     cross-entropy over vocab-sharded logits, never gathering them
"""
from __future__ import annotations

LLAMA_TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "sequence_parallel_norm",
    "layers.*.attention": "gather_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise_kv",
    "layers.*.attention.wv": "colwise_kv",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence_parallel_norm",
    "layers.*.feed_forward": "gather_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sequence_parallel_norm",
    "output": "vocab_output",
    "criterion": "vocab_parallel_loss",
}
"""Megatron-LM's layout of a Llama block: one all-reduce (or all-gather + reduce-scatter with
sequence parallel) per attention and per MLP, forward and backward."""
