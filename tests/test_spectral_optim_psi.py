"""Ψ_p(O) = U Σ^p Vᵀ: the SVD-free transforms against the float64 SVD and the transform's identities.

Tolerances are measured values with ~2–3× headroom (seeded matrices, float32 unless stated):
- damping on (the optimizer setting), p = ½, ¼: rel. error 3.5e-5 at κ = 2, 1.5e-4 at κ = 10,
  2.3e-3 at κ = 100. The error is the bias of the damping term 1e-4·tr(G)/n, which matters more
  the smaller the smallest eigenvalue of G = OᵀO (κ(G) = κ(O)²), hence the growth with κ.
- damping off: ≤ 1.3e-6 up to κ = 30 (≈ 10 float32 ulps). Float64 comparisons use
  `roundoff_bound` (n·√κ·eps, derived there), since their round-off depends on the BLAS kernel.
- Ψ₀ (quintic Newton–Schulz, bf16): singular values in [0.67, 1.15] × the shape factor; never exact.
"""
from __future__ import annotations

import math

import pytest
import torch

from icml.methods.spectral_optim.psi import (NS_COEFFICIENTS, conditioned_matrix, coupled_newton_sqrt,
                                             newton_schulz5, psi, psi_benchmark, psi_many, psi_svd,
                                             shape_factor)

SHAPES = [(32, 32), (48, 16), (16, 48)]




def roundoff_bound(n: int, kappa: float, dtype=torch.float64) -> float:
    """Round-off budget for the coupled Newton iterates, as a multiple of the dtype's eps.

    Each product of n×n matrices perturbs its result by up to ~n·eps (relative; the standard
    inner-product bound), and the square root and inverse square root of an SPD matrix amplify a
    relative perturbation of their argument by up to ~√κ. The iteration is self-correcting, so
    round-off does not grow with the number of steps. Measured on this machine: at most 0.25 of
    the bound (1012 eps against 16·√80 750 eps for the ill-conditioned Gram matrix below), and the
    order in which BLAS kernels sum moves the measured value, not the bound.
    """
    return n * math.sqrt(kappa) * torch.finfo(dtype).eps


def condition(x: torch.Tensor) -> float:
    return float(torch.linalg.cond(x.to(torch.float64)))


def rel_error(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    estimate, reference = estimate.to(torch.float64), reference.to(torch.float64)
    return float(torch.linalg.matrix_norm(estimate - reference) / torch.linalg.matrix_norm(reference))


def matrix(shape, kappa, seed=0, dtype=torch.float32):
    return conditioned_matrix(*shape, kappa, torch.Generator().manual_seed(seed)).to(dtype)


def singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.to(torch.float64))


# ---------------------------------------------------------------------------------------------
# Ψ_½ and Ψ_¼ by the coupled Newton iteration
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.5, 0.25])
@pytest.mark.parametrize("kappa, tolerance", [(2.0, 1e-4), (10.0, 4e-4), (100.0, 5e-3)])
def test_damped_newton_matches_svd_within_the_damping_bias(shape, p, kappa, tolerance):
    O = matrix(shape, kappa)
    assert rel_error(psi(O, p), psi_svd(O.double(), p)) < tolerance


@pytest.mark.parametrize("p", [0.5, 0.25])
def test_damping_error_grows_with_condition_number(p):
    errors = [rel_error(psi(matrix((32, 32), k), p), psi_svd(matrix((32, 32), k).double(), p))
              for k in (2.0, 10.0, 100.0, 1000.0)]
    assert errors == sorted(errors)
    assert errors[-1] > 10 * errors[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.5, 0.25])
@pytest.mark.parametrize("kappa", [2.0, 10.0, 30.0])
def test_undamped_newton_reaches_float32_precision(shape, p, kappa):
    O = matrix(shape, kappa)
    assert rel_error(psi(O, p, damping=False), psi_svd(O.double(), p)) < 5e-6


@pytest.mark.parametrize("p", [0.5, 0.25])
def test_undamped_newton_in_float64_reaches_float64_precision(p):
    O = matrix((48, 16), 10.0, dtype=torch.float64)
    result = psi(O, p, damping=False)
    assert result.dtype == torch.float64
    assert rel_error(result, psi_svd(O, p)) < roundoff_bound(16, condition(O.mT @ O))  # 13 eps measured


@pytest.mark.parametrize("p", [1, 0.5, 0.25])
@pytest.mark.parametrize("kappa", [10.0, 30.0])
def test_condition_number_is_raised_to_the_power_p(p, kappa):
    O = matrix((48, 16), kappa)
    sigma = singular_values(psi(O, p, damping=False))
    assert math.log(float(sigma.max() / sigma.min())) / math.log(kappa) == pytest.approx(p, abs=1e-3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.5, 0.25])
def test_homogeneity_is_exact_without_damping(shape, p):
    O = matrix(shape, 10.0)
    for c in (1e-3, 0.1, 3.7, 1e3):
        assert rel_error(psi(c * O, p, damping=False), c ** p * psi(O, p, damping=False)) < 2e-6


@pytest.mark.parametrize("p", [0.5, 0.25])
def test_homogeneity_with_damping_holds_where_the_absolute_floor_is_negligible(p):
    O = matrix((32, 32), 10.0)
    for c in (0.5, 3.7):
        assert rel_error(psi(c * O, p), c ** p * psi(O, p)) < 2e-5
    # The 1e-6 floor of the damping dominates a Gram matrix of entries ~1e-6: a tiny update is
    # shrunk, not merely rescaled. This is the paper's damping, pinned so it is not mistaken for a bug.
    tiny = 1e-3 * O
    assert torch.linalg.matrix_norm(psi(tiny, p)) < 0.9 * torch.linalg.matrix_norm(1e-3 ** p * psi(O, p))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.5, 0.25])
def test_transpose_commutes(shape, p):
    O = matrix(shape, 10.0)
    assert rel_error(psi(O.T.contiguous(), p), psi(O, p).T) < 2e-6


def test_identity_at_p_one_and_bad_arguments():
    O = matrix((16, 48), 10.0)
    assert psi(O, 1) is O
    assert psi(O, 1, method="svd") is O
    with pytest.raises(ValueError):
        psi(O, 0.3)
    with pytest.raises(ValueError):
        psi(O, 0.5, method="eig")
    with pytest.raises(ValueError):
        psi(O[0], 0.5)


def test_low_precision_inputs_are_transformed_in_float32():
    O = matrix((32, 16), 10.0, dtype=torch.bfloat16)
    result = psi(O, 0.5)
    assert result.dtype == torch.bfloat16
    assert torch.equal(result, psi(O.float(), 0.5).bfloat16())


def test_batched_matrices_are_transformed_independently():
    batch = torch.stack([matrix((24, 8), k, seed=k) for k in (2, 10, 50)])
    for p in (0.5, 0.25, 0.0):
        each = torch.stack([psi(m, p) for m in batch])
        assert torch.allclose(psi(batch, p), each, rtol=1e-5, atol=1e-6)


# Shapes of one optimizer step in miniature: repeated squares (layers, QKV blocks), tall and wide
# matrices that share a wide orientation (c_fc and the MLP projection), and an odd one out.
MIXED = [((32, 32), 2.0), ((32, 32), 100.0), ((32, 32), 10.0), ((48, 16), 10.0), ((16, 48), 30.0),
         ((48, 16), 2.0), ((10, 32), 5.0)]


@pytest.mark.parametrize("p", [1, 0.5, 0.25, 0.0])
@pytest.mark.parametrize("method", ["ns", "svd"])
def test_psi_many_equals_psi_of_each_matrix(p, method):
    """The batched path (stacked per wide shape) gives every matrix its own Ψ_p to float32
    round-off: per-matrix norms, damping, convergence and (p = 0) shape factor in (out, in)."""
    matrices = [matrix(shape, kappa, seed=i) for i, (shape, kappa) in enumerate(MIXED)]
    results = psi_many(matrices, p, method=method)
    assert len(results) == len(matrices)
    for O, result in zip(matrices, results):
        assert result.shape == O.shape and result.dtype == O.dtype
        assert rel_error(result, psi(O, p, method=method)) < 1e-6
    if p == 0.0:  # the tall (48, 16) matrices carry √3, the wide and square ones 1
        assert float(singular_values(results[3]).mean()) == pytest.approx(math.sqrt(3.0), rel=0.15)
        assert float(singular_values(results[4]).mean()) == pytest.approx(1.0, rel=0.15)


def test_psi_many_rejects_batches_and_bad_powers():
    O = matrix((16, 8), 10.0)
    with pytest.raises(ValueError):
        psi_many([torch.stack([O, O])], 0.5)
    with pytest.raises(ValueError):
        psi_many([O], 0.3)
    assert psi_many([], 0.5) == []


def fixed_step_coupled_newton(X: torch.Tensor, iters: int = 15):
    """The routine as the spec writes it: damping, Frobenius scaling, exactly K steps with the
    periodic and final symmetrisation, √s factors; no early stop."""
    n = X.shape[-1]
    eye = torch.eye(n, dtype=X.dtype)
    X = X + (1e-6 + 1e-4 * X.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / n) * eye
    s = torch.linalg.matrix_norm(X, keepdim=True)
    y, z = X / s, eye.expand_as(X).clone()
    every = max(1, min(iters // 3, 5))
    for k in range(iters):
        t = 0.5 * (3.0 * eye - z @ y)
        y, z = y @ t, t @ z
        if k > 0 and k % every == 0:
            y, z = 0.5 * (y + y.mT), 0.5 * (z + z.mT)
    y, z = 0.5 * (y + y.mT), 0.5 * (z + z.mT)
    return s.sqrt() * y, z / s.sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_early_stop_equals_the_fixed_fifteen_steps_to_round_off(dtype, monkeypatch):
    """A well-conditioned Gram matrix converges in fewer than 15 steps and leaves the batch; an
    ill-conditioned one runs all 15. Both equal the fixed-step routine, alone or batched, to the
    round-off of the damped matrix each one iterates on (κ ≈ 4 and ≈ 8·10⁴)."""
    grams = torch.stack([(o.mT @ o) for o in (matrix((48, 16), 2.0, seed=1, dtype=dtype),
                                              matrix((48, 16), 1000.0, seed=2, dtype=dtype))])
    n = grams.shape[-1]
    damped = grams + (1e-6 + 1e-4 * grams.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / n) * torch.eye(n)
    reference_root, reference_inverse = fixed_step_coupled_newton(grams)
    root, inverse_root = coupled_newton_sqrt(grams)
    for i in range(2):
        tolerance = roundoff_bound(n, condition(damped[i]), dtype)
        assert rel_error(root[i], reference_root[i]) < tolerance
        assert rel_error(inverse_root[i], reference_inverse[i]) < tolerance
        alone_root, alone_inverse = coupled_newton_sqrt(grams[i])
        assert rel_error(alone_root, root[i]) < tolerance
        assert rel_error(alone_inverse, inverse_root[i]) < tolerance

    steps = []  # one T = ½(3I − Z·Y) per step, counted per call
    counting = torch.baddbmm

    def count_steps(*args, **kwargs):
        steps[-1] += 1
        return counting(*args, **kwargs)

    monkeypatch.setattr(torch, "baddbmm", count_steps)
    for gram in grams:
        steps.append(0)
        coupled_newton_sqrt(gram)
    assert steps[0] < 15 and steps[1] == 15


def test_zero_update_stays_finite_and_zero():
    zero = torch.zeros(16, 8)
    for p in (0.5, 0.25, 0.0):
        assert torch.equal(psi(zero, p), zero)


# ---------------------------------------------------------------------------------------------
# The coupled Newton square root
# ---------------------------------------------------------------------------------------------

def spd(n=24, seed=3):
    a = torch.randn(40, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return a.T @ a  # κ ≈ 30


def test_coupled_newton_returns_square_root_and_inverse_of_the_damped_matrix():
    X = spd()
    n = X.shape[0]
    eye = torch.eye(n, dtype=X.dtype)
    damped = X + (1e-6 + 1e-4 * X.trace() / n) * eye
    root, inverse_root = coupled_newton_sqrt(X, iters=15)
    tolerance = roundoff_bound(n, condition(damped))  # ≤ 19 eps measured
    assert rel_error(root @ root, damped) < tolerance
    assert float(torch.linalg.matrix_norm(root @ inverse_root - eye)) < tolerance
    # The damping is really there: the square of the root misses X by the damping term.
    assert rel_error(root @ root, X) > 1e-5
    # Periodic and final symmetrisation: exactly symmetric outputs.
    assert torch.equal(root, root.mT) and torch.equal(inverse_root, inverse_root.mT)


def test_coupled_newton_without_damping_and_its_scaling():
    X = spd()
    eye = torch.eye(X.shape[0], dtype=X.dtype)
    root, inverse_root = coupled_newton_sqrt(X, damping=False)
    tolerance = roundoff_bound(X.shape[0], condition(X))  # ≤ 15 eps measured
    assert rel_error(root @ root, X) < tolerance
    assert float(torch.linalg.matrix_norm(root @ inverse_root - eye)) < tolerance
    scaled_root, scaled_inverse = coupled_newton_sqrt(9.0 * X, damping=False)
    assert rel_error(scaled_root, 3.0 * root) < tolerance
    assert rel_error(scaled_inverse, inverse_root / 3.0) < tolerance


def test_coupled_newton_in_float32():
    X = spd().float()
    root, inverse_root = coupled_newton_sqrt(X, damping=False)
    assert rel_error(root @ root, X) < 2e-6
    assert float(torch.linalg.matrix_norm(root @ inverse_root - torch.eye(X.shape[0]))) < 2e-6


# ---------------------------------------------------------------------------------------------
# Ψ₀ by quintic Newton–Schulz
# ---------------------------------------------------------------------------------------------

def test_one_newton_schulz_step_is_the_quintic_on_normalised_singular_values():
    O = matrix((48, 16), 10.0)
    u, sigma, vh = torch.linalg.svd(O.double(), full_matrices=False)
    x = sigma / torch.linalg.matrix_norm(O.double())
    a, b, c = NS_COEFFICIENTS
    expected = (u * (a * x + b * x ** 3 + c * x ** 5)) @ vh * shape_factor(48, 16)
    assert rel_error(newton_schulz5(O, steps=1), expected) < 1e-2  # bf16 arithmetic


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kappa", [2.0, 100.0, 1000.0])
def test_newton_schulz_singular_values_lie_in_a_band_not_at_one(shape, kappa):
    out = psi(matrix(shape, kappa), 0.0)
    assert out.dtype == torch.float32
    band = singular_values(out) / shape_factor(*shape)
    assert 0.6 < float(band.min()) and float(band.max()) < 1.2
    assert float(band.max() - band.min()) > 0.2  # not an exact polar factor
    # Still the polar factor's direction: within the band's width of U Vᵀ.
    assert rel_error(out, psi_svd(matrix(shape, kappa).double(), 0.0)) < 0.35


def test_newton_schulz_shape_factor_uses_out_in_orientation():
    tall, wide = matrix((64, 16), 10.0), matrix((16, 64), 10.0)
    assert float(singular_values(psi(tall, 0.0)).mean()) == pytest.approx(2.0, rel=0.15)
    assert float(singular_values(psi(wide, 0.0)).mean()) == pytest.approx(1.0, rel=0.15)
    # Tall and wide share one iteration: they differ exactly by the factor √(rows/cols).
    assert torch.equal(psi(tall.T.contiguous(), 0.0), psi(tall, 0.0).T / 2.0)


def test_newton_schulz_is_scale_invariant():
    O = matrix((32, 32), 10.0)
    # Scaling by a power of two commutes with bf16 rounding; once ‖cO‖_F is large enough that the
    # 1e-7 of the normalisation is below float32 resolution, the outputs agree bitwise.
    assert torch.equal(psi(8.0 * O, 0.0), psi(64.0 * O, 0.0))
    assert torch.equal(psi(8.0 * O, 0.0), psi(1024.0 * O, 0.0))
    # Other scales change the bf16 rounding of the input; the iteration does not converge inside
    # the band, so the outputs differ by up to the band's width, never more.
    for c in (1.0 / 1024, 0.3, 3.7):
        assert rel_error(psi(c * O, 0.0), psi(O, 0.0)) < 0.2


def test_no_svd_in_the_newton_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an SVD/eigendecomposition was called in the SVD-free path")

    O = matrix((24, 8), 10.0)
    for name in ("svd", "svdvals", "eigh", "eig", "eigvalsh"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    monkeypatch.setattr(torch, "svd", forbidden)
    for p in (0.5, 0.25, 0.0):
        psi(O, p)
    with pytest.raises(AssertionError):
        psi(O, 0.5, method="svd")


# ---------------------------------------------------------------------------------------------
# The numerical study
# ---------------------------------------------------------------------------------------------

def test_psi_benchmark_rows():
    rows = psi_benchmark([(16, 16), (24, 8)], [2.0, 30.0], repeats=1)
    keys = {"variant", "metric", "value", "p", "kappa", "rows", "cols", "dtype", "psi_method", "damping"}
    assert all(set(row) == keys for row in rows)
    by = {(r["metric"], r["p"], r["kappa"], r["rows"], r["damping"], r["psi_method"]): r["value"] for r in rows}
    assert {r["variant"] for r in rows} == {"psi_1", "psi_0.5", "psi_0.25", "psi_0"}
    for size in (16, 24):
        for p in (0.5, 0.25):
            assert by[("psi_rel_error", p, 2.0, size, "on", "ns")] < 1e-4
            assert by[("psi_rel_error", p, 30.0, size, "off", "ns")] < 5e-6
            assert by[("psi_cond_exponent", p, 30.0, size, "off", "ns")] == pytest.approx(p, abs=1e-3)
        assert by[("psi_cond_exponent", 1.0, 30.0, size, "off", "ns")] == 1.0
        assert 0.6 < by[("psi_sv_min", 0.0, 30.0, size, "off", "ns")] < 1.0
        assert 1.0 < by[("psi_sv_max", 0.0, 30.0, size, "off", "ns")] < 1.2
        for p in (0.5, 0.25, 0.0):
            damping = "on" if p else "off"
            psi_ms = by[("psi_ms", p, 30.0, size, damping, "ns")]
            svd_ms = by[("svd_ms", p, 30.0, size, "off", "svd")]
            assert by[("psi_speedup", p, 30.0, size, damping, "ns")] == pytest.approx(svd_ms / psi_ms)
    assert all(r["dtype"] == "float32" and isinstance(r["value"], float) for r in rows)
