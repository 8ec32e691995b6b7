"""explain-vit's identities on a tiny float64 ViT: the effective mode keeps forward values bit for bit and is
undone afterwards; with every bias zeroed Σ W_eff⊙x = z_y; the linearised sublayers have their closed-form
backward passes; the Reynolds average over a full group of cyclic shifts is exactly shift-equivariant; and the
aggregation, kernel-scaling and metric definitions have their limiting cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icml.methods.explain_vit import attribution as A
from icml.methods.explain_vit import metrics as M
from icml.methods.explain_vit.config import preset
from icml.methods.explain_vit.effective import effective_mode, is_patched, zero_biases
from icml.methods.explain_vit.model import Classifier, build_toy

EPS = torch.finfo(torch.float64).eps
ALL_ARMS = ["input_x_grad", "weff", "weff_eq", "weff_eq_lp", "dave_nopost", "dave", "saliency",
            "integrated_gradients", "smoothgrad", "attn_rollout", "gae", "gradcam", "random"]


def tiny_cfg():
    cfg = preset("smoke")
    cfg.data_cfg.image_size = 16
    cfg.vit.hidden_size, cfg.vit.layers, cfg.vit.heads, cfg.vit.intermediate_size = 32, 2, 2, 64
    cfg.dave.n_samples, cfg.eval.ig_steps, cfg.eval.smoothgrad_n = 4, 4, 4
    return cfg


@pytest.fixture(scope="module")
def clf():
    model = build_toy(tiny_cfg(), 0).double().eval()
    with torch.no_grad():  # a non-trivial trained-looking state: random biases, LayerNorm affines
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    half = torch.full((1, 3, 1, 1), 0.5, dtype=torch.float64)
    return Classifier(model, half, half, 16, 4, [str(i) for i in range(6)])


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 3, 16, 16, generator=g, dtype=torch.float64), torch.tensor([0, 2, 5])


def test_forward_bit_identical_and_model_restored(clf, batch):
    x, t = batch
    state = {k: v.clone() for k, v in clf.model.state_dict().items()}
    with torch.no_grad():
        before = clf.logits(x)
        with effective_mode(clf.model):
            assert is_patched(clf.model)
            during = clf.logits(x)
    maps = A.explain(clf, x, t, ALL_ARMS, tiny_cfg().dave, tiny_cfg().eval, 0.3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = clf.logits(x)
    assert torch.equal(before, during) and torch.equal(before, after)  # bit for bit
    assert not is_patched(clf.model)
    assert all(torch.equal(v, clf.model.state_dict()[k]) for k, v in state.items())
    assert set(maps) == set(ALL_ARMS) and all(m.maps.shape == (3, 16, 16) for m in maps.values())
    with pytest.raises(RuntimeError), effective_mode(clf.model):  # restored on exceptions too
        raise RuntimeError
    assert not is_patched(clf.model)


def test_completeness_with_zeroed_biases(clf, batch):
    x, t = batch
    twin = Classifier(zero_biases(clf.model), clf.mean, clf.std, 16, 4, clf.classes)
    z = twin.logits(x).gather(1, t[:, None])[:, 0].detach()
    c = (A.effective_gradient(twin, x, t) * x).flatten(1)
    # Σ of C·H·W = 768 products that cancel: the rounding of an n-term sum is bounded by n·eps·Σ|c_i|
    bound = x[0].numel() * EPS * c.abs().sum(1)
    assert ((c.sum(1) - z).abs() <= bound).all()
    # the input gradient is not complete (softmax, GELU, LayerNorm are not homogeneous of degree one)
    ixg = (A.input_gradient(twin, x, t) * x).flatten(1).sum(1)
    assert ((ixg - z).abs() / z.abs()).min() > 1e-3
    # with the biases kept, W_eff⊙x misses the bias contribution
    biased = (A.effective_gradient(clf, x, t) * x).flatten(1).sum(1)
    assert ((biased - clf.logits(x).gather(1, t[:, None])[:, 0]).abs()).min() > 1e-3


def test_linearised_sublayers_closed_forms(clf, batch):
    x, t = batch
    g = torch.Generator().manual_seed(3)
    ln = clf.model.vit.layers[0].layernorm_before
    h = torch.randn(5, 32, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 32, generator=g, dtype=torch.float64)
    with effective_mode(clf.model):
        (grad_ln,) = torch.autograd.grad((ln(h) * v).sum(), h)
        act = clf.model.vit.layers[0].mlp.activation_fn
        (grad_act,) = torch.autograd.grad((act(h) * v).sum(), h)
        z = clf.logits(x).gather(1, t[:, None]).sum()
        attn = clf.model.vit.layers[0].attention
        grads = torch.autograd.grad(z, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], allow_unused=True)
    hd = h.detach()
    centre = torch.eye(32, dtype=torch.float64) - 1 / 32
    sd = torch.sqrt(hd.var(-1, unbiased=False, keepdim=True) + ln.eps)
    expected_ln = ((v * ln.weight.detach()) @ centre) / sd  # γ ⊙ C x / sg(σ): C is symmetric
    np.testing.assert_allclose(grad_ln, expected_ln, rtol=32 * EPS, atol=32 * EPS)  # 32-term sums
    phi = 0.5 * (1 + torch.erf(hd / np.sqrt(2)))
    np.testing.assert_allclose(grad_act, v * phi, rtol=4 * EPS, atol=0)  # one product per entry
    assert grads[0] is None and grads[1] is None  # Q and K only enter through the detached probabilities
    assert torch.count_nonzero(grads[2]) > 0


def test_operator_variation_is_dropped(clf, batch):
    x, t = batch
    full, eff = A.input_gradient(clf, x, t), A.effective_gradient(clf, x, t)
    ratio = (full - eff).flatten(1).norm(dim=1) / full.flatten(1).norm(dim=1)
    assert (ratio > 0.01).all()


def test_reynolds_average_over_cyclic_shifts_is_equivariant(clf, batch):
    x, t = batch
    cfg = tiny_cfg().dave
    group = [lambda v, k=k: torch.roll(v, k, dims=-1) for k in range(16)]  # every horizontal cyclic shift
    gen = torch.Generator().manual_seed(0)
    base = A.sampled_contributions(clf, x, t, cfg, 0.0, gen, warps=group).mean(0)
    for k in (1, 2, 3):
        moved = A.sampled_contributions(clf, torch.roll(x, k, dims=-1), t, cfg, 0.0, gen, warps=group).mean(0)
        # the two sides sum the same 16 gradients in another order: a few eps of |c| per entry
        scale = base.abs().max()
        np.testing.assert_allclose(moved, torch.roll(base, k, dims=-1), rtol=0, atol=64 * EPS * scale)
    single = A.sampled_contributions(clf, torch.roll(x, 1, dims=-1), t, cfg, 0.0, gen, warps=group[:1]).mean(0)
    plain = A.sampled_contributions(clf, x, t, cfg, 0.0, gen, warps=group[:1]).mean(0)
    assert (single - torch.roll(plain, 1, dims=-1)).abs().max() > 1e-3 * plain.abs().max()  # one pass is not


def test_gradient_is_taken_through_the_warp_at_the_clean_input(clf, batch):
    x, t = batch
    cfg = tiny_cfg().dave
    flip = [lambda v: v.flip(-1)]
    c = A.sampled_contributions(clf, x, t, cfg, 0.0, torch.Generator(), warps=flip)[0]
    # z(flip x): its gradient w.r.t. x is the flipped gradient at flip x; multiplied by the clean x
    grad_at_flipped = A.effective_gradient(clf, x.flip(-1), t)
    np.testing.assert_array_equal(c, grad_at_flipped.flip(-1) * x)


def test_noise_schedule_and_mad_mean():
    levels = A.noise_levels(5, 0.4)
    # t_s = linspace(0, α_max, N)[s]: equally spaced up to one rounding of s·α_max/(N − 1)
    np.testing.assert_allclose(levels, [0.0, 0.1, 0.2, 0.3, 0.4], rtol=2 * EPS, atol=0)
    x, xi = torch.ones(5, 1, 1, 1, dtype=torch.float64), torch.zeros(5, 1, 1, 1, dtype=torch.float64)
    np.testing.assert_allclose(A.add_noise(x, levels, xi)[:, 0, 0, 0], 1 - levels, rtol=EPS)
    stack = torch.tensor([[1.0], [1.1], [0.9], [1.0], [50.0]], dtype=torch.float64)  # one outlier
    np.testing.assert_allclose(A.mad_mean(stack), torch.tensor([1.0], dtype=torch.float64), rtol=2 * EPS)
    same = torch.full((4, 2), 3.0, dtype=torch.float64)  # MAD = 0: every entry is kept (the +1e-8 guard)
    np.testing.assert_array_equal(A.mad_mean(same), same[0])


def test_kernel_scaling_rule():
    assert A.scaled_kernel(11, 224) == 11 and A.scaled_kernel(31, 224) == 31
    assert A.scaled_kernel(11, 32) == 3 and A.scaled_kernel(31, 32) == 5 and A.scaled_kernel(31, 64) == 9
    assert A.scaled_kernel(5, 32) == 3  # never below 3


def test_postprocess_range_and_patch_level_upsampling(clf, batch):
    x, t = batch
    m = A.postprocess(torch.randn(2, 3, 16, 16, dtype=torch.float64), tiny_cfg().dave)
    assert m.min() >= 0 and torch.allclose(m.flatten(1).max(1).values, torch.ones(2, dtype=torch.float64))
    rollout = A.attn_rollout(clf, x, t).maps
    assert rollout.shape == (3, 16, 16) and (rollout > 0).all()


def test_metric_limiting_cases():
    inside = np.zeros((1, 4, 8, 8))
    cells = M.cell_masks((8, 8))
    inside[0] = cells  # each target's map lies in its own cell
    assert M.grid_pg(inside)[0] == 1.0
    assert M.grid_pg(np.ones((1, 4, 8, 8)))[0] == 0.25  # uniform = chance
    yy, xx = np.mgrid[0:16, 0:16]
    lattice = np.cos(2 * np.pi * xx / 4)[None]  # period = patch size: all energy on the lattice
    smooth = np.cos(2 * np.pi * xx / 16)[None]
    assert M.lattice_energy(lattice, 4)[0] == pytest.approx(1.0, abs=1e-12)
    assert M.lattice_energy(smooth, 4)[0] == pytest.approx(0.0, abs=1e-12)
    assert M.lattice_grad_ratio(xx[None].astype(float), 4)[0] == pytest.approx(1.0)  # a ramp has no lattice
    blocks = (xx // 4 + yy // 4)[None].astype(float)
    assert np.isinf(M.lattice_grad_ratio(blocks, 4)[0]) or M.lattice_grad_ratio(blocks, 4)[0] > 1e6 or \
        np.isnan(M.lattice_grad_ratio(blocks, 4)[0])
    mask = np.zeros((1, 8, 8), bool)
    mask[0, 2:4, 2:4] = True
    spot = np.zeros((1, 8, 8))
    spot[0, 4, 4] = 1  # one pixel outside the mask but inside its 1-px dilation
    assert M.pointing_game(spot, mask)[0] == 1.0
    spot[0, 4, 4], spot[0, 6, 6] = 0, 1
    assert M.pointing_game(spot, mask)[0] == 0.0
    assert M.pixel_auroc(mask.astype(float), mask)[0] == 1.0
    np.testing.assert_allclose(M.curve_auc(np.full((2, 9), 0.7), 0.9), 0.7, rtol=1e-14)
    a = np.random.default_rng(0).normal(size=(2, 8, 8))
    np.testing.assert_allclose(M.pearson(a, 3 * a + 1), 1.0, rtol=1e-14)
    shifted, original = M.shift_overlap(M.shift_image(torch.from_numpy(a)[:, None], 2)[:, 0], a, 2)
    np.testing.assert_array_equal(shifted, original)
