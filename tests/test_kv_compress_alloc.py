"""kv-compress algorithm identities: entropy limits, GQA aggregation, budget conservation and
clamping, α=0 ⇒ uniform, the allocation baselines, and the three selections on hand-built attention."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icml.methods.kv_compress import compress as kv


def test_entropy_of_uniform_history_is_one_and_of_one_hot_is_zero():
    N, w = 40, 8
    uniform = torch.zeros(2, w, N)
    uniform[..., :N - w] = 0.5 / (N - w)  # uniform over history, the rest on the window:
    uniform[..., N - w:] = 0.5 / w  # renormalising on the history removes it
    assert torch.allclose(kv.head_entropy(uniform.log()), torch.ones(2), atol=1e-6)
    one_hot = torch.zeros(2, w, N)
    one_hot[..., 3] = 0.7
    one_hot[..., N - 1] = 0.3
    assert torch.allclose(kv.head_entropy(one_hot.log()), torch.zeros(2), atol=1e-7)
    # log N normalisation: uniform history gives log(N−w)/log N
    assert kv.head_entropy(uniform.log(), "prompt")[0].item() == pytest.approx(math.log(N - w) / math.log(N), abs=1e-6)


def test_entropy_is_the_window_mean_of_row_entropies():
    N, w = 12, 2
    rows = torch.rand(1, w, N, generator=torch.Generator().manual_seed(0))
    rows = rows / rows.sum(-1, keepdim=True)
    p = rows[0, :, :N - w] / rows[0, :, :N - w].sum(-1, keepdim=True)
    expected = float((-(p * p.log()).sum(-1)).mean() / math.log(N - w))
    assert kv.head_entropy(rows.log())[0].item() == pytest.approx(expected, abs=1e-6)


def test_entropy_survives_a_history_mass_that_underflows():
    """A head with all but e^-200 of its mass on the window: probabilities underflow to 0, yet the
    renormalised history (uniform here) has entropy exactly 1."""
    N, w = 30, 4
    logits = torch.zeros(1, w, N)
    logits[..., N - w:] = 200.0
    log_attention = logits.log_softmax(-1)
    assert (log_attention.exp()[..., :N - w] == 0).all()
    assert kv.head_entropy(log_attention)[0].item() == pytest.approx(1.0, abs=1e-6)


def test_gqa_aggregation_mean_and_max():
    per_query = torch.tensor([0.1, 0.3, 0.8, 0.2])  # query heads 0,1 → KV head 0; 2,3 → KV head 1
    assert torch.allclose(kv.group_heads(per_query, 2, "mean"), torch.tensor([0.2, 0.5]))
    assert torch.allclose(kv.group_heads(per_query, 2, "max"), torch.tensor([0.3, 0.8]))


def test_window_attention_is_causal_inside_the_window_and_normalised():
    q = torch.randn(4, 5, 8)
    k = torch.randn(2, 20, 8)
    a = kv.window_log_attention(q, k, 8 ** -0.5).exp()
    assert torch.allclose(a.sum(-1), torch.ones(4, 5), atol=1e-6)
    for i in range(5):
        assert (a[:, i, 15 + i + 1:] == 0).all() and (a[:, i, :15 + i + 1] > 0).all()


@pytest.mark.parametrize("scope", ["global", "per_layer"])
@pytest.mark.parametrize("seed", range(20))
def test_budgets_conserve_the_uniform_total_exactly_and_respect_clamps(scope, seed):
    rng = np.random.default_rng(seed)
    L, H = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    n, w = int(rng.integers(30, 400)), int(rng.integers(1, 20))
    ratio = float(rng.uniform(0.05, 1.0))
    signal = rng.uniform(0, 1, (L, H)) ** 4 + 1e-3  # skewed: forces clamping at both ends
    raw, budget = kv.entropy_budgets(signal, n, w, ratio, scope)
    per_head = kv.uniform_capacity(n, w, ratio) - w
    if scope == "global":
        assert budget.sum() == L * H * per_head
        assert raw.sum() == pytest.approx(L * H * per_head)
    else:
        assert (budget.sum(1) == H * per_head).all()
    assert budget.min() >= 1 and budget.max() <= n - w
    assert budget.dtype == np.int64


def test_largest_remainder_rounds_by_largest_remainders():
    raw = np.array([1.6, 2.3, 3.1])  # total 7: floors 1,2,3 = 6, the largest remainder (.6) gets the unit
    assert kv.largest_remainder(raw, 7, 1, 10).tolist() == [2, 2, 3]
    capped = kv.largest_remainder(np.array([9.0, 0.5, 0.5]), 10, 1, 5)  # cap 5 → the others absorb
    assert capped.tolist() == [5, 3, 2] or capped.tolist() == [5, 2, 3]
    assert capped.sum() == 10


def test_capacity_formula():
    assert kv.uniform_capacity(200, 16, 0.3) == 60
    assert kv.uniform_capacity(200, 16, 0.05) == 17  # at least w + 1
    assert kv.uniform_capacity(200, 16, 1.0) == 200


def test_alpha_zero_gives_uniform_budgets():
    entropy = np.random.default_rng(0).uniform(0, 1, (4, 2))
    signal = kv.stabilised_signal(entropy, 0.0, 0.3)
    _, budget = kv.entropy_budgets(signal, 250, 16, 0.3)
    assert (budget == kv.uniform_budgets((4, 2), 250, 16, 0.3)).all()


def test_higher_entropy_gets_more_budget():
    entropy = np.array([[0.1, 0.9], [0.5, 0.3]])
    _, budget = kv.entropy_budgets(kv.stabilised_signal(entropy, 1.0, 0.3), 300, 16, 0.3)
    assert list(np.argsort(budget.ravel())) == list(np.argsort(entropy.ravel()))


def test_pyramid_budgets_decrease_linearly_and_conserve():
    raw, budget = kv.pyramid_budgets((4, 2), 300, 16, 0.3, 20.0)
    mean = kv.uniform_capacity(300, 16, 0.3) - 16
    assert raw[0, 0] == pytest.approx(2 * mean - mean / 20) and raw[-1, 0] == pytest.approx(mean / 20)
    assert np.allclose(np.diff(raw[:, 0]), np.diff(raw[:, 0])[0]) and (raw[:, 0] == raw[:, 1]).all()
    assert budget.sum() == 8 * mean and (np.diff(budget.sum(1)) <= 0).all()


def test_adakv_guarantees_the_floor_and_conserves_the_layer_total():
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    budget = kv.adakv_budgets(scores, mean=3, floor_fraction=0.4)  # ⌊0.4·3⌋ = 1 each, 4 more to top scores
    assert budget.tolist() == [5, 1] and budget.sum() == 6


def test_snapkv_selects_the_pooled_window_votes():
    N, w = 30, 4
    attention = torch.full((2, w, N), 1e-4)
    attention[0, :, 10] = 1.0  # KV head 0 (query heads 0 and 1 would be averaged; here Hq = Hkv)
    attention[1, :, 20] = 1.0
    scores = kv.snapkv_scores(attention, 2, kernel=3, pool="max")
    assert scores.shape == (2, N - w)
    kept = kv.select("scores", [scores], np.array([[3, 3]]), N, w, 4)
    assert kept[0][0][:3].tolist() == [9, 10, 11]  # the peak and its pooled neighbours
    assert kept[0][1][:3].tolist() == [19, 20, 21]
    assert kept[0][0][3:].tolist() == list(range(N - w, N))  # the window is always kept
    avg = kv.snapkv_scores(attention, 2, kernel=3, pool="avg")
    assert avg[0, 10].item() == pytest.approx((1.0 + 2e-4) / 3, rel=1e-5)


def test_h2o_uses_accumulated_prefill_attention_and_streaming_keeps_sinks_and_recent():
    column_sums = torch.tensor([[5.0, 0.1, 3.0, 0.2, 4.0, 0.0, 9.0, 9.0]])  # last 2 = window
    scores = kv.h2o_scores(column_sums, 1, window=2)
    kept = kv.select("scores", [scores], np.array([[2]]), 8, 2, 4)
    assert kept[0][0].tolist() == [0, 4, 6, 7]
    streaming = kv.select("streamingllm", None, np.array([[6]]), 20, 4, 4)
    assert streaming[0][0].tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]


def test_budget_map_correlations_of_the_spec_pair_and_the_needle_controls():
    """alloc_corr_* = Pearson r of two tasks' mean entrokv_snapkv budget maps (layer × KV head) at r = 0.3:
    maps built so that r is +1 (an affine copy), −1 (a mirrored copy) and np.corrcoef's value; other
    variants and ratios are ignored, a constant map gives NaN."""
    import pandas as pd

    from icml.methods.kv_compress.pipeline import budget_map_correlations

    base = np.array([3.0, 7.0, 1.0, 9.0, 4.0, 6.0])  # 3 layers × 2 KV heads
    other = np.array([2.0, 2.0, 8.0, 5.0, 1.0, 3.0])
    maps = {"kv_retrieval": base, "aggregation": 2 * base + 1, "needle": other}
    rows = []
    for task, budgets in maps.items():
        for example, jitter in ((0, -1.0), (1, 1.0)):  # the map is the mean over examples
            for cell, budget in enumerate(budgets):
                rows += [{"variant": "entrokv_snapkv", "ratio": 0.3, "task": task, "example_id": example,
                          "layer": cell // 2, "kv_head": cell % 2, "budget": budget + jitter},
                         {"variant": "snapkv", "ratio": 0.3, "task": task, "example_id": example,
                          "layer": cell // 2, "kv_head": cell % 2, "budget": 5.0 * (cell == 0)},
                         {"variant": "entrokv_snapkv", "ratio": 0.5, "task": task, "example_id": example,
                          "layer": cell // 2, "kv_head": cell % 2, "budget": -budget}]
    found = {metric: (first, second, r) for first, second, metric, r in budget_map_correlations(pd.DataFrame(rows))}
    assert found["alloc_corr_retrieval_aggregation"] == ("kv_retrieval", "aggregation", pytest.approx(1.0, abs=1e-15))
    assert found["alloc_corr_retrieval_needle"] == ("kv_retrieval", "needle",
                                                    pytest.approx(np.corrcoef(base, other)[0, 1], abs=1e-15))
    assert found["alloc_corr_needle_aggregation"][2] == pytest.approx(np.corrcoef(other, base)[0, 1], abs=1e-15)
    mirrored = pd.DataFrame(rows)  # every task's rows come in the same order: the needle becomes −retrieval
    mirrored.loc[mirrored["task"] == "needle", "budget"] = -mirrored.loc[mirrored["task"] == "kv_retrieval",
                                                                         "budget"].to_numpy()
    found = {metric: r for _, _, metric, r in budget_map_correlations(mirrored)}
    assert found["alloc_corr_retrieval_needle"] == pytest.approx(-1.0, abs=1e-15)
    constant = pd.DataFrame(rows).assign(budget=1.0)
    assert all(np.isnan(r) for *_, r in budget_map_correlations(constant))
