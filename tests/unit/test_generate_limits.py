"""``generate`` at the model's positions (model.max_seq_len): a prompt that fills them is refused in
one line (it used to print nothing at all), and a run that reaches them says so (``full``) instead
of stopping short of --max-new-tokens silently."""
import pytest
import torch

from shardlab.config import Config, ConfigError
from shardlab.models.generate import generate
from shardlab.models.spec import get_spec, init_weights


@pytest.fixture(scope="module")
def tiny():
    m = Config().model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.max_seq_len = 256, 16, 1, 2, 1, 12
    torch.manual_seed(0)
    return init_weights(get_spec(m).build(m), m, 0).eval(), m


def test_a_run_that_reaches_the_positions_says_so(tiny):
    model, m = tiny
    out = generate(model, [1, 2, 3], 100, max_len=m.max_seq_len)
    assert len(out.tokens) == m.max_seq_len - 3 and out.full and not out.stopped
    out = generate(model, [1, 2, 3], 4, max_len=m.max_seq_len)
    assert len(out.tokens) == 4 and not out.full


def test_a_prompt_that_fills_the_positions_is_refused(tiny):
    model, m = tiny
    with pytest.raises(ConfigError) as e:
        generate(model, list(range(12)), 4, max_len=m.max_seq_len)
    assert str(e.value) == ("config error: --prompt: 12 tokens fill the model's 12 positions (model.max_seq_len), "
                            "leaving none to generate; shorten the prompt")
    assert len(generate(model, list(range(11)), 4, max_len=m.max_seq_len).tokens) == 1
