"""attribute-motion: the identities of Motive's attribution — the fast Walsh–Hadamard transform,
Fastfood against its explicit matrix, the JL bound on cosines, motion masks, the masked loss,
shared randomness, length normalisation, aggregation and the retrieval metrics."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from icml.data.videos import make_clip, random_spec
from icml.methods.attribute_motion.attribution import (Setting, aggregate, average_precision, featurize, influence,
                                                       masked_fm_loss, normaliser, retrieval_metrics,
                                                       selection_flags, stacked_mask)
from icml.methods.attribute_motion.flow import motion_mask
from icml.methods.attribute_motion.model import build_unet, to_channels
from icml.methods.attribute_motion.projection import DenseGaussian, Fastfood, fwht, next_pow2


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n, radix_bits", [(1, 7), (2, 7), (64, 7), (512, 7), (64, 2), (32, 2)])
def test_fwht_equals_sylvester_hadamard(n, radix_bits):
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    assert torch.allclose(fwht(x, radix_bits), x @ sylvester(n).T, atol=1e-10)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(12))


def test_fastfood_equals_its_dense_matrix_column_by_column():
    n, dim = 13, 8  # padded to 16
    ff = Fastfood(n, dim, seed=3)
    assert ff.n_pad == 16 == next_pow2(13)
    columns = torch.stack([ff(torch.eye(n)[j:j + 1])[0] for j in range(n)], 1)  # P e_j, column by column
    explicit = ff.dense_matrix()
    assert explicit.shape == (dim, n)
    assert torch.allclose(columns, explicit, atol=1e-5)
    g = torch.randn(5, n, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ff(g), g @ explicit.T, atol=1e-5)  # linear: batch = matrix product


def test_fastfood_is_a_function_of_its_seed():
    g = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    assert torch.equal(Fastfood(100, 16, 5)(g), Fastfood(100, 16, 5)(g))
    assert not torch.allclose(Fastfood(100, 16, 5)(g), Fastfood(100, 16, 6)(g))


def test_projection_preserves_cosines_within_the_jl_bound():
    n, dim, count = 3000, 512, 20
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, n, generator=gen)
    g = base + torch.randn(count, n, generator=gen) * torch.linspace(0.3, 3, count)[:, None]  # a range of cosines
    exact = torch.nn.functional.normalize(g.double(), dim=1)
    exact_cos = exact @ exact.T
    # JL (Dasgupta–Gupta): D ≥ 4 ln(N) / (ε²/2 − ε³/3) keeps the N = 3·count² vectors u, u ± v within (1 ± ε)
    # in squared norm; then |⟨Pu, Pv⟩ − ⟨u, v⟩| ≤ ε and |cos′ − cos| ≤ 2ε / (1 − ε).
    points = 3 * count ** 2
    eps = next(e for e in np.linspace(0.01, 0.99, 9801) if dim >= 4 * math.log(points) / (e ** 2 / 2 - e ** 3 / 3))
    bound = 2 * eps / (1 - eps)
    for projector in (Fastfood(n, dim, seed=1), DenseGaussian(n, dim, seed=1, block=700)):
        p = projector(g).double()
        proj_cos = torch.nn.functional.normalize(p, dim=1) @ torch.nn.functional.normalize(p, dim=1).T
        err = (proj_cos - exact_cos).abs()
        assert err.max() < bound
        assert err.mean() < 2.5 / math.sqrt(dim)  # the typical error is O(1/√D), far inside the worst case
        ratio = (p.norm(dim=1) ** 2 / g.double().norm(dim=1) ** 2).mean()
        assert abs(ratio - 1) < 0.1  # E‖Pg‖² = ‖g‖²: the chi rescaling and 1/√D are right


def test_dense_gaussian_is_the_block_assembled_matrix():
    n, dim = 50, 6
    dense = DenseGaussian(n, dim, seed=4, block=16)
    matrix = torch.cat([dense.block_matrix(b) for b in range(4)], 1)
    g = torch.randn(3, n, generator=torch.Generator().manual_seed(0))
    assert matrix.shape == (dim, n)
    assert torch.allclose(dense(g), g @ matrix.T, atol=1e-5)


def clip(motion, **kw):
    return make_clip(random_spec(np.random.default_rng(7), motion, **kw))


def test_mask_of_a_static_clip_is_zero_and_its_gradient_vanishes():
    static = clip("static", valid_len=8)
    flow, valid = torch.as_tensor(static.flow)[None], torch.as_tensor(static.valid)[None]
    mask = motion_mask(flow, valid, 4)
    assert mask.shape == (1, 8, 16, 16) and torch.count_nonzero(mask) == 0
    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    x0 = to_channels(torch.as_tensor(static.frames)[None])
    loss = masked_fm_loss(lambda x, t, y: model(x, t * 1000, class_labels=y).sample, x0, torch.randn_like(x0),
                          torch.tensor([0.75]), torch.tensor([21]), stacked_mask(mask), torch.ones(1))
    grads = torch.autograd.grad(loss.sum(), [p for p in model.parameters()], allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)


def test_mask_is_normalised_per_clip_and_zero_on_padded_frames():
    moving = clip("right", valid_len=4)
    flow, valid = torch.as_tensor(moving.flow)[None], torch.as_tensor(moving.valid)[None]
    mask = motion_mask(flow, valid, 4)
    assert mask.max() == pytest.approx(1.0) and mask.min() >= 0
    assert torch.count_nonzero(mask[:, 4:]) == 0  # padded frames carry no mask
    assert torch.count_nonzero(mask[:, 3]) == 0  # the last valid frame has no successor: zero flow
    assert torch.allclose(mask[0, 0, :4, :4], mask[0, 0, 0, 0].expand(4, 4))  # constant on each 4×4 patch


def test_padded_frames_do_not_change_the_loss():
    short = clip("down", valid_len=6)
    x0 = to_channels(torch.as_tensor(short.frames)[None])
    mask = stacked_mask(motion_mask(torch.as_tensor(short.flow)[None], torch.as_tensor(short.valid)[None], 4))
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    den = lambda x, t, y: x * 0.5  # noqa: E731 - a frame-wise denoiser keeps padded frames out of valid ones
    changed = x0.clone()
    changed[:, 18:] = 0.3  # frames 6, 7 are padding
    args = (torch.tensor([0.75]), torch.tensor([21]), mask, torch.ones(1))
    assert torch.allclose(masked_fm_loss(den, x0, eps, *args), masked_fm_loss(den, changed, eps, *args))


def test_length_normalisation_removes_the_length_bias_on_a_constructed_pair():
    """Clip B is clip A's 4 frames played twice (with the same noise on the repeat); with a frame-wise
    denoiser its summed loss gradient is exactly 2× A's. Z = frames makes them equal; Z = 1 doubles B's
    dot-product influence against any query."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)
    params = list(conv.parameters())

    def framewise(x, t, y):
        n, c, h, w = x.shape
        return conv(x.reshape(n * c // 3, 3, h, w)).reshape(n, c, h, w) * (1 + t[:, None, None, None])

    a = clip("orbit", valid_len=4)
    frames_a = torch.as_tensor(a.frames)
    frames_b = torch.cat([frames_a[:4], frames_a[:4]])
    eps4 = torch.randn(1, 12, 16, 16)
    x_a, x_b = to_channels(frames_a[None]), to_channels(frames_b[None])
    eps_a, eps_b = torch.cat([eps4, torch.randn(1, 12, 16, 16)], 1), torch.cat([eps4, eps4], 1)
    valid_a, valid_b = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]]).bool(), torch.ones(1, 8).bool()
    mask_a = torch.cat([torch.ones(1, 4, 16, 16), torch.zeros(1, 4, 16, 16)], 1)
    mask_b = torch.ones(1, 8, 16, 16)

    def grad(x, eps, mask, valid, norm):
        m = stacked_mask(mask)
        loss = masked_fm_loss(framewise, x, eps, torch.tensor([0.75]), torch.tensor([0]), m, normaliser(m, valid, norm))
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss.sum(), params)])

    query = torch.randn(3, sum(p.numel() for p in params), dtype=torch.float64).numpy()
    for norm, ratio in (("none", 2.0), ("frames", 1.0), ("mask_sum", 1.0)):
        g_a, g_b = grad(x_a, eps_a, mask_a, valid_a, norm), grad(x_b, eps_b, mask_b, valid_b, norm)
        assert torch.allclose(g_b, ratio * g_a, rtol=1e-4, atol=1e-6)
        dots = influence(torch.stack([g_a, g_b]).double().numpy(), query, cosine=False)
        assert np.allclose(dots[1], ratio * dots[0], rtol=1e-4, atol=1e-8)
        cosines = influence(torch.stack([g_a, g_b]).double().numpy(), query)
        assert np.allclose(cosines[0], cosines[1], atol=1e-5)  # cosine influence is length-free either way


def tiny_pool():
    rng = np.random.default_rng(3)
    clips = [make_clip(random_spec(rng, m)) for m in ("orbit", "right", "static", "jitter")]
    videos = torch.as_tensor(np.stack([c.frames for c in clips]))
    valid = torch.as_tensor(np.stack([c.valid for c in clips]))
    flow = torch.as_tensor(np.stack([c.flow for c in clips]))
    labels = torch.tensor([c.prompt_id for c in clips])
    return videos, valid, flow, labels


def test_shared_randomness_makes_scores_deterministic():
    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    videos, valid, flow, labels = tiny_pool()
    ids = np.arange(4)

    def feats(setting, order=ids):
        return featurize(model, videos[order], valid[order], flow[order], labels[order], ids[order], setting,
                         dim=32, proj_seed=0, chunk=2, dense=False, cos_subset=0)["fastfood"]

    shared = Setting(attr_seed=0)
    first, again = feats(shared), feats(shared)
    assert np.array_equal(first, again)  # same seed, same (t*, ε*), same projector: identical scores
    reordered = feats(shared, ids[::-1].copy())[::-1]
    assert np.allclose(first, reordered, atol=1e-6)  # a clip's feature does not depend on its neighbours
    assert not np.allclose(first, feats(Setting(attr_seed=1)))  # another draw of (t*, ε*) gives other features
    static_row = 2
    assert np.count_nonzero(first[static_row]) == 0  # the static clip has a zero mask: zero gradient
    fresh = Setting(attr_seed=0, shared_noise=False)
    assert np.array_equal(feats(fresh), feats(fresh))  # fresh draws are keyed by clip, still reproducible


def test_class_embedding_is_excluded_from_attribution():
    from icml.methods.attribute_motion.attribution import attribution_parameters

    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    names = [n for n, _ in attribution_parameters(model)]
    assert names and not any(n.startswith("class_embedding") for n in names)
    assert len(names) == len(list(model.parameters())) - 1


def test_majority_vote_ranks_by_votes_then_mean_influence():
    scores = np.array([[0.9, 0.1, 0.2],
                       [0.8, 0.7, 0.6],
                       [0.1, 0.9, 0.0],
                       [-0.9, -0.9, 0.95]])
    mean, votes, rank = aggregate(scores, budget=2, agg="vote")
    assert votes.tolist() == [1, 3, 1, 1]  # q0 → {0, 1}; q1 → {2, 1}; q2 → {3, 1}
    assert rank.tolist() == [1, 0, 2, 3]  # ties among 0, 2, 3 broken by mean influence (0.4, 0.33, −0.28)
    _, _, mean_rank = aggregate(scores, budget=2, agg="mean")
    assert mean_rank.tolist() == [1, 0, 2, 3]
    flags = selection_flags(rank, 1)
    assert flags.tolist() == [0, 1, 0, -1]  # signed: the most negative clip is reported, never selected


def test_retrieval_metrics_on_a_hand_made_pool():
    pool = pd.DataFrame({"motion": ["orbit", "right", "orbit", "jitter", "static", "right"],
                         "shape": ["disk", "disk", "square", "cross", "disk", "disk"], "hue": [0, 1, 2, 3, 4, 1],
                         "decoy_type": ["none", "twin", "none", "jitter", "pan", "twin"],
                         "twin_target": ["", "orbit", "", "", "", "orbit"], "valid_len": [8, 6, 4, 8, 8, 4]})
    rank = np.array([0, 2, 3, 1, 4, 5])
    score = np.array([0.9, 0.5, 0.4, 0.6, 0.1, 0.0])
    out = retrieval_metrics(pool, rank, score, "orbit", budget=2, ks=[1, 2])
    assert out[("p_at_k", 1)] == 1.0 and out[("p_at_k", 2)] == 0.5
    assert out["ap"] == pytest.approx((1 / 1 + 2 / 4) / 2)
    assert out["decoy_rate"] == 0.5  # the jitter clip is in the top 2
    # twin 1 (rank 2) vs orbit clips 0 (rank 0) and 2 (rank 3); twin 5 (rank 5) vs both: 1 of 4 pairs outranks
    assert out["appearance_outrank_rate"] == pytest.approx(0.25)
    assert average_precision(np.array([0.0, 0.0])) != average_precision(np.array([0.0, 0.0]))  # nan: no relevant


def test_influence_is_cosine_with_identity_preconditioner():
    pool = np.array([[3.0, 0.0], [1.0, 1.0]])
    queries = np.array([[10.0, 0.0]])
    assert np.allclose(influence(pool, queries)[:, 0], [1.0, 1 / math.sqrt(2)])
    assert np.allclose(influence(pool, queries, cosine=False)[:, 0], [30.0, 10.0])


def test_spearman_matches_scipy_with_ties():
    from scipy.stats import spearmanr

    from icml.methods.attribute_motion.attribution import spearman

    rng = np.random.default_rng(0)
    scores, lengths = rng.random(40), rng.choice([4, 6, 8], 40)
    assert spearman(scores, lengths) == pytest.approx(spearmanr(scores, lengths).statistic, abs=1e-12)
    assert spearman(lengths, lengths) == pytest.approx(1.0)
