"""`icml soup`: the identities of souping, the SSL losses at known inputs, SIGReg against closed forms
and a numerical reference, the folded probe, greedy selection and the evaluation primitives."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from icml.methods.soup.config import ViTConfig, parse_ingredients
from icml.methods.soup.soups import (Classifier, FeatureNet, check_one_stock, dist_from_stock, fingerprint,
                                     fold_standardisation, greedy_soup, interpolation_barrier, knn_predict,
                                     neighbour_entropy, season_weights, soup_state, task_vector_cos)
from icml.methods.soup.ssl import (epps_pulley, lejepa_loss, masked_patch_mse, mmcr_loss, mocov3_loss, sigreg,
                                   ssl_loss)
from icml.methods.soup.vit import adamw, build_stock, cls_features, encoder_of, projector, ssl_view

TINY = ViTConfig(image_size=8, patch_size=4, hidden_size=16, layers=1, heads=2, intermediate_size=32,
                 decoder_hidden_size=8, decoder_layers=1, decoder_heads=2, decoder_intermediate_size=16)


def tiny_states(n: int) -> list[dict]:
    return [build_stock(TINY, 1, seed).state_dict() for seed in range(n)]


# soups ----------------------------------------------------------------------------------------------
def test_one_ingredient_soup_is_that_ingredient():
    (state,) = tiny_states(1)
    souped = soup_state([state])
    assert souped.keys() == state.keys()
    for key in state:
        assert torch.equal(souped[key], state[key]), key


def test_uniform_soup_is_the_parameter_mean_over_every_float_entry():
    states = tiny_states(3)
    souped = soup_state(states)
    for key, value in states[0].items():
        expected = torch.stack([s[key].double() for s in states]).mean(0).to(value.dtype)
        assert torch.allclose(souped[key], expected, atol=1e-7, rtol=0), key
    weighted = soup_state(states, [0.5, 0.3, 0.2])
    key = next(k for k, v in states[0].items() if v.ndim == 2)
    assert torch.allclose(weighted[key], 0.5 * states[0][key] + 0.3 * states[1][key] + 0.2 * states[2][key],
                          atol=1e-6)
    with pytest.raises(ValueError, match="sum to 1"):
        soup_state(states, [0.5, 0.5, 0.5])


def test_one_ingredient_classifier_soup_predicts_like_the_ingredient():
    encoder = encoder_of(build_stock(TINY, 1, 0)).eval()
    model = Classifier(encoder, torch.nn.Linear(16, 3)).eval()
    images = torch.rand(5, 1, 8, 8)
    twin = Classifier(encoder_of(build_stock(TINY, 1, 1)), torch.nn.Linear(16, 3)).eval()
    twin.load_state_dict(soup_state([model.state_dict()]))
    assert torch.equal(model(images), twin(images))


@pytest.mark.parametrize("k", [2, 3, 5, 7])
def test_a_soup_of_k_copies_of_one_ingredient_is_that_ingredient(k):
    """Σ (1/k)·θ over k copies is θ bit for bit (float64 accumulation, one rounding back to float32),
    for an encoder and for a classifier (its predictions too)."""
    encoder = encoder_of(build_stock(TINY, 1, 3)).eval()
    model = Classifier(encoder, torch.nn.Linear(16, 3)).eval()
    state = model.state_dict()
    souped = soup_state([state] * k)
    assert souped.keys() == state.keys() and all(torch.equal(souped[key], state[key]) for key in state)
    twin = Classifier(encoder_of(build_stock(TINY, 1, 4)), torch.nn.Linear(16, 3)).eval()
    twin.load_state_dict(souped)
    images = torch.rand(5, 1, 8, 8)
    assert torch.equal(model(images), twin(images))


def test_stock_fingerprint_identifies_a_stock_and_refuses_mixed_soups():
    a, b = tiny_states(2)
    assert fingerprint(a) == fingerprint({k: v.clone() for k, v in a.items()})  # the values, not the objects
    assert fingerprint(a) != fingerprint(b)  # another random init
    nudged = {k: v.clone() for k, v in a.items()}
    key = next(k for k, v in a.items() if torch.is_floating_point(v) and v.ndim == 2)
    nudged[key].view(-1)[0] = torch.nextafter(nudged[key].view(-1)[0], torch.tensor(math.inf))  # one ulp
    assert fingerprint(nudged) != fingerprint(a)
    check_one_stock({"x": fingerprint(a), "y": fingerprint(a)})
    with pytest.raises(ValueError, match=r"different stocks: x, y \(from stock \w+\) vs z \(from stock \w+\)"):
        check_one_stock({"x": fingerprint(a), "y": fingerprint(a), "z": fingerprint(b)})
    with pytest.raises(ValueError, match="y carry no stock fingerprint"):
        check_one_stock({"x": fingerprint(a), "y": None})


def test_task_vectors_and_distance():
    origin = {"w": torch.tensor([1.0, 0.0, 0.0])}
    a = {"w": torch.tensor([2.0, 0.0, 0.0])}
    b = {"w": torch.tensor([3.0, 0.0, 0.0])}
    c = {"w": torch.tensor([1.0, 5.0, 0.0])}
    assert task_vector_cos(a, b, origin) == pytest.approx(1.0, abs=1e-12)
    assert task_vector_cos(a, c, origin) == pytest.approx(0.0, abs=1e-12)
    assert dist_from_stock(c, origin) == pytest.approx(5.0, abs=1e-12)


def test_cls_features_keep_every_patch_in_order_and_restore_the_mask_ratio():
    stock = build_stock(TINY, 1, 0).eval()
    encoder = encoder_of(stock)
    images = torch.rand(4, 1, 8, 8)
    z = cls_features(encoder, images)
    assert encoder.config.mask_ratio == 0.75  # restored after the unmasked pass
    # the same pass with another (identity-ordered) noise: no patch dropped, none shuffled
    with torch.no_grad():
        encoder.config.mask_ratio = 0.0
        full = encoder(pixel_values=images, noise=torch.arange(4.0).expand(4, -1)).last_hidden_state
        encoder.config.mask_ratio = 0.75
    assert full.shape[1] == 1 + 4 and torch.allclose(z, full[:, 0], atol=1e-6)


# the shared probe h0 ---------------------------------------------------------------------------------
def test_folded_probe_on_raw_features_equals_the_probe_on_standardised_ones():
    torch.manual_seed(0)
    x = torch.randn(50, 6) * torch.tensor([0.1, 1, 3, 0.5, 2, 7]) + torch.tensor([1.0, -2, 0, 3, 5, -1])
    mean, std = x.mean(0), x.std(0)
    probe = torch.nn.Linear(6, 4)
    folded = fold_standardisation(probe, mean, std)
    assert torch.allclose(folded(x), probe((x - mean) / std), atol=1e-5)


# SSL losses at known inputs ------------------------------------------------------------------------------
def test_masked_patch_mse_by_hand_and_equal_to_transformers_mae_loss():
    pred = torch.tensor([[[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]]])
    target = torch.zeros(1, 3, 2)
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # patches 0 and 2 removed
    assert float(masked_patch_mse(pred, target, mask)) == pytest.approx((1.0 + 2.0) / 2, abs=1e-7)
    stock = build_stock(TINY, 1, 0)
    images = torch.rand(3, 1, 8, 8)
    out = stock(pixel_values=images, noise=torch.rand(3, 4, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        ours = float(masked_patch_mse(out.logits, stock.patchify(images), out.mask))
    assert ours == pytest.approx(float(out.loss.detach()), rel=1e-6)


@pytest.mark.parametrize("tau", [0.2, 1.0])
def test_mocov3_loss_closed_form(tau):
    batch = 4
    q = torch.eye(batch, 6) * 3.0  # scale does not matter: rows are L2-normalised
    k = torch.eye(batch, 6)
    expected = 2 * tau * math.log(1 + (batch - 1) * math.exp(-1 / tau))
    assert float(mocov3_loss(q, k, tau)) == pytest.approx(expected, rel=1e-6)


def test_mocov3_loss_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=1, keepdims=True)
    logits = qn @ kn.T / 0.2
    log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = 2 * 0.2 * -np.mean(np.diag(log_softmax))
    assert float(mocov3_loss(torch.tensor(q), torch.tensor(k), 0.2)) == pytest.approx(expected, rel=1e-10)


def test_mmcr_loss_closed_forms():
    eye = torch.eye(8)
    u, same = eye[:3] * 2.0, eye[:3]  # normalised inside: scale is irrelevant
    assert float(mmcr_loss(u, same, local=False)) == pytest.approx(-1.0, abs=1e-6)
    assert float(mmcr_loss(u, same, local=True)) == pytest.approx(-1.0 + math.sqrt(2), abs=1e-6)
    orthogonal = eye[3:6]  # wᵢ ⊥ uᵢ and every other row
    assert float(mmcr_loss(same, orthogonal, local=False)) == pytest.approx(-math.sqrt(2) / 2, abs=1e-6)
    assert float(mmcr_loss(same, orthogonal, local=True)) == pytest.approx(2 - math.sqrt(2) / 2, abs=1e-6)


def exact_epps_pulley(s: np.ndarray) -> float:
    """N ∫_ℝ |φ̂(t) − e^{−t²/2}|² e^{−t²/2} dt in closed form (Gaussian integrals)."""
    n = len(s)
    diff = s[:, None] - s[None, :]
    return n * (np.sqrt(2 * np.pi) * np.exp(-diff ** 2 / 2).mean()
                - 2 * np.sqrt(np.pi) * np.exp(-s ** 2 / 4).mean() + np.sqrt(2 * np.pi / 3))


def test_sigreg_integral_against_quadrature_and_the_closed_form():
    from scipy.integrate import quad

    rng = np.random.default_rng(0)
    s = rng.standard_normal(40) * 1.3 + 0.4  # a shifted, wider sample: the imaginary part matters

    def integrand(t):
        real = np.cos(t * s).mean() - np.exp(-t ** 2 / 2)
        imaginary = np.sin(t * s).mean()
        return (real ** 2 + imaginary ** 2) * np.exp(-t ** 2 / 2)

    reference = len(s) * quad(integrand, -5, 5, epsabs=1e-13, epsrel=1e-12, limit=200)[0]
    fine = float(epps_pulley(torch.tensor(s[:, None]), knots=4001)[0])
    assert fine == pytest.approx(reference, rel=1e-6)
    # the tails beyond ±5 weigh < e^{-12.5}: the closed form over ℝ is the same number
    assert reference == pytest.approx(exact_epps_pulley(s), rel=1e-5)
    # the spec's 17 knots: a coarse but close trapezoid
    coarse = float(epps_pulley(torch.tensor(s[:, None]), knots=17)[0])
    assert coarse == pytest.approx(reference, rel=0.05)


def test_sigreg_counts_the_imaginary_part_and_the_factor_n():
    from scipy.integrate import quad

    c = 0.8
    point = torch.full((10, 1), c, dtype=torch.float64)  # φ̂(t) = e^{itc}: |φ̂ − g|² = 1 − 2cos(tc)g + g²
    on_interval = 10 * quad(lambda t: (1 - 2 * np.cos(t * c) * np.exp(-t ** 2 / 2) + np.exp(-t ** 2))
                            * np.exp(-t ** 2 / 2), -5, 5, epsabs=1e-13, epsrel=1e-12)[0]
    assert float(epps_pulley(point, knots=4001)[0]) == pytest.approx(on_interval, rel=1e-7)
    over_r = 10 * (np.sqrt(2 * np.pi) - 2 * np.sqrt(np.pi) * np.exp(-c ** 2 / 4) + np.sqrt(2 * np.pi / 3))
    assert on_interval == pytest.approx(over_r, rel=2e-6)  # a point mass's φ̂ does not decay: tail ≈ 1.4e-6
    sample = torch.randn(30, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    doubled = torch.cat([sample, sample])  # same empirical distribution, twice the N
    assert torch.allclose(epps_pulley(doubled), 2 * epps_pulley(sample), rtol=1e-12)


def test_sigreg_directions_are_unit_vectors_seeded_by_the_step():
    # in one dimension every unit direction is ±1 and the statistic is even in s: SIGReg is the Epps–Pulley
    # statistic of the sample itself, at every step (a direction of another norm would rescale s)
    s = torch.randn(50, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 1.7 + 0.3
    for step in (0, 1, 9):
        assert float(sigreg(s, step)) == pytest.approx(float(epps_pulley(s)[0]), rel=1e-12)
    e = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    assert float(sigreg(e, step=3)) == float(sigreg(e, step=3))  # seeded by the step
    assert float(sigreg(e, step=3)) != float(sigreg(e, step=4))  # drawn afresh at every step


def test_sigreg_is_the_mean_statistic_over_uniformly_random_directions():
    """With many directions SIGReg converges to the average over the circle of the closed-form statistic
    of the projected sample (an independent reference: Gaussian integrals on a fine angle grid)."""
    rng = np.random.default_rng(3)
    e = rng.standard_normal((40, 2)) * np.array([2.0, 0.5]) + np.array([0.5, 0.0])  # anisotropic: direction matters
    angles = np.linspace(0, 2 * np.pi, 2000, endpoint=False)
    per_angle = np.array([exact_epps_pulley(e @ np.array([np.cos(a), np.sin(a)])) for a in angles])
    directions = 4000
    ours = float(sigreg(torch.tensor(e), step=0, directions=directions, knots=201))
    standard_error = per_angle.std() / math.sqrt(directions)
    assert abs(ours - per_angle.mean()) < 4 * standard_error  # Monte Carlo over directions, 4 standard errors
    assert per_angle.std() > 0.1 * per_angle.mean()  # the directions really differ, so this can fail


def test_lejepa_loss_by_hand():
    e = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    identical = torch.stack([e, e])
    assert float(lejepa_loss(identical, 0.05, step=2)) == pytest.approx(0.05 * float(sigreg(e, 2)), rel=1e-6)
    shifted = torch.stack([e, e + torch.tensor([2.0, 0, 0, 0])])  # each view 1 away from the centre
    expected = 0.95 * 1.0 + 0.05 * 0.5 * (float(sigreg(e, 2)) + float(sigreg(shifted[1], 2)))
    assert float(lejepa_loss(shifted, 0.05, step=2)) == pytest.approx(expected, rel=1e-6)


def test_ingredient_names_follow_the_spec():
    names = [r.name for r in parse_ingredients("mae:mask=0.5,mae,mocov3:tau=0.2,mocov3:tau=1.0,mmcr,"
                                               "mmcr:local=1,lejepa")]
    assert names == ["mae_m50", "mae_m75", "mocov3_t0.2", "mocov3_t1", "mmcr_global", "mmcr_local", "lejepa"]
    with pytest.raises(ValueError, match="unknown SSL algorithm 'simclr'"):
        parse_ingredients("simclr")


# selection, seasoning, evaluation primitives ----------------------------------------------------------------
def test_greedy_soup_keeps_an_ingredient_only_if_the_held_out_score_does_not_drop():
    scores = [0.5, 0.9, 0.7, 0.6]
    soup_scores = {(1, 2): 0.92, (1, 2, 3): 0.91, (1, 2, 0): 0.92}
    kept, best = greedy_soup(scores, lambda idx: soup_scores[tuple(idx)])
    assert kept == [1, 2, 0] and best == 0.92  # 3 lowered it; 0 kept it equal


def test_neighbour_entropy_of_indistinguishable_neighbours_is_log_k():
    features = torch.ones(20, 5)
    assert float(neighbour_entropy(features, top_k=16, temperature=0.07)) == pytest.approx(math.log(16), rel=1e-6)


def test_season_weights_are_a_softmax_and_souping_identical_ingredients_changes_nothing():
    encoder = encoder_of(build_stock(TINY, 1, 0))
    module = FeatureNet(encoder)
    state = {k: v for k, v in module.state_dict().items() if torch.is_floating_point(v)}
    pool = torch.rand(40, 1, 8, 8)
    weights, losses = season_weights(module, [state, state, state], pool, epochs=3, steps_per_epoch=2,
                                     batch_size=40, top_k=4, temperature=0.07, lr=0.1, final_lr=0.01, seed=0,
                                     device="cpu")
    assert sum(weights) == pytest.approx(1.0, abs=1e-6) and min(weights) > 0 and len(losses) == 3
    with torch.no_grad():  # whatever β is, the soup of identical states is the state: a constant loss
        expected = float(neighbour_entropy(module(pool), 4, 0.07))
    assert losses == pytest.approx([expected] * 3, rel=1e-5)


def test_weighted_knn_and_the_interpolation_barrier():
    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    queries = torch.tensor([[1.0, 0.05], [0.05, 1.0]])
    assert knn_predict(bank, labels, queries, classes=2, k=3).tolist() == [0, 1]
    alphas = [0.0, 0.5, 1.0]
    assert interpolation_barrier([1.0, 2.0, 3.0], alphas) == pytest.approx(0.0)
    assert interpolation_barrier([1.0, 2.5, 1.0], alphas) == pytest.approx(1.5)
    assert interpolation_barrier([1.0, 0.5, 1.0], alphas) == pytest.approx(0.0)  # the endpoints bound it below


def test_fine_tune_starts_from_copies_and_trains_every_parameter():
    from icml.methods.soup.soups import fine_tune

    stock = build_stock(TINY, 1, 0)
    encoder = encoder_of(stock)
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    assert not encoder.embeddings.position_embeddings.requires_grad  # MAE's fixed sin-cos while pre-training
    head = torch.nn.Linear(16, 3)
    model, curve = fine_tune(encoder, head, torch.rand(12, 1, 8, 8), torch.randint(0, 3, (12,)), steps=2,
                             batch_size=6, lr=1e-2, weight_decay=0.0, warmup_frac=0.5, seed=0, device="cpu")
    assert all(torch.equal(v, encoder.state_dict()[k]) for k, v in before.items())  # the caller's encoder is untouched
    moved = (model.encoder.embeddings.position_embeddings - encoder.embeddings.position_embeddings).detach()
    assert float(moved.abs().max()) > 0 and len(curve) == 2


# the SSL stage on the real ViT ----------------------------------------------------------------------------
def test_mocov3_keys_carry_no_gradient():
    """The encoder's gradient of the MoCo v3 loss is that of the query path alone: the same loss with keys
    from a frozen copy of the encoder gives the same gradient; keys with a gradient would not."""
    (recipe,) = parse_ingredients("mocov3:tau=0.2")
    stock = build_stock(TINY, 1, 0)
    encoder = encoder_of(stock)
    head = projector(16, 0)
    images = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))

    def gradient(loss):
        return torch.autograd.grad(loss, [p for p in encoder.parameters() if p.requires_grad], allow_unused=True)

    ours = gradient(ssl_loss(recipe, stock, head, images, torch.Generator().manual_seed(1), 0))
    generator = torch.Generator().manual_seed(1)
    v1, v2 = ssl_view(images, generator), ssl_view(images, generator)
    frozen = copy.deepcopy(encoder).requires_grad_(False)
    reference = gradient(mocov3_loss(head(cls_features(encoder, v1)), cls_features(frozen, v2), 0.2))
    with_key_gradient = gradient(mocov3_loss(head(cls_features(encoder, v1)), cls_features(encoder, v2), 0.2))
    pairs = [(a, b) for a, b in zip(ours, reference) if a is not None]
    assert len(pairs) > 10 and all(torch.equal(a, b) for a, b in pairs)
    assert any(not torch.allclose(a, c) for a, c in zip(ours, with_key_gradient) if a is not None)


@pytest.mark.parametrize("augment", [True, False])
def test_mae_ingredient_loss_counts_only_masked_patches_of_an_augmented_view(augment):
    """Through the cook path: the loss is the pixel MSE over the masked patches only (its gradient is zero at
    every visible patch), against the image the model actually saw — an augmented view (as released), or
    the raw image in the mae_augment=false ablation."""
    (recipe,) = parse_ingredients("mae:mask=0.5")
    stock = build_stock(TINY, 1, 0)
    seen = {}
    stock.register_forward_pre_hook(lambda module, args, kwargs: seen.update(pixels=kwargs["pixel_values"]),
                                    with_kwargs=True)

    def keep(module, args, out):
        out.logits.retain_grad()
        seen["out"] = out

    stock.register_forward_hook(keep)
    images = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    loss = ssl_loss(recipe, stock, None, images, torch.Generator().manual_seed(1), 0, mae_augment=augment)
    loss.backward()
    out, pixels = seen["out"], seen["pixels"]
    assert torch.equal(pixels, images) is not augment  # the MAE ingredient sees an augmented view
    mask = out.mask.bool()
    assert mask.sum(1).tolist() == [2] * 4  # ρ = 0.5 of the 4 patches
    grad = out.logits.grad
    assert float(grad[~mask].abs().max()) == 0.0 and float(grad[mask].abs().min()) > 0
    patches = pixels.detach().unfold(2, 4, 4).unfold(3, 4, 4).reshape(4, 4, 16).numpy()  # 2×2 patches, row-major
    predicted = out.logits.detach().numpy()
    per_patch = ((predicted - patches) ** 2).mean(-1)
    assert float(loss.detach()) == pytest.approx(per_patch[mask.numpy()].mean(), rel=1e-6)


def test_optimiser_schedule_is_linear_warmup_then_cosine():
    """lr_s = lr·s/w for s < w, then lr·½(1 + cos(π(s − w)/(T − w))): 10 % warm-up from 0, cosine to 0."""
    total, lr = 50, 0.3
    optimizer, schedule = adamw([torch.nn.Parameter(torch.zeros(1))], lr, 0.0, total, 0.1)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    warmup = 5
    expected = [lr * s / warmup if s < warmup else lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
                for s in range(total)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
