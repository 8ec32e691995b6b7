"""diverse-init identities: Tweedie x̂₀ and the Langevin update against closed forms for Gaussian data,
prior-only Langevin statistics, η = 0 ≡ the base sampler, batch independence, U decreasing in expectation,
autograd ∇U vs finite differences, the trajectory options, SAIL's restart rule, and the metrics."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from icml.methods.diverse_init import data, divin, metrics
from icml.methods.diverse_init.model import ExactGmmDenoiser, build_gmm, make_scheduler

EPS64 = torch.finfo(torch.float64).eps


class GaussianDenoiser(nn.Module):
    """The exact ε- or v-predictor of x₀|c ~ N(0, s_c² I) (null class: s_u²), in float64."""

    def __init__(self, scheduler, param: str, stds):
        super().__init__()
        self.scheduler, self.param = scheduler, param
        self.var = torch.tensor(stds, dtype=torch.float64) ** 2

    def forward(self, x, t, class_labels):
        v = self.var[class_labels].view((-1,) + (1,) * (x.dim() - 1))
        if self.param == "eps":
            a = float(self.scheduler.alphas_cumprod.double()[int(t)])
            return math.sqrt(1 - a) * x / (a * v + 1 - a)  # E[ε | x_t]
        s = float(self.scheduler.sigmas[int((self.scheduler.timesteps - float(t)).abs().argmin())])  # the step's σ
        denom = (1 - s) ** 2 * v + s ** 2
        return s * x / denom - (1 - s) * v * x / denom  # E[ε − x₀ | x_t]


def posterior_gain(sched: divin.Schedule, var: float, i: int) -> float:
    """E[x₀ | x_t] = gain · x_t for x₀ ~ N(0, var)."""
    if sched.param == "eps":
        a = sched.alpha_bar(i)
        return math.sqrt(a) * var / (a * var + 1 - a)
    s = float(sched.sigmas[i])
    return (1 - s) * var / ((1 - s) ** 2 * var + s ** 2)


def gaussian_pair(param: str, steps: int = 10):
    sched = divin.Schedule(make_scheduler(param), param, steps)
    model = GaussianDenoiser(sched.scheduler, param, [0.5, 1.5, 1.0])  # class 0, class 1, null (index 2)
    return divin.Denoiser(model, null=2), sched


@pytest.fixture(scope="module")
def mlp():
    """A random float64 GMM denoiser (eps) and its 10-step DDIM schedule: any smooth network will do."""
    net = build_gmm(32, seed=3).double().eval().requires_grad_(False)
    return divin.Denoiser(net, null=4), divin.Schedule(make_scheduler("eps"), "eps", 10)


def test_sampler_schedule_starts_where_the_spec_says():
    assert int(divin.Schedule(make_scheduler("eps"), "eps", 50).timesteps[0]) == 981  # DDIM-50, not 999
    flow = divin.Schedule(make_scheduler("flow"), "flow", 10)
    assert flow.t_norm(0) == 1.0 and float(flow.timesteps[0]) == 1000.0


@pytest.mark.parametrize("param, i", [("eps", 0), ("eps", 6), ("flow", 3), ("flow", 8)])
def test_tweedie_is_the_posterior_mean_of_gaussian_data(param, i):
    den, sched = gaussian_pair(param)
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.zeros(64, dtype=torch.long)
    x0 = sched.tweedie(x, den(x, sched.timesteps[i], labels), i)
    # a handful of float64 operations on O(1) values: a few ulps of the largest entry
    assert torch.allclose(x0, posterior_gain(sched, 0.25, i) * x, rtol=0, atol=16 * EPS64 * float(x.abs().max()))


@pytest.mark.parametrize("param", ["eps", "flow"])
@pytest.mark.parametrize("prior, noise", [(True, True), (False, True), (True, False)])
def test_langevin_steps_match_the_closed_form_recursion(param, prior, noise):
    """U = (g_c − g_∅)²‖z‖², so z ← z − η(2τ(g_c − g_∅)²z + z) + √(2η)ξ exactly, ξ from each sample's stream."""
    den, sched = gaussian_pair(param)
    seeds = list(range(40))
    z = divin.initial_noise(seeds, (3,), torch.float64)
    labels = torch.tensor([0, 1] * 20)
    tau, eta, k = 0.7, 0.05, 3
    out = divin.divin_init(den, sched, z, labels, seeds, tau=tau, eta=eta, k_steps=k, prior=prior, noise=noise)
    gain = torch.tensor([posterior_gain(sched, v, 0) for v in (0.25, 2.25)], dtype=torch.float64)[labels]
    c = (gain - posterior_gain(sched, 1.0, 0)).pow(2).view(-1, 1)
    xi = divin.generators(seeds, divin.XI)
    expected = z.clone()
    for _ in range(k):
        expected = expected - eta * (2 * tau * c * expected + (expected if prior else 0))
        if noise:
            expected = expected + math.sqrt(2 * eta) * divin.per_sample_randn(xi, (3,), torch.float64)
    # 3 steps of O(1) arithmetic (autograd gives the same products in another order): tens of ulps
    assert torch.allclose(out.z, expected, rtol=0, atol=64 * EPS64)
    if param == "flow":  # at t = 1 the exact x̂₀ is the data mean for every class: U ≡ 0, no force
        assert float(c.max()) == 0 and float(out.u_before.max()) < (8 * EPS64) ** 2 * 9
    else:
        gains = gain.abs().max() + posterior_gain(sched, 1.0, 0)
        cancel = float(gains / (gain - posterior_gain(sched, 1.0, 0)).abs().min())  # x̂₀(c) − x̂₀(∅) loses digits
        assert torch.allclose(out.u_before, c.flatten() * z.pow(2).sum(1), rtol=32 * EPS64 * cancel ** 2, atol=0)
    assert out.nfe.tolist() == [k] * 40


def test_pull_to_noise_ratio_is_the_first_steps_drift_against_its_kick():
    """pull_noise = ‖ητ∇U‖/‖√(2η)ξ‖ with ∇U = 2(g_c − g_∅)²z (Gaussian data) and ξ the sample's own draw; at
    τ = τ* (median ‖τ∇U‖ = median ‖z‖) the pull is only √(η/2) of the kick in the median: why τ* alone is weak."""
    den, sched = gaussian_pair("eps")
    n, eta = 400, 0.05
    seeds = list(range(n))
    z = divin.initial_noise(seeds, (3,), torch.float64)
    labels = torch.zeros(n, dtype=torch.long)
    tau = divin.calibrate_tau(den, sched, z, labels)
    out = divin.divin_init(den, sched, z, labels, seeds, tau=tau, eta=eta, k_steps=2)
    g_c, g_u = posterior_gain(sched, 0.25, 0), posterior_gain(sched, 1.0, 0)
    xi = divin.per_sample_randn(divin.generators(seeds, divin.XI), (3,), torch.float64)
    expected = eta * tau * 2 * (g_c - g_u) ** 2 * z.norm(dim=1) / (math.sqrt(2 * eta) * xi.norm(dim=1))
    cancel = (abs(g_c) + g_u) / abs(g_c - g_u)  # x̂₀(c) − x̂₀(∅) loses digits, squared in U's gradient
    assert torch.allclose(out.pull_noise, expected, rtol=256 * EPS64 * cancel ** 2, atol=0)
    ratio = out.pull_noise * xi.norm(dim=1) / z.norm(dim=1)  # pull over ‖z‖ ÷ kick over ‖z‖
    assert torch.allclose(ratio.median(), torch.tensor(math.sqrt(eta / 2), dtype=torch.float64), rtol=1e-9, atol=0)
    assert divin.divin_init(den, sched, z, labels, seeds, tau=tau, eta=eta, k_steps=1, noise=False).pull_noise is None


def test_tau_sweep_goes_beyond_tau_star_and_the_oracle_sweeps_its_own():
    from icml.methods.diverse_init import config, pipeline

    cfg = config.preset("default")
    assert pipeline.tau_sweep(cfg, 2.0) == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]  # τ*·{0, ⅛, …, 1, 2, 4, 8}
    arms = pipeline.arms_for(cfg, "gmm", 2.0, exact_tau_star=300.0)
    sweep = {(a.variant, a.tau, a.tau_frac) for a in arms if a.cfg_scale == 4.0 and a.k_steps == 1
             and a.variant in ("divin", pipeline.ORACLE)}
    assert {(v, t, f) for v, t, f in sweep if v == "divin"} == {("divin", 2.0 * f, f) for f in cfg.divin.tau_fracs}
    assert {(v, t, f) for v, t, f in sweep if v != "divin"} == \
        {(pipeline.ORACLE, 300.0 * f, f) for f in cfg.divin.tau_fracs if f > 0}
    assert not any(a.variant == pipeline.ORACLE for a in pipeline.arms_for(cfg, "gmm", 2.0))
    cfg.divin.tau_grid = [0.0, 3.0]
    assert pipeline.tau_sweep(cfg, 2.0) == [0.0, 3.0]


def _mixture_posterior_mean(x_t, a, b, weights, sigma, h=0.004):
    """E[x₀ | x_t] for x_t = a·x₀ + b·ε, x₀ ~ Σ_k w_k N(μ_k, σ²I), by quadrature on a grid (10+ points per σ:
    the Riemann sum of a smooth Gaussian integrand is exact to far below float64 rounding)."""
    grid = np.arange(-1.4, 1.4 + h / 2, h)
    gx, gy = np.meshgrid(grid, grid, indexing="ij")
    pts = np.stack([gx.ravel(), gy.ravel()], 1)
    means = data.gmm_means()
    log_prior = np.log(np.exp(-((pts[:, None, :] - means[None]) ** 2).sum(-1) / (2 * sigma ** 2)) @ weights)
    out = []
    for x in x_t:
        logp = log_prior - ((x - a * pts) ** 2).sum(1) / (2 * b ** 2)
        p = np.exp(logp - logp.max())
        out.append(p @ pts / p.sum())
    return np.array(out)


@pytest.mark.parametrize("param, i", [("eps", 0), ("eps", 12), ("flow", 4)])
def test_exact_gmm_denoiser_is_the_mixture_posterior_mean(param, i):
    sched = divin.Schedule(make_scheduler(param), param, 25)
    model = ExactGmmDenoiser(sched.scheduler, param, 0.05)
    if param == "eps":
        a = math.sqrt(sched.alpha_bar(i))
        b = math.sqrt(1 - a ** 2)
    else:
        b = float(sched.sigmas[i])
        a = 1 - b
    x = torch.tensor([[0.3, -1.1], [1.0, 0.2], [-0.4, 0.05]], dtype=torch.float64) * (a + b)
    for label in (0, 3, 4):  # two classes and the null (the class-balanced marginal)
        weights = np.zeros(16)
        classes = [label] if label < 4 else range(4)
        for c in classes:
            weights[data.class_components(c)] += np.array([0.7, 0.1, 0.1, 0.1]) / len(classes)
        labels = torch.full((3,), label)
        x0 = sched.tweedie(x, model(x, sched.timesteps[i], labels), i).numpy()
        ref = _mixture_posterior_mean(x.numpy(), a, b, weights, 0.05)
        # both sides are exact; the gap is float64 rounding of the sums and of Tweedie's 1/a amplification
        assert np.allclose(x0, ref, rtol=0, atol=1e-10 / min(a, 1.0)), (label, x0, ref)


def test_exact_gmm_potential_at_the_flow_start_is_constant_and_eps_is_tiny():
    """Flow at σ₀ = 1: x̂₀(z, c) = the class mean 0.6·μ_c whatever z (∇U = 0). eps at DDIM-25's t₀ = 961:
    x̂₀ barely depends on z (gain ≈ √ᾱ), so the true ∇U is ~10⁻³ — what a learned model must get right."""
    z = divin.initial_noise(list(range(64)), (2,), torch.float64)
    labels = torch.arange(64) % 4
    flow = divin.Schedule(make_scheduler("flow"), "flow", 25)
    den = divin.Denoiser(ExactGmmDenoiser(flow.scheduler, "flow", 0.05), null=4)
    out_c, out_u = den.pair(z, flow.timesteps[0], labels)
    means = torch.tensor(data.gmm_means())
    assert torch.allclose(flow.tweedie(z, out_c), 0.6 * means[labels], rtol=0, atol=8 * EPS64)
    assert torch.allclose(flow.tweedie(z, out_u), 0.15 * means[:4].sum(0).expand(64, 2), rtol=0, atol=8 * EPS64)
    _, grad = divin.potential_grad(den, flow, z, labels)
    assert float(grad.abs().max()) < 64 * EPS64
    eps = divin.Schedule(make_scheduler("eps"), "eps", 25)
    exact = divin.Denoiser(ExactGmmDenoiser(eps.scheduler, "eps", 0.05), null=4)
    _, grad = divin.potential_grad(exact, eps, z, labels)
    assert 1e-4 < float(grad.norm(dim=1).median()) < 1e-2


def test_prior_only_langevin_keeps_standard_normal_statistics():
    """τ = 0: z_K = (1−η)^K z + noise, Var = (1−η)^{2K} + 2η Σ_{k<K} (1−η)^{2k} = 1 + O(η²); no prior: 1 + 2ηK."""
    den, sched = gaussian_pair("eps")
    n, eta, k = 5_000, 0.05, 3
    seeds = list(range(n))
    z = divin.initial_noise(seeds, (2,), torch.float64)
    labels = torch.zeros(n, dtype=torch.long)
    for prior, var in ((True, (1 - eta) ** (2 * k) + 2 * eta * sum((1 - eta) ** (2 * j) for j in range(k))),
                       (False, 1 + 2 * eta * k)):
        zk = divin.divin_init(den, sched, z, labels, seeds, tau=0.0, eta=eta, k_steps=k, prior=prior).z
        se_var = var * math.sqrt(2 / (2 * n))  # sampling error of a variance over 2n Gaussian entries
        assert abs(float(zk.var()) - var) < 4 * se_var
        assert abs(float(zk.mean())) < 4 * math.sqrt(var / (2 * n))
    assert abs((1 - eta) ** (2 * k) + 2 * eta * sum((1 - eta) ** (2 * j) for j in range(k)) - 1) < 3 * eta ** 2


def test_eta_zero_reproduces_the_base_sampler_exactly(mlp):
    den, sched = mlp
    seeds = list(range(12))
    z = divin.initial_noise(seeds, (2,), torch.float64)
    labels = torch.arange(12) % 4
    base = divin.sample(den, sched, z, labels, 4.0)
    init = divin.divin_init(den, sched, z, labels, seeds, tau=3.0, eta=0.0, k_steps=2)
    assert torch.equal(init.z, z)
    assert torch.equal(divin.sample(den, sched, init.z, labels, 4.0), base)


@pytest.mark.parametrize("traj", [divin.Trajectory(), divin.Trajectory(cads=True), divin.Trajectory(ig=True)])
def test_a_sample_is_the_same_alone_or_in_a_batch(mlp, traj):
    den, sched = mlp
    seeds = [11, 5, 8, 2, 9, 7]
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    z = divin.initial_noise(seeds, (2,), torch.float64)
    init = divin.divin_init(den, sched, z, labels, seeds, tau=2.0, eta=0.1, k_steps=2)
    batch = divin.sample(den, sched, init.z, labels, 4.0, traj, seeds)
    alone_z = divin.divin_init(den, sched, z[2:3], labels[2:3], seeds[2:3], tau=2.0, eta=0.1, k_steps=2).z
    alone = divin.sample(den, sched, alone_z, labels[2:3], 4.0, traj, seeds[2:3])
    # only the matmul blocking differs between batch sizes: a few ulps per layer, over 2 + 10 network calls
    assert torch.allclose(alone_z, init.z[2:3], rtol=0, atol=256 * EPS64)
    assert torch.allclose(alone, batch[2:3], rtol=0, atol=4096 * EPS64)


def test_potential_gradient_is_autograd_through_the_denoiser(mlp):
    den, sched = mlp
    z = torch.randn(5, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, 0])
    _, grad = divin.potential_grad(den, sched, z, labels)
    h = 1e-6
    fd = torch.zeros_like(z)
    for j in range(2):
        e = torch.zeros_like(z)
        e[:, j] = h
        fd[:, j] = (divin.potential(den, sched, z + e, labels) - divin.potential(den, sched, z - e, labels)) / (2 * h)
    # central differences: O(h²) truncation plus O(eps/h) rounding, relative to the gradient's size
    assert torch.allclose(grad, fd, rtol=0, atol=1e-6 * float(grad.abs().max()))


def test_u_decreases_in_expectation_and_more_with_tau(mlp):
    den, sched = mlp
    n = 4000
    seeds = list(range(n))
    z = divin.initial_noise(seeds, (2,), torch.float64)
    labels = torch.arange(n) % 4
    u0 = float(divin.potential(den, sched, z, labels).mean())
    tau_star = divin.calibrate_tau(den, sched, z[:64], labels[:64])
    gaps = []
    for tau in (tau_star, 2 * tau_star, 4 * tau_star):
        zk = divin.divin_init(den, sched, z, labels, seeds, tau=tau, eta=0.05, k_steps=1).z
        gaps.append(u0 - float(divin.potential(den, sched, zk, labels).mean()))
    assert 0 < gaps[0] < gaps[1] < gaps[2]


def test_unconditional_model_has_zero_potential():
    net = build_gmm(16, seed=0).double().eval().requires_grad_(False)
    den = divin.Denoiser(lambda x, t: net(x, t, torch.zeros(len(x), dtype=torch.long)), null=None, conditional=False)
    sched = divin.Schedule(make_scheduler("eps"), "eps", 5)
    z = torch.randn(7, 2, dtype=torch.float64)
    u, grad = divin.potential_grad(den, sched, z, None)
    assert torch.equal(u, torch.zeros(7, dtype=torch.float64)) and torch.equal(grad, torch.zeros_like(z))


# trajectory options ----------------------------------------------------------------------------------------
def test_cads_schedule_and_interval_guidance():
    traj = divin.Trajectory(cads=True, ig=True)
    assert [traj.cads_gamma(t) for t in (0.3, 0.6, 0.8, 1.0)] == [1.0, 1.0, pytest.approx(0.5, abs=1e-15), 0.0]
    assert [traj.guidance(4.0, t) for t in (0.95, 0.5, 0.05)] == [1.0, 4.0, 1.0]  # progress 0.05, 0.5, 0.95


def test_cads_hook_noises_only_the_conditional_rows(mlp):
    den, _ = mlp
    labels = torch.tensor([0, 1, 4, 4])
    clean = den.class_embedding(labels)
    state = divin._CadsState()
    state.gamma, state.noise = 0.25, torch.ones(2, clean.shape[1], dtype=torch.float64)
    with divin.cads_hook(den, divin.Trajectory(cads=True, cads_s=0.5), state):
        noisy = den.class_embedding(labels)
    assert torch.equal(noisy[2:], clean[2:])  # the null rows are untouched
    assert torch.allclose(noisy[:2], 0.5 * clean[:2] + 0.5 * math.sqrt(0.75), rtol=0, atol=4 * EPS64)


def test_particle_force_is_the_kernel_repulsion_gradient():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])  # a group of two gets no force (h needs log(n−1) > 0)
    force = divin.particle_force(x, groups)
    assert torch.equal(force[4:], torch.zeros(2, 3, dtype=torch.float64))
    a = x[:4].clone().requires_grad_(True)
    d2 = (a[:, None] - a[None]).pow(2).sum(-1)
    h = d2.detach()[~torch.eye(4, dtype=torch.bool)].median() / math.log(3)
    (grad,) = torch.autograd.grad(torch.exp(-d2 / h).sum(), a)  # E = Σ_ij k_ij ⇒ force_i = −½ ∂E/∂x_i
    assert torch.allclose(force[:4], -0.5 * grad, rtol=0, atol=64 * EPS64)
    assert torch.allclose(force[:4].sum(0), torch.zeros(3, dtype=torch.float64), atol=64 * EPS64)  # action = reaction


def test_particle_force_batches_groups_of_unequal_size_in_any_order():
    x = torch.randn(11, 2, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    groups = torch.tensor([7, 3, 7, 3, 5, 7, 3, 7, 9, 9, 5])  # sizes 4, 3, 2, 2, interleaved
    force = divin.particle_force(x, groups)
    for g in (7, 3, 5, 9):
        idx = torch.nonzero(groups == g).flatten()
        alone = divin.particle_force(x[idx], torch.zeros(len(idx), dtype=torch.long))
        assert torch.allclose(force[idx], alone, rtol=0, atol=16 * EPS64), g  # a group's force is its own
    assert torch.equal(force[groups == 5], torch.zeros(2, 2, 2, dtype=torch.float64))


def test_pg_groups_are_chunks_of_one_class():
    labels = torch.tensor([0, 1, 0, 0, 1, 0, 0, 1, 2])
    assert divin.pg_groups(labels, 9, 4).tolist() == [0, 2, 0, 0, 2, 0, 1, 2, 3]
    assert divin.pg_groups(None, 5, 4).tolist() == [0, 0, 0, 0, 1]  # unconditional: one stream of chunks


@pytest.mark.parametrize("param", ["eps", "flow"])
def test_pg_at_the_spec_coefficient_repels_in_2d_once_matched_to_the_dimension(param):
    """coeff = 32 is set for SD1's d = 16 384: as is at d = 2 the repulsion dwarfs ε and throws the samples
    ~60–200× wider than the guided distribution; scaled by d/16 384 it widens each set of 4 particles and
    leaves the spread of the distribution alone (exact Gaussian denoisers, float64, fixed seeds)."""
    den, sched = gaussian_pair(param, 25)
    seeds = list(range(64))
    z = divin.initial_noise(seeds, (2,), torch.float64)
    labels = torch.zeros(64, dtype=torch.long)

    def within_set_distance(x):
        sets = x.view(16, 4, 2)
        return float((sets[:, :, None] - sets[:, None]).norm(dim=-1).sum() / (16 * 12))

    base = divin.sample(den, sched, z, labels, 4.0)
    matched = divin.sample(den, sched, z, labels, 4.0, divin.Trajectory(pg=True), seeds)
    literal = divin.sample(den, sched, z, labels, 4.0, divin.Trajectory(pg=True, pg_ref_dim=None), seeds)
    assert divin.Trajectory().pg_strength(16_384) == 32.0 and divin.Trajectory(pg_ref_dim=None).pg_strength(2) == 32.0
    assert float(literal.std()) > 30 * float(base.std())  # the divergence
    assert within_set_distance(matched) > within_set_distance(base)  # repulsion within each set
    assert float(matched.std()) < 1.1 * float(base.std())  # and no blow-up


def test_sail_accepts_or_restarts_by_the_threshold(mlp):
    den, sched = mlp
    seeds = list(range(6))
    z = divin.initial_noise(seeds, (2,), torch.float64)
    labels = torch.arange(6) % 4
    kw = dict(lr=0.05, steps=2, rise=0.1, z_weight=0.05)
    kept = divin.sail_init(den, sched, z, labels, seeds, restarts=3, threshold=math.inf, **kw)
    assert kept.nfe.tolist() == [2 + 2 * 3] * 6 and not torch.equal(kept.z, z)
    again = divin.sail_init(den, sched, z, labels, seeds, restarts=3, threshold=math.inf, **kw)
    assert torch.equal(again.z, kept.z)  # deterministic: no noise
    never = divin.sail_init(den, sched, z, labels, seeds, restarts=3, threshold=-math.inf, **kw)
    assert never.nfe.tolist() == [2 + 4 * 2 * 3] * 6  # every restart tried, the last one kept


# metrics ------------------------------------------------------------------------------------------------
def test_vendi_limits():
    rng = np.random.default_rng(0)
    assert metrics.vendi(np.ones((9, 4))) == pytest.approx(1.0, abs=1e-12)
    assert metrics.vendi(np.eye(7)) == pytest.approx(7.0, abs=1e-12)  # orthogonal features: n
    clusters = np.repeat(np.array([[0.0, 0], [5, 0], [0, 5]]), 10, axis=0)
    assert metrics.vendi(clusters, "rbf", 0.1) == pytest.approx(3.0, abs=1e-12)  # three far-apart equal clusters
    assert 1 < metrics.vendi(rng.standard_normal((30, 4))) < 30


def test_prdc_limits():
    rng = np.random.default_rng(1)
    real = rng.standard_normal((200, 3))
    same = metrics.prdc(real, real.copy(), k=5)
    assert same == {"precision": 1.0, "recall": 1.0, "density": 1.0, "coverage": 1.0}
    far = metrics.prdc(real, real + 100.0, k=5)
    assert far == {"precision": 0.0, "recall": 0.0, "density": 0.0, "coverage": 0.0}


def test_fid_matches_scipy_sqrtm():
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((400, 5)), rng.standard_normal((300, 5)) @ rng.standard_normal((5, 5)) + 0.3
    ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    reference = ((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca + cb - 2 * sqrtm(ca @ cb).real)
    # both are eigen/Schur decompositions of a 5×5 matrix with condition ~1e2: ulps times that
    assert metrics.fid(a, b) == pytest.approx(reference, rel=1e3 * EPS64 * 5)
    assert metrics.fid(a, a + 2.0) == pytest.approx(4.0 * 5, rel=1e3 * EPS64)


def test_inbatch_similarity_and_gmm_metrics():
    assert metrics.inbatch_sim(np.ones((5, 3))) == pytest.approx(1.0, abs=1e-15)
    means = data.gmm_means()
    # class 0: 6 samples on its dominant mode, 2 on minority mode 4, 2 on a class-1 component
    points = means[[0] * 6 + [4] * 2 + [1] * 2]
    got = metrics.gmm_metrics(points, np.zeros(10, dtype=int), sigma=0.05)
    assert got == {"cond_acc": 0.8, "mode_coverage": 0.5, "minority_mass": 0.2, "gmm_precision": 0.8}


def test_gmm_data_follows_the_spec():
    points, labels, components = data.gmm_sample(20_000, 0.05, seed=0)
    assert np.array_equal(data.component_class(components), labels)
    dominant = np.mean(components == labels)
    assert abs(dominant - 0.7) < 4 * math.sqrt(0.21 / len(labels))  # binomial standard error
    _, dist = data.nearest_component(points)
    assert np.mean(dist <= 0.15) == pytest.approx(0.989, abs=0.003)  # P(‖N(0, σ²I₂)‖ ≤ 3σ) = 1 − e^{−4.5}


def test_digits_tier_is_a_stratified_80_20_split_in_minus_one_one():
    split = data.digits_tier(seed=0)
    (xt, yt), (xr, yr) = split["train"], split["ref"]
    assert xt.shape[1:] == (1, 16, 16) and len(xt) + len(xr) == 1797 and len(xr) == 360
    assert float(xt.min()) == -1.0 and float(xt.max()) <= 1.0
    assert np.abs(np.bincount(yr.numpy()) / len(yr) - np.bincount(yt.numpy()) / len(yt)).max() < 0.01
