"""Node-limited routing (model.moe_node_groups / moe_max_nodes, DeepSeek-V3's rule) against a
per-token loop that applies the rule with Python sorting; M = all groups is the plain router."""
import math

import pytest
import torch
import torch.nn.functional as F

from shardlab.config import ModelConfig
from shardlab.models import build_model

E, G = 8, 4


def make_moe(k, groups=0, max_nodes=0):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, ffn_hidden=24, n_experts=E, moe_top_k=k,
                      moe_node_groups=groups, moe_max_nodes=max_nodes)
    moe = build_model(cfg, seed=3, dtype=torch.float64).layers["0"].feed_forward
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.7, generator=torch.Generator().manual_seed(0))
    return moe


def naive_node_limited(moe, x, k, max_nodes):
    """For each token: score each group by the sum of its best ceil(k / M) probabilities, keep the
    M best groups, take the k most probable experts of those; gates renormalised (k > 1)."""
    probs = (x @ moe.router.weight.t()).softmax(-1)
    size, per = E // G, math.ceil(k / max_nodes)
    out, used = torch.zeros_like(x), []
    for t in range(x.shape[0]):
        p = probs[t].tolist()
        score = [sum(sorted(p[g * size:(g + 1) * size], reverse=True)[:per]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: -score[g])[:max_nodes]
        cand = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(cand, key=lambda e: -p[e])[:k]
        gates = torch.stack([probs[t, e] for e in chosen])
        gates = gates / gates.sum() if k > 1 else gates
        for gj, e in zip(gates, chosen):
            w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
            out[t] += gj * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
        used.append({e // size for e in chosen})
    return out, used


@pytest.mark.parametrize("k,max_nodes", [(1, 1), (2, 1), (2, 2), (4, 2), (3, 3)])
def test_node_limited_routing_equals_the_per_token_rule(k, max_nodes):
    moe = make_moe(k, G, max_nodes)
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    ref, used = naive_node_limited(moe, x, k, max_nodes)
    assert (y - ref).abs().max().item() < 1e-12
    r = moe.last_routing
    groups = (r.expert // (E // G)).view(k, -1)
    assert all(len(set(groups[:, t].tolist())) <= max_nodes for t in range(x.shape[0]))
    assert [set(groups[:, t].tolist()) for t in range(x.shape[0])] == used
    if max_nodes < k:  # the limit can bind (k experts in fewer groups): the plain router picks differently
        plain = make_moe(k)
        plain.load_state_dict(moe.state_dict())
        plain(x)
        assert not torch.equal(plain.last_routing.expert, r.expert)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_all_groups_is_the_plain_router_exactly(k):
    limited, plain = make_moe(k, G, G), make_moe(k)
    x = torch.randn(2, 20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = limited(xa), plain(xb)
    (ya.square().sum() + limited.last_aux_loss).backward()
    (yb.square().sum() + plain.last_aux_loss).backward()
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(limited.router.weight.grad, plain.router.weight.grad)
