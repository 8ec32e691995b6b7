"""attribute-motion: the identities of Motive's attribution — the fast Walsh–Hadamard transform,
Fastfood against its explicit matrix, the JL bound on cosines, motion masks, the masked loss,
shared randomness, length normalisation, aggregation and the retrieval metrics."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from icml.data.videos import make_clip, random_spec
from icml.methods.attribute_motion.attribution import (Setting, aggregate, average_precision, featurize,
                                                       influence, masked_fm_loss, normaliser, retrieval_metrics,
                                                       selection_flags, stacked_mask)
from icml.methods.attribute_motion.config import LENGTH_NORMS
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
    loss = masked_fm_loss(lambda x, t, y: model(x, t, class_labels=y).sample, x0, torch.randn_like(x0),
                          torch.tensor([750.0]), torch.tensor([21]), stacked_mask(mask))
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
    args = (torch.tensor([750.0]), torch.tensor([21]), mask)
    assert torch.allclose(masked_fm_loss(den, x0, eps, *args), masked_fm_loss(den, changed, eps, *args))


def test_z_equalises_the_gradients_of_a_constructed_pair():
    """Clip B is clip A's 4 frames played twice (with the same noise on the repeat); with a frame-wise
    denoiser its summed loss gradient is exactly 2× A's. Z = frames makes the two gradients equal; Z = 1
    leaves B's twice A's, so its dot-product influence doubles (a scalar the cosine then cancels)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)
    params = list(conv.parameters())

    def framewise(x, t, y):
        n, c, h, w = x.shape
        return conv(x.reshape(n * c // 3, 3, h, w)).reshape(n, c, h, w) * (1 + t[:, None, None, None] / 1000)

    a = clip("orbit", valid_len=4)
    frames_a = torch.as_tensor(a.frames)
    frames_b = torch.cat([frames_a[:4], frames_a[:4]])
    eps4 = torch.randn(1, 12, 16, 16)
    x_a, x_b = to_channels(frames_a[None]), to_channels(frames_b[None])
    eps_a, eps_b = torch.cat([eps4, torch.randn(1, 12, 16, 16)], 1), torch.cat([eps4, eps4], 1)
    valid_a, valid_b = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]]).bool(), torch.ones(1, 8).bool()
    ramp = torch.linspace(0.2, 1, 16)[None, :] * torch.ones(16, 1)  # frames of unequal mask mass
    mask_a = torch.cat([torch.stack([ramp, ramp ** 2, ramp.T, 0.5 * ramp]), torch.zeros(4, 16, 16)])[None]
    mask_b = torch.cat([mask_a[0, :4], mask_a[0, :4]])[None]

    def grad(x, eps, mask, valid, norm):
        m = stacked_mask(mask / normaliser(mask, valid, norm)[:, None, None, None])
        loss = masked_fm_loss(framewise, x, eps, torch.tensor([750.0]), torch.tensor([0]), m)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss.sum(), params)])

    query = torch.randn(3, sum(p.numel() for p in params), dtype=torch.float64).numpy()
    for norm, ratio in (("none", 2.0), ("frames", 1.0)):
        g_a, g_b = grad(x_a, eps_a, mask_a, valid_a, norm), grad(x_b, eps_b, mask_b, valid_b, norm)
        assert torch.allclose(g_b, ratio * g_a, rtol=1e-4, atol=1e-6)
        dots = influence(torch.stack([g_a, g_b]).double().numpy(), query, z=np.ones(2))
        assert np.allclose(dots[1], ratio * dots[0], rtol=1e-4, atol=1e-8)


class FrameWise(torch.nn.Module):
    """A denoiser that sees each frame alone (one 3 → 3 conv shared by the frames, scaled by t): a clip's
    loss gradient is then the sum of its frames' gradients."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x, t, class_labels=None):
        n, c, h, w = x.shape
        out = self.conv(x.reshape(n * c // 3, 3, h, w)).reshape(n, c, h, w) * (1 + t[:, None, None, None] / 1000)
        return SimpleNamespace(sample=out)


def pipeline_scores(tmp_path, model, pool: list, queries: list, length_norm: str = "grad_norm") -> np.ndarray:
    """Influence (pool, queries) of `motive` through the pipeline's scoring path (`selector_scores`: features,
    influence and the frame-length correction), on clips held in memory."""
    from icml.methods.attribute_motion.clips import ClipSets
    from icml.methods.attribute_motion.config import preset
    from icml.methods.attribute_motion.pipeline import selector_scores

    cfg = preset("smoke")
    cfg.selectors, cfg.attr.dim, cfg.attr.cos_subset = ["motive"], 32, 0
    if length_norm in LENGTH_NORMS:  # the config of the code under test (before issue 47: frames, mask_sum, none)
        cfg.attr.length_norm = length_norm
    clips = pool + queries
    table = pd.DataFrame({"clip_id": [f"c{i}" for i in range(len(clips))],
                          "split": ["pool"] * len(pool) + ["query"] * len(queries),
                          "query_target": [""] * len(pool) + ["orbit"] * len(queries)})
    sets = ClipSets(np.stack([c.frames for c in clips]), np.stack([c.valid for c in clips]),
                    np.stack([c.flow for c in clips]), np.array([c.prompt_id for c in clips]), table, True)
    return selector_scores(tmp_path, cfg, model, sets, None, "motive", "orbit", 0)[0]


def mixed_pool(seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    return [make_clip(random_spec(rng, m, valid_len=n)) for m, n in
            (("static", 8), ("orbit", 4), ("right", 6), ("orbit", 8), ("jitter", 4), ("down", 8), ("bounce", 6))]


@pytest.mark.parametrize("length_norm", ["grad_norm", "frames", "mask_sum", "none"])
def test_a_clip_without_motion_scores_exactly_zero(tmp_path, length_norm):
    """Issue 47: a pool-wide trend in frame count gave every static clip β·F̄ (0.031 on the smoke output);
    an empty mask is a zero gradient, and its score must be exactly 0 against every query."""
    pool = mixed_pool()
    queries = [make_clip(random_spec(np.random.default_rng(11), "orbit", valid_len=n)) for n in (4, 8)]
    scores = pipeline_scores(tmp_path, build_unet(8, 16, [8, 16, 16], 1, seed=0), pool, queries, length_norm)
    assert np.all(scores[0] == 0.0)
    assert np.all(scores[1:] != 0.0)


@pytest.mark.parametrize("length_norm", ["grad_norm", "frames", "mask_sum"])
def test_a_clips_score_does_not_depend_on_the_rest_of_the_pool(tmp_path, length_norm):
    """The score of a pool clip is a function of that clip and the queries only: dropping half of the pool
    or adding clips of other lengths leaves every remaining score unchanged."""
    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    pool = mixed_pool()
    queries = [make_clip(random_spec(np.random.default_rng(11), "orbit", valid_len=n)) for n in (6, 8)]
    full = pipeline_scores(tmp_path / "full", model, pool, queries, length_norm)
    keep = [1, 3, 5]
    part = pipeline_scores(tmp_path / "part", model, [pool[i] for i in keep], queries, length_norm)
    extra = [make_clip(random_spec(np.random.default_rng(4), m, valid_len=4)) for m in ("diagonal", "orbit", "static")]
    more = pipeline_scores(tmp_path / "more", model, [pool[i] for i in keep] + extra, queries, length_norm)
    assert np.allclose(part, full[keep], rtol=1e-6, atol=0)
    assert np.allclose(more[:3], full[keep], rtol=1e-6, atol=0)


@pytest.mark.parametrize("length_norm, ratio", [("grad_norm", 1.0), ("frames", 1.0), ("mask_sum", 1.0), ("none", 2.0)])
def test_the_same_motion_repeated_at_4_and_8_frames_scores_the_same(tmp_path, monkeypatch, length_norm, ratio):
    """Clip B is clip A's 4 valid frames played twice (8 valid frames, the same flow and mask on the repeat),
    under a frame-wise denoiser with the shared ε* repeated on the second half: B's gradient of ΣM⊙r² is
    exactly twice A's, so under the clip's own normaliser (its gradient norm, valid frames or ΣM, all twice
    A's) both clips score the same against every query (float32 rounding: 1e-5 relative), whatever the rest
    of the pool holds; without one (Z = 1) B scores exactly twice A. The pool-wide length trend of before
    issue 47 moved B away from A by β·ΔF."""
    import icml.methods.attribute_motion.attribution as attribution

    draws = attribution.noise_draws

    def repeated_noise(*args, **kwargs):
        t, eps = draws(*args, **kwargs)
        eps = eps.clone()
        eps[..., 12:, :, :] = eps[..., :12, :, :]  # frames 4–7 get frames 0–3's noise
        return t, eps

    monkeypatch.setattr(attribution, "noise_draws", repeated_noise)
    torch.manual_seed(0)
    model = FrameWise()
    a = make_clip(random_spec(np.random.default_rng(5), "orbit", valid_len=4))
    b = dataclasses.replace(a, frames=np.concatenate([a.frames[:4], a.frames[:4]]),
                            flow=np.concatenate([a.flow[:4], a.flow[:4]]), valid=np.ones(8, dtype=a.valid.dtype))
    rng = np.random.default_rng(6)
    others = [make_clip(random_spec(rng, m, valid_len=n)) for m, n in (("right", 6), ("orbit", 8), ("down", 4))]
    queries = [make_clip(random_spec(rng, "orbit", valid_len=n)) for n in (4, 6, 8)]
    scores = pipeline_scores(tmp_path, model, [a, b] + others, queries, length_norm)
    assert np.all(scores[0] != 0)
    assert np.allclose(scores[1], ratio * scores[0], rtol=1e-5, atol=0)


def test_on_the_stacked_unet_the_length_effect_is_a_query_length_interaction():
    """The default UNet (spec config, random init, Fastfood D = 512): 6 orbit specs rendered at 4 and at 8 valid
    frames (every other factor equal), 6 other clips, orbit queries 2 each at 4, 6 and 8 frames. A clip
    matches queries of its own frame support: the 8-frame renderings score below the 4-frame ones against
    4-frame queries and above them against 8-frame queries, so a per-clip Z(x) can only move the balance.
    Over the balanced query set the cosine (`grad_norm`) keeps the two renderings within 25 % (README:
    0.80–1.13 over three pools), and Z = valid frames tips it to the short clips."""
    model = build_unet(8, 16, [32, 64, 64], 1, seed=0)
    rng = np.random.default_rng(5)
    queries = [make_clip(random_spec(rng, "orbit", valid_len=n)) for n in (4, 4, 6, 6, 8, 8)]
    others = ["right", "down", "bounce", "jitter", "diagonal", "static"]
    specs = [random_spec(rng, m, valid_len=8) for m in ["orbit"] * 6 + others]
    pool = [make_clip(dataclasses.replace(s, valid_len=n)) for n in (4, 8) for s in specs]
    clips = queries + pool
    stack = lambda key: torch.as_tensor(np.stack([getattr(c, key) for c in clips]))  # noqa: E731
    feats = featurize(model, stack("frames"), stack("valid"), stack("flow"), torch.full((len(clips),), 21),
                      np.arange(len(clips)), Setting(), dim=512, proj_seed=0, chunk=len(clips), dense=False,
                      cos_subset=0)["fastfood"]
    frames = normaliser(None, stack("valid")[6:], "frames").double().numpy()

    def long_over_short(scores, columns=slice(None)):  # the 8-frame renderings' mean over the 4-frame ones'
        mean = scores[:, columns].mean(1)
        return mean[12:18].mean() / mean[:6].mean()

    cosine, per_frame = influence(feats[6:], feats[:6]), influence(feats[6:], feats[:6], z=frames)
    assert long_over_short(cosine, slice(0, 2)) < 0.8 and long_over_short(cosine, slice(4, 6)) > 1.25
    assert 0.75 < long_over_short(cosine) < 1.25
    assert long_over_short(per_frame) < 0.75 * long_over_short(cosine)
    orbit, others = cosine.mean(1)[np.r_[0:6, 12:18]], cosine.mean(1)[np.r_[6:12, 18:24]]
    assert orbit.min() > others.max()


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
    assert out["pan_outrank_rate"] == 0.0  # the pan (rank 4) is below both orbit clips (ranks 0, 3)
    moved = retrieval_metrics(pool, np.array([0, 2, 3, 4, 1, 5]), score, "orbit", budget=2, ks=[1])
    assert moved["pan_outrank_rate"] == 0.5  # now above orbit clip 2 (rank 3), still below clip 0
    assert average_precision(np.array([0.0, 0.0])) != average_precision(np.array([0.0, 0.0]))  # nan: no relevant


def test_influence_is_cosine_with_identity_preconditioner():
    pool = np.array([[3.0, 0.0], [1.0, 1.0]])
    queries = np.array([[10.0, 0.0]])
    assert np.allclose(influence(pool, queries)[:, 0], [1.0, 1 / math.sqrt(2)])
    # a per-clip Z(x) instead of the clip's gradient norm: Pg(x)/Z(x) against the unit query
    assert np.allclose(influence(pool, queries, z=np.ones(2))[:, 0], [3.0, 1.0])
    assert np.allclose(influence(pool, queries, z=np.array([3.0, 0.5]))[:, 0], [1.0, 2.0])
    for z in (None, np.array([4.0])):  # no motion, zero gradient: exactly 0 under either normaliser
        assert np.array_equal(influence(np.zeros((1, 2)), queries, z=z), [[0.0]])


def test_spearman_matches_scipy_with_ties():
    from scipy.stats import spearmanr

    from icml.methods.attribute_motion.attribution import spearman

    rng = np.random.default_rng(0)
    scores, lengths = rng.random(40), rng.choice([4, 6, 8], 40)
    assert spearman(scores, lengths) == pytest.approx(spearmanr(scores, lengths).statistic, abs=1e-12)
    assert spearman(lengths, lengths) == pytest.approx(1.0)


def panned_static_scene(step=(1, 0), frames=8):
    """A pure camera pan of a static scene: frame f is frame 0 rolled by f·step px (the sprite moves with the
    background), analytic flow = step on every pixel of every frame with a successor."""
    still = clip("static", valid_len=frames)
    scene = still.frames[0]
    video = np.stack([np.roll(scene, (f * step[1], f * step[0]), axis=(0, 1)) for f in range(frames)])
    flow = np.zeros((frames, 2, 16, 16), np.float32)
    flow[:-1, 0], flow[:-1, 1] = step
    return torch.as_tensor(video)[None], torch.ones(1, frames, dtype=torch.bool), torch.as_tensor(flow)[None]


def test_a_pure_pan_of_a_static_scene_has_an_empty_mask_and_zero_influence():
    video, valid, flow = panned_static_scene((1, 0))
    assert torch.count_nonzero(motion_mask(flow, valid, 4)) == 0  # camera motion compensated
    assert torch.count_nonzero(motion_mask(flow, valid, 4, camera="none")) > 0  # raw flow: all of it is "motion"
    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    moving = clip("orbit", valid_len=8)
    videos = torch.cat([video, torch.as_tensor(moving.frames)[None]])
    feats = featurize(model, videos, torch.cat([valid, torch.as_tensor(moving.valid)[None]]),
                      torch.cat([flow, torch.as_tensor(moving.flow)[None]]), torch.tensor([21, 21]), np.arange(2),
                      Setting(), dim=32, proj_seed=0, chunk=2, dense=False, cos_subset=0)["fastfood"]
    assert np.count_nonzero(feats[0]) == 0 and np.count_nonzero(feats[1]) > 0
    assert influence(feats[:1], feats[1:])[0, 0] == 0.0  # the pan scores exactly zero against any query


def test_estimated_flow_of_a_pure_pan_loses_most_of_its_mask():
    """Horn–Schunck on the panned scene (wrapped borders, which no flow explains): compensation removes
    ~90 % of the mask mass; the residue is estimator error, not motion (README)."""
    from icml.methods.attribute_motion.flow import estimate_flow

    video, valid, _ = panned_static_scene((1, 0))
    estimated = estimate_flow(video, "hs")
    raw = motion_mask(estimated, valid, 4, camera="none", floor=0.25)
    compensated = motion_mask(estimated, valid, 4, floor=0.25)
    assert raw.mean() > 0.3  # uncompensated, the whole frame moves
    assert compensated.mean() < 0.2 * raw.mean()


def test_camera_compensation_keeps_object_motion_on_a_still_background():
    from icml.methods.attribute_motion.flow import camera_compensated

    moving = clip("right", valid_len=8)
    flow, valid = torch.as_tensor(moving.flow)[None], torch.as_tensor(moving.valid)[None]
    assert torch.equal(camera_compensated(flow, valid), flow)  # the background is most pixels: median 0
    assert torch.equal(motion_mask(flow, valid, 4), motion_mask(flow, valid, 4, camera="none"))
    # the pan decoy (background pans, sprite fixed in frame): the sprite moves against the scene
    pan = make_clip(random_spec(np.random.default_rng(7), "static", pan=True, valid_len=8))
    pflow, pvalid = torch.as_tensor(pan.flow)[None], torch.as_tensor(pan.valid)[None]
    on_sprite = (pflow[0, 0].abs().sum(0) == 0)  # zero raw flow: the sprite pixels
    mask = motion_mask(pflow, pvalid, 1)
    assert torch.count_nonzero(mask[0, :7][:, ~on_sprite]) == 0 and torch.all(mask[0, :7][:, on_sprite] > 0)


def test_gradient_over_k_draws_is_the_mean_of_the_single_draw_gradients():
    """draws=K: one backward pass on K copies equals the mean of K separate gradients at (t*, ε_k), and
    the first shared draw is the spec's (t*, ε*) of draws=1."""
    from icml.methods.attribute_motion.attribution import noise_draws, per_clip_gradients, loss_space_mask
    from icml.methods.attribute_motion.model import timesteps_of, velocity

    model = build_unet(8, 16, [8, 16, 16], 1, seed=0)
    videos, valid, flow, labels = tiny_pool()
    setting = Setting(draws=3)
    t1, eps1 = noise_draws(Setting(), 4, (24, 16, 16))
    t3, eps3 = noise_draws(setting, 4, (24, 16, 16))
    assert torch.equal(eps3[:, :1], eps1) and torch.equal(t3[:, :1], t1)
    assert torch.equal(eps3[0], eps3[3]) and not torch.allclose(eps3[0, 0], eps3[0, 1])  # shared by clips, not draws
    averaged = dict(per_clip_gradients(model, videos, valid, flow, labels, setting, np.arange(4)))
    params = [p for n, p in model.named_parameters() if not n.startswith("class_embedding")]
    x0, masks = to_channels(videos), loss_space_mask(flow, valid, setting)
    for i in (0, 1):
        singles = []
        for k in range(3):
            loss = masked_fm_loss(lambda x, t, y: velocity(model, x, t, y), x0[i:i + 1], eps3[i, k:k + 1],
                                  timesteps_of(t3[i, k:k + 1]), torch.tensor([21]), masks[i:i + 1]).sum()
            singles.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        reference = torch.stack(singles).mean(0)
        scale = reference.abs().max()
        assert torch.allclose(averaged[i], reference, atol=64 * torch.finfo(torch.float32).eps * float(scale))


def test_sampler_is_the_schedulers_euler_with_cfg_on_a_constant_field():
    """MotionPipeline integrates dx/dσ = v from σ = 1 to 0 with the scheduler's steps; for a velocity field
    that is constant (a for the prompt, b for the null prompt) the result is exactly x₁ − (b + w(a − b))."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from icml.methods.attribute_motion.model import pipeline_class

    class Constant(torch.nn.Module):
        def forward(self, x, t, class_labels):
            out = torch.where((class_labels == 21)[:, None, None, None], torch.full_like(x, -0.5), torch.full_like(x, 2.0))
            return type("Out", (), {"sample": out})()

    noise = torch.randn(3, 6, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pipe = pipeline_class()(unet=Constant(), scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))
    for steps, w in ((1, 1.0), (7, 2.0), (20, 2.0)):
        x = pipe(torch.tensor([0, 5, 20]), steps=steps, cfg_scale=w, noise=noise)
        assert torch.allclose(x, noise - (-0.5 + w * 2.5), atol=64 * torch.finfo(torch.float32).eps)


def test_forward_process_is_the_schedulers_scale_noise():
    from icml.methods.attribute_motion.model import add_noise, timesteps_of

    x0, eps = torch.randn(4, 6, 4, 4), torch.randn(4, 6, 4, 4)
    sigma = torch.tensor([0.75, 0.001, 1.0, 0.523])
    assert torch.allclose(timesteps_of(sigma), torch.tensor([750.0, 1.0, 1000.0, 523.0]), atol=1e-3)
    assert timesteps_of(torch.rand(64, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05).shape == (64,)
    expected = (1 - sigma)[:, None, None, None] * x0 + sigma[:, None, None, None] * eps
    assert torch.allclose(add_noise(x0, eps, timesteps_of(sigma)), expected, atol=4 * torch.finfo(torch.float32).eps)


def test_average_precision_is_scikit_learns():
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(1)
    relevant = (rng.random(50) < 0.2).astype(float)
    assert average_precision(relevant) == pytest.approx(average_precision_score(relevant, -np.arange(50)), abs=1e-12)
