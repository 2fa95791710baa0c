"""``parallel.wrap_policy = blocks`` on a model shardlab has no ModelSpec for (shardlab.initialize):
the children of its outermost containers of repeated blocks, as FSDP users wrap them by hand
(parallel/units.repeated_blocks), and the modules outside them as large as a block
(units.block_units); the root unit alone where a block shares a parameter."""
import pytest
from torch import nn

from shardlab.parallel.units import repeated_blocks, wrap_policy


class Block(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.fc = nn.Linear(d, d)


class Net(nn.Module):
    def __init__(self, share=False):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.stack = nn.Sequential(nn.ModuleList([Block(), Block()]))  # nested: the outer one has a single child
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # mixed classes: not blocks
        self.pairs = nn.ModuleList([Block(), Block(), Block()])
        self.frozen = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.head = nn.Linear(4, 10)
        if share:
            self.head.weight = self.pairs[0].fc.weight if share == "block" else self.embed.weight


def test_repeated_blocks_of_a_user_model():
    assert repeated_blocks(Net()) == ["stack.0.0", "stack.0.1", "pairs.0", "pairs.1", "pairs.2"]
    # the units add each outermost module outside the blocks as large as a block (the smallest, 20
    # parameters): embed (40), the mixed mlp (40), head (50); not the frozen Linears (no trainable ones)
    assert wrap_policy(Net(), "blocks") == ["embed", "stack.0.0", "stack.0.1", "mlp", "pairs.0", "pairs.1",
                                            "pairs.2", "head"]
    assert wrap_policy(Net(share="embed"), "blocks") == ["stack.0.0", "stack.0.1", "mlp", "pairs.0", "pairs.1",
                                                         "pairs.2"]  # tied embed / head: both stay in the root
    assert wrap_policy(Net(share="block"), "blocks") == []
    assert repeated_blocks(Net(share="embed")) == repeated_blocks(Net())  # tied outside the blocks: the root's
    assert repeated_blocks(Net(share="block")) == []  # a block's weight used outside it: one unit could not own it
    assert repeated_blocks(nn.Linear(3, 3)) == []
    nested = nn.ModuleList([nn.ModuleList([Block(), Block()]), nn.ModuleList([Block(), Block()])])
    assert repeated_blocks(nested) == ["0.0", "0.1", "1.0", "1.1"]  # ModuleLists are never called: their blocks


def test_repeated_blocks_of_transformers_models():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    assert repeated_blocks(llama) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert wrap_policy(llama, "blocks") == repeated_blocks(llama)  # tied: embedding and head in the root
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(  # embedding 20,480 >= a layer's 9,280
        vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))
    assert wrap_policy(untied, "blocks") == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                             "model.layers.2", "lm_head"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 bos_token_id=0, eos_token_id=0))
    assert repeated_blocks(gpt2) == ["transformer.h.0", "transformer.h.1"]
