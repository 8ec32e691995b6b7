"""SECNet's identities: identity-initialised Fourier filters, Temporal-FA as a circular convolution
(and its shift equivariance), D-FPS, EF-KNN, CES, group normalisation, polarity use, the analytic
MAC counts of a config computed by hand, and the sample-level vote."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from icml.methods.event_classify.costs import fft_macs, layer_macs, secnet_costs
from icml.methods.event_classify.data import strip_input
from icml.methods.event_classify.model import (ABLATION_OPTIONS, Arch, FourierFilter, SECNet, SpatialFA,
                                               TemporalFA, build_model, farthest_point_sample, gather, knn)
from icml.methods.event_classify.training import majority_vote


def cloud(b=2, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, n, 4, generator=g)
    x[..., 0] = x[..., 0].sort(-1).values
    x[..., 3] = (x[..., 3] > 0.5).float()
    return x


def random_filter(layer, seed=1):
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(seed)))


# Fourier aggregation -----------------------------------------------------------------------------
def test_identity_initialised_fourier_layers_are_exact_identities():
    x = torch.randn(2, 6, 5, 20, dtype=torch.float64)
    spatial = SpatialFA(20, 5).double()
    torch.testing.assert_close(spatial.filter(x), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(spatial(x), F.gelu(x), rtol=0, atol=1e-12)
    g = torch.randn(3, 10, 7, dtype=torch.float64)
    temporal = TemporalFA(10, 7).double()
    torch.testing.assert_close(temporal.filter(g), g, rtol=0, atol=1e-12)
    torch.testing.assert_close(temporal(g), F.gelu(g), rtol=0, atol=1e-12)
    odd = TemporalFA(9, 7).double()  # irfft needs n= to return 9 tokens, not 8
    torch.testing.assert_close(odd.filter(g[:, :9]), g[:, :9], rtol=0, atol=1e-12)


@pytest.mark.parametrize("tokens", [8, 9])
def test_temporal_fa_is_a_per_channel_circular_convolution(tokens):
    layer = TemporalFA(tokens, 5).double()
    random_filter(layer)
    g = torch.randn(2, tokens, 5, dtype=torch.float64)
    kernel = torch.fft.irfft(torch.view_as_complex(layer.weight), n=tokens, dim=0)  # (S, D')
    explicit = torch.zeros_like(g)
    for n in range(tokens):
        for m in range(tokens):
            explicit[:, n] += g[:, m] * kernel[(n - m) % tokens]
    torch.testing.assert_close(layer.filter(g), explicit, rtol=0, atol=1e-12)


def test_temporal_fa_is_equivariant_to_circular_token_shifts():
    layer = TemporalFA(12, 6).double()
    random_filter(layer, 4)
    g = torch.randn(2, 12, 6, dtype=torch.float64)
    for shift in (1, 5):
        torch.testing.assert_close(layer(torch.roll(g, shift, 1)), torch.roll(layer(g), shift, 1), rtol=0,
                                   atol=1e-12)


def test_spatial_fa_filters_along_channels_per_neighbour():
    layer = SpatialFA(10, 3).double()
    random_filter(layer, 2)
    x = torch.randn(1, 2, 3, 10, dtype=torch.float64)
    kernel = torch.fft.irfft(torch.view_as_complex(layer.weight), n=10, dim=-1)  # (k, D'): one per neighbour
    explicit = torch.zeros_like(x)
    for j in range(3):
        for c in range(10):
            for m in range(10):
                explicit[:, :, j, c] += x[:, :, j, m] * kernel[j, (c - m) % 10]
    torch.testing.assert_close(layer.filter(x), explicit, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape, dim, filter_shape", [((3, 5, 4, 10), -1, (4, 6)), ((3, 5, 4, 9), -1, (4, 5)),
                                                    ((2, 8, 5), 1, (5, 5)), ((2, 7, 5), 1, (4, 5))])
def test_fourier_filter_matches_autograd_through_the_fft_ops(shape, dim, filter_shape):
    """The hand-written backward (adjoint filter, one-sided bin weights) against autograd through
    rfft → multiply → irfft, for even and odd lengths along channels and along tokens."""
    g = torch.Generator().manual_seed(len(shape) + shape[dim])
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(filter_shape, generator=g, dtype=torch.complex128, requires_grad=True)
    n = shape[dim]
    reference = torch.fft.irfft(torch.fft.rfft(x, dim=dim, norm="ortho") * v, n=n, dim=dim, norm="ortho")
    ours = FourierFilter.apply(x, v, dim)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-13)
    upstream = torch.randn(shape, generator=g, dtype=torch.float64)
    for mine, theirs in zip(torch.autograd.grad(ours, (x, v), upstream),
                            torch.autograd.grad(reference, (x, v), upstream)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: FourierFilter.apply(a, b, dim), (x, v))


# grouping ----------------------------------------------------------------------------------------
def brute_force_fps(points: np.ndarray, n: int, start: int) -> list[int]:
    chosen = [start]
    for _ in range(n - 1):
        dist = np.min(((points[:, None] - points[chosen][None]) ** 2).sum(-1), axis=1)
        chosen.append(int(np.argmax(dist)))
    return chosen


def test_fps_is_sorted_starts_at_zero_and_matches_brute_force():
    pts = torch.rand(3, 50, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    starts = torch.tensor([0, 17, 42])
    idx = farthest_point_sample(pts, 12, starts)
    assert torch.equal(idx, idx.sort(-1).values)
    for b in range(3):
        assert idx[b].tolist() == sorted(brute_force_fps(pts[b].numpy(), 12, int(starts[b])))
    model = SECNet(Arch(64, (16, 8), 4, 8, 3), seed=5)
    model.eval()
    assert model.fps_start(4, 64, "cpu").tolist() == [0, 0, 0, 0]
    model.train()
    again = SECNet(Arch(64, (16, 8), 4, 8, 3), seed=5).train()
    assert torch.equal(model.fps_start(4, 64, "cpu"), again.fps_start(4, 64, "cpu"))  # seeded


def test_knn_equals_brute_force_with_sorted_indices():
    g = torch.Generator().manual_seed(6)
    pts, queries = torch.randn(2, 40, 9, generator=g, dtype=torch.float64), torch.randn(2, 7, 9, generator=g,
                                                                                      dtype=torch.float64)
    idx = knn(queries, pts, 5)
    dist = ((queries[:, :, None] - pts[:, None]) ** 2).sum(-1).numpy()
    expected = np.sort(np.argsort(dist, -1)[..., :5], -1)
    assert np.array_equal(idx.numpy(), expected)


def stage_groups(variant="secnet"):
    model = SECNet(Arch(64, (16, 8), 6, 8, 3), ABLATION_OPTIONS[variant], seed=0).double().eval()
    stage = model.stages[0]
    with torch.no_grad():
        stage.w.copy_(torch.tensor([2.0, 0.5, 1.5, 3.0]))
    x = cloud().double()
    feats = model.embed(x.transpose(1, 2)).transpose(1, 2)
    grouped, centres, fps, neighbours = stage.group(x, feats, torch.zeros(2, dtype=torch.long))
    return x, feats, stage, grouped, centres, fps, neighbours


def test_ef_knn_uses_features_ces_is_the_neighbour_mean_and_groups_are_normalised():
    x, feats, stage, grouped, centres, fps, neighbours = stage_groups()
    scaled = x * stage.w
    # EF-KNN: neighbours of each FPS centroid in feature space (brute force)
    for b in range(2):
        f = feats[b].detach().numpy()
        d = ((f[fps[b].numpy()][:, None] - f[None]) ** 2).sum(-1)
        assert np.array_equal(neighbours[b].numpy(), np.sort(np.argsort(d, -1)[:, :6], -1))
    # FPS runs on the scaled (t, x, y)
    assert fps[0].tolist() == sorted(brute_force_fps(scaled[0, :, :3].detach().numpy(), 16, 0))
    # CES: the mean of the neighbours' scaled coordinates (all four)
    torch.testing.assert_close(centres, gather(scaled, neighbours).mean(2), rtol=0, atol=1e-12)
    d = feats.shape[-1]
    centred = grouped[..., :d + 4]
    torch.testing.assert_close(centred.mean(2), torch.zeros_like(centred.mean(2)), rtol=0, atol=1e-10)
    raw = torch.cat([gather(feats, neighbours), gather(scaled, neighbours)], -1)
    raw = raw - raw.mean(2, keepdim=True)
    std = raw.reshape(2, -1).std(-1)
    torch.testing.assert_close(centred, raw / (std[:, None, None, None] + 1e-5), rtol=0, atol=1e-12)
    torch.testing.assert_close(grouped[..., d + 4:], gather(feats, fps)[:, :, None].expand(-1, -1, 6, -1),
                               rtol=0, atol=0)
    assert grouped.shape[-1] == 2 * d + 4


def test_ablation_groupings():
    x, feats, stage, _, centres, fps, neighbours = stage_groups("secnet_fps_centroid")
    torch.testing.assert_close(centres, gather(x * stage.w, fps), rtol=0, atol=1e-12)
    x, feats, stage, _, _, fps, neighbours = stage_groups("secnet_coord_knn")
    scaled = (x * stage.w)[0, :, :3].detach().numpy()
    d = ((scaled[fps[0].numpy()][:, None] - scaled[None]) ** 2).sum(-1)
    assert np.array_equal(neighbours[0].numpy(), np.sort(np.argsort(d, -1)[:, :6], -1))


def test_w_learns_through_the_scaled_coordinates_unless_fixed():
    x, y = cloud(4), torch.tensor([0, 1, 2, 0])
    for variant, learns in (("secnet", True), ("secnet_fixed_w", False)):
        torch.manual_seed(0)
        model = build_model(variant, Arch(64, (16, 8), 4, 8, 3), (34, 34))
        F.cross_entropy(model(x), y).backward()
        for stage in model.stages:
            assert stage.w.requires_grad is learns
            assert (stage.w.grad is not None and bool(stage.w.grad.abs().sum() > 0)) is learns


def test_polarity_changes_the_output_and_no_polarity_is_invariant():
    torch.manual_seed(0)
    model = build_model("secnet", Arch(64, (16, 8), 4, 8, 3), (34, 34)).eval()
    x = cloud()
    flipped = x.clone()
    flipped[..., 3] = 1 - flipped[..., 3]
    with torch.no_grad():
        assert (model(x) - model(flipped)).abs().max() > 1e-4
        stripped = torch.from_numpy(strip_input(x.numpy(), "secnet_no_polarity", 0))
        stripped_flip = torch.from_numpy(strip_input(flipped.numpy(), "secnet_no_polarity", 0))
        assert torch.equal(model(stripped), model(stripped_flip))
    no_pt = strip_input(x.numpy(), "secnet_no_pt", 0)
    assert (no_pt[..., 3] == 0).all() and (np.diff(no_pt[..., 0], axis=1) >= 0).all()
    for b in range(2):  # t permuted across events: the same t values, no longer tied to (x, y)
        assert np.allclose(np.sort(no_pt[b, :, 0]), np.sort(x[b, :, 0].numpy()))
        assert not np.allclose(no_pt[b, :, 1], x[b, :, 1].numpy())


# analytic MACs -----------------------------------------------------------------------------------
def test_mac_closed_forms_by_hand():
    """N=32, one stage S=8, k=4, D₀=6 (D'=16), 3 classes."""
    assert fft_macs(16, 32) == 16 * 32 * 4 + 2 * 16 * 32 == 3072
    cost = secnet_costs(32, (8,), 4, 6, 3)
    assert cost["macs_embed"] == 4 * 6 * 32 == 768
    assert cost["macs_spatial_fa"] == 2 * 3072 + 4 * 32 * 9 == 7296  # rFFT + irFFT over 16 channels, 32 columns
    assert cost["macs_pool"] == 16 * 32 + 16 * 32 == 1024
    assert cost["macs_temporal_fa"] == 2 * (8 * 16 * 3 + 2 * 8 * 16) + 4 * 5 * 16 == 1600
    assert cost["macs_residual"] == 2 * 16 * 8 * 8 == 2048
    assert cost["macs_head"] == 2 * 16 * 256 + 256 * 3 == 8960
    assert cost["macs_total"] == 768 + 7296 + 1024 + 1600 + 2048 + 8960 == 21696
    assert cost["grouping_ops"] == 8 * 32 * 3 + 8 * 32 * 6 == 2304
    assert cost["params_temporal_fa"] == 2 * 5 * 16 == 160
    attn = secnet_costs(32, (8,), 4, 6, 3, temporal="attn")
    assert attn["macs_temporal_fa"] == 4 * 16 * 16 * 8 + 2 * 8 * 8 * 16 == 10240
    # cross-check the layers' share against forward hooks on the real networks
    arch = Arch(32, (8,), 4, 6, 3)
    x = cloud(1, 32)
    secnet = build_model("secnet", arch, (34, 34)).eval()
    assert layer_macs(secnet, x) == 768 + 2048 + 8960 + 16 * 32  # + the pool's score layer
    assert sum(m.weight.numel() for m in secnet.modules() if isinstance(m, TemporalFA)) == 160
    assert layer_macs(build_model("secnet_attn", arch, (34, 34)).eval(), x) == 768 + 2048 + 8960 + 512 + 4 * 16 * 16 * 8
    assert attn["macs_temporal_scores"] == 2 * 8 * 8 * 16 and cost["macs_temporal_scores"] == 0


def test_macs_of_the_specs_nmnist_config_by_hand():
    """N = 4096, S = 512/256/128, k = 24, D₀ = 32 (D' = 68, 140, 284), 10 classes, worked out stage
    by stage with the spec's rules (rFFT/irFFT over L with C columns: L·C·⌈log₂L⌉ + 2LC)."""
    spec = secnet_costs(4096, (512, 256, 128), 24, 32, 10)
    assert spec["macs_embed"] == 4 * 32 * 4096 == 524_288
    # spatial, per stage 2·FFT(D', S·k) + 4·S·k·(D'/2 + 1): 16,760,832 + 18,948,096 + 20,951,040
    assert spec["macs_spatial_fa"] == (2 * (68 * 12288 * 7 + 2 * 68 * 12288) + 4 * 12288 * 35
                                       + 2 * (140 * 6144 * 8 + 2 * 140 * 6144) + 4 * 6144 * 71
                                       + 2 * (284 * 3072 * 9 + 2 * 284 * 3072) + 4 * 3072 * 143) == 56_659_968
    assert spec["macs_pool"] == 2 * (68 * 12288 + 140 * 6144 + 284 * 3072) == 5_136_384
    # temporal, per stage 2·FFT(S, D') + 4·(S/2 + 1)·D': 835,856 + 789,040 + 728,176
    assert spec["macs_temporal_fa"] == 835_856 + 789_040 + 728_176 == 2_353_072
    assert spec["macs_residual"] == 2 * (68 * 34 * 512 + 140 * 70 * 256 + 284 * 142 * 128) == 17_709_056
    assert spec["macs_head"] == 2 * 284 * 256 + 256 * 10 == 147_968
    assert spec["macs_total"] == 82_530_736  # 0.083 G (the spec's "≈ 0.05 G" is approximate; README)
    attn = secnet_costs(4096, (512, 256, 128), 24, 32, 10, temporal="attn")
    # the attention baseline's S² part, 2·S²·D' per stage, and its total with the 4·D'²·S projections
    assert attn["macs_temporal_scores"] == 2 * (512 ** 2 * 68 + 256 ** 2 * 140 + 128 ** 2 * 284) == 63_307_776
    assert attn["macs_temporal_fa"] == 4 * (68 ** 2 * 512 + 140 ** 2 * 256 + 284 ** 2 * 128) + 63_307_776


def test_sweep_slopes_fa_n_log_n_and_attention_quadratic():
    ns = np.array([1024, 2048, 4096, 8192])
    fa = [secnet_costs(n, (n // 8, n // 16, n // 32), 24, 32, 10)["macs_temporal_fa"] for n in ns]
    attn = [secnet_costs(n, (n // 8, n // 16, n // 32), 24, 32, 10, temporal="attn")["macs_temporal_fa"] for n in ns]
    fixed = [secnet_costs(n, (64, 32, 16), 24, 32, 10) for n in ns]
    slope = lambda v: np.polyfit(np.log(ns), np.log(v), 1)[0]  # noqa: E731
    assert 1.0 < slope(fa) < 1.2
    local = np.diff(np.log2(attn))  # per doubling of N: the S² term takes over from the projections
    assert (np.diff(local) > 0).all() and local[-1] > 1.5
    scores = [secnet_costs(n, (n // 8, n // 16, n // 32), 24, 32, 10, temporal="attn")["macs_temporal_scores"]
              for n in ns]
    assert slope(scores) == pytest.approx(2.0, abs=1e-12)  # the S² part alone: exactly quadratic
    assert len({c["macs_spatial_fa"] + c["macs_temporal_fa"] for c in fixed}) == 1  # S fixed: FA constant
    assert slope([c["macs_embed"] for c in fixed]) == pytest.approx(1.0)


# vote ---------------------------------------------------------------------------------------------
def test_majority_vote_with_ties_broken_by_summed_logits():
    logits = np.array([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0],  # sample 7: class 1 by 2 votes to 1
                       [5.0, 0.0, 0.0], [0.0, 1.0, 0.0],  # sample 8: tie 0 vs 1; logits sum 5 vs 1 -> 0
                       [0.0, 0.0, 1.0]])
    marks = np.array([7, 7, 7, 8, 8, 9])
    ids, preds = majority_vote(logits, marks)
    assert ids.tolist() == [7, 8, 9] and preds.tolist() == [1, 0, 2]
