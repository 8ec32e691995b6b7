"""Spectral transforms Ψ_p(O) = U Σ^p Vᵀ for p ∈ {1, ½, ¼, 0}, computed without an SVD.

The optimizer path uses only matrix products:

- Ψ₀ (Muon's polar factor) by the quintic Newton–Schulz iteration, in bf16, as the paper's code does;
- Ψ_½ by a coupled Newton iteration on the smaller Gram matrix G: Ψ_½(O) = O·G^{−1/4} (or G^{−1/4}·O),
  with G^{−1/4} the square root of the (damped) inverse square root of G; always in float32 or wider;
- Ψ_¼ = Ψ_½ ∘ Ψ_½.

`psi(..., method="svd")` is the exact float64 reference, kept for the `AdamS_svd` ablation and for the
numerical study `psi_benchmark`. Every function accepts batched inputs (…, rows, cols); `psi_many`
transforms a list of matrices of mixed shapes, one batched call per shape (the optimizer's path).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch

# Quintic Newton–Schulz coefficients of Muon: they pull every singular value of a normalised matrix
# into a band around 1 within a few steps, at the price of never converging exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_NORM_EPS = 1e-7

# Damping of the Gram matrix before the coupled Newton iteration: an absolute floor keeps a zero
# update finite, and a term relative to the mean eigenvalue bounds the condition number the
# iteration has to resolve in its fixed number of steps.
DAMPING_ABSOLUTE = 1e-6
DAMPING_RELATIVE = 1e-4

# The coupled Newton iteration stops a matrix before its K steps once ‖I − Z·Y‖_F < ¼√eps (eps of
# the working dtype; 8.6e-5 in float32): it converges quadratically (the residual e of each eigenvalue
# becomes ¾e²), so the step taken at that point leaves a residual below eps/20, under round-off, and
# the remaining steps could only add round-off. Ill-conditioned inputs still run all K steps, as in
# the official code.
CONVERGED_RESIDUAL_PER_SQRT_EPS = 0.25

SUPPORTED_POWERS = (1.0, 0.5, 0.25, 0.0)

# Whether the coupled Newton iteration may stop a converged matrix early (a value-dependent branch);
# `all_iterations()` turns it off for the plan (`icml spectral-optim plan`: no values on the meta device).
_EARLY_STOP = [True]


@contextlib.contextmanager
def all_iterations():
    """Inside: every matrix of the coupled Newton iteration runs its K steps, as the official code does (the
    worst case of memory and FLOPs; results agree to round-off)."""
    _EARLY_STOP.append(False)
    try:
        yield
    finally:
        _EARLY_STOP.pop()


def shape_factor(rows: int, cols: int) -> float:
    """Muon's scale √max(1, rows/cols) for a (rows, cols) = (out, in) matrix."""
    return math.sqrt(max(1.0, rows / cols))


def _frobenius(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of every matrix in a batch, shaped (…, 1, 1) to broadcast."""
    return torch.linalg.matrix_norm(x, ord="fro", keepdim=True)


def _symmetrise(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (x + x.mT)


def _bf16_on_cpu(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _bf16_product(fn, *operands, **scalars) -> torch.Tensor:
    """A bf16 matrix product as a bf16 GEMM computes it (products accumulated in float32, one rounding to bf16 at
    the end), run in float32 on CPUs: without bf16 units torch's bf16 kernels are ~10× slower than float32's
    (Newton–Schulz took 1.6 s of a 1.7 s mSGDZ step). The rounding points are the same; the summation order is
    the float32 kernel's (≈ 1e-4 of the entries differ by one bf16 ulp from torch's bf16 CPU kernel, as GPUs'
    bf16 kernels differ from it)."""
    return fn(*(t.float() for t in operands), **scalars).to(torch.bfloat16)


def _matmul(m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    return _bf16_product(torch.matmul, m1, m2) if _bf16_on_cpu(m1) else m1 @ m2


def _plus_product(c: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float
                  ) -> torch.Tensor:
    """beta·c + alpha·(m1 @ m2), fused into one kernel where torch has one (2-D and 3-D)."""
    if _bf16_on_cpu(m1) and m1.ndim in (2, 3):
        return _bf16_product(torch.addmm if m1.ndim == 2 else torch.baddbmm, c, m1, m2, beta=beta, alpha=alpha)
    if m1.ndim == 2:
        return torch.addmm(c, m1, m2, beta=beta, alpha=alpha)
    if m1.ndim == 3:
        return torch.baddbmm(c, m1, m2, beta=beta, alpha=alpha)
    return beta * c + alpha * (m1 @ m2)


def newton_schulz5(O: torch.Tensor, steps: int = 15) -> torch.Tensor:
    """Ψ₀(O) ≈ U Vᵀ · √max(1, rows/cols) by the quintic Newton–Schulz iteration (Muon).

    Runs in bf16 like the paper. The result is not exactly orthogonal: its singular values end in
    a band of roughly 0.7–1.2 (times the shape factor). Scale-invariant because O is normalised
    first. `O` is read in (out, in) orientation: the shape factor depends on it.
    """
    rows, cols = O.shape[-2], O.shape[-1]
    a, b, c = NS_COEFFICIENTS
    # The Frobenius norm bounds the spectral norm, so every singular value starts in (0, 1].
    x = (O.to(torch.bfloat16) / (_frobenius(O) + NS_NORM_EPS)).to(torch.bfloat16)
    # Iterate on the wide orientation: the Gram matrix x·xᵀ is then the smaller one.
    tall = rows > cols
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = _matmul(x, x.mT)
        polynomial = _plus_product(gram, gram, gram, beta=b, alpha=c)  # bA + cA²
        x = _plus_product(x, polynomial, x, beta=a, alpha=1.0)  # aX + (bA + cA²)X
    if tall:
        x = x.mT
    return x.to(O.dtype) * shape_factor(rows, cols)


def coupled_newton_sqrt(X: torch.Tensor, iters: int = 15, damping: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(X̃^{1/2}, X̃^{−1/2}) of a symmetric positive (semi-)definite X by the coupled Newton iteration.

    X̃ = X + (1e-6 + 1e-4·tr(X)/n)·I when `damping` (the optimizer's setting), else X̃ = X.
    The iteration runs on X̃/‖X̃‖_F, whose eigenvalues lie in (0, 1] where it converges; the
    √s factors restore the scale so that the result is homogeneous in X. Each matrix of a batch
    takes at most `iters` steps, fewer once it has converged to round-off (see
    CONVERGED_RESIDUAL_PER_SQRT_EPS); it then leaves the batch, so its result does not depend on
    the other matrices.
    """
    n = X.shape[-1]
    batch_shape = X.shape[:-2]
    eye = torch.eye(n, dtype=X.dtype, device=X.device)
    if damping:
        mean_eigenvalue = X.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / n
        X = X + (DAMPING_ABSOLUTE + DAMPING_RELATIVE * mean_eigenvalue) * eye
    scale = _frobenius(X)
    y = (X / scale).reshape(-1, n, n)  # → (X̃/s)^{1/2}
    z = eye.expand_as(y).clone()  # → (X̃/s)^{−1/2}
    root, inverse_root = torch.empty_like(y), torch.empty_like(z)  # converged matrices land here
    active = torch.arange(y.shape[0], device=X.device)  # batch positions still iterating
    # Round-off slowly breaks the symmetry of Y and Z; restoring it every few steps keeps the
    # iteration on symmetric matrices, where it is stable.
    symmetrise_every = max(1, min(iters // 3, 5))
    converged_residual = CONVERGED_RESIDUAL_PER_SQRT_EPS * math.sqrt(torch.finfo(X.dtype).eps)
    for k in range(iters):
        t = torch.baddbmm(eye, z, y, beta=1.5, alpha=-0.5)  # T = ½(3I − Z·Y)
        y = y @ t
        z = t @ z
        if k > 0 and k % symmetrise_every == 0:
            y, z = _symmetrise(y), _symmetrise(z)
        # I − Z·Y = 2(T − I), measured before this step; T is no longer needed, so T − I is
        # formed in place (on the diagonal only).
        if not _EARLY_STOP[-1]:
            continue
        t.diagonal(dim1=-2, dim2=-1).sub_(1.0)
        converged = 2.0 * torch.linalg.matrix_norm(t) < converged_residual
        if bool(converged.any()):
            root[active[converged]], inverse_root[active[converged]] = y[converged], z[converged]
            running = ~converged
            active, y, z = active[running], y[running], z[running]
            if active.numel() == 0:
                break
    root[active], inverse_root[active] = y, z
    root_scale = scale.sqrt()
    root = _symmetrise(root).reshape(*batch_shape, n, n)
    inverse_root = _symmetrise(inverse_root).reshape(*batch_shape, n, n)
    return root_scale * root, inverse_root / root_scale


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider: the coupled iteration loses too much accuracy in bf16/half."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def psi_half(O: torch.Tensor, iters: int = 15, damping: bool = True) -> torch.Tensor:
    """Ψ_½(O) = U Σ^{1/2} Vᵀ without an SVD, through the smaller Gram matrix G.

    cols ≤ rows: G = OᵀO = V Σ² Vᵀ and O·G^{−1/4} = U Σ Vᵀ · V Σ^{−1/2} Vᵀ = U Σ^{1/2} Vᵀ;
    otherwise G = O Oᵀ and Ψ_½(O) = G^{−1/4}·O.
    """
    x = O.to(_working_dtype(O.dtype))
    right_gram = x.shape[-1] <= x.shape[-2]
    gram = x.mT @ x if right_gram else x @ x.mT
    _, inverse_sqrt = coupled_newton_sqrt(gram, iters, damping)
    inverse_fourth_root, _ = coupled_newton_sqrt(inverse_sqrt, iters, damping)
    result = x @ inverse_fourth_root if right_gram else inverse_fourth_root @ x
    return result.to(O.dtype)


def psi_quarter(O: torch.Tensor, iters: int = 15, damping: bool = True) -> torch.Tensor:
    """Ψ_¼ = Ψ_½ ∘ Ψ_½ (the singular vectors are kept, the singular values rooted twice)."""
    return psi_half(psi_half(O, iters, damping), iters, damping)


def psi_svd(O: torch.Tensor, p: float) -> torch.Tensor:
    """Exact U Σ^p Vᵀ by a float64 SVD; for p = 0 with the same shape factor as `newton_schulz5`."""
    u, sigma, vh = torch.linalg.svd(O.to(torch.float64), full_matrices=False)
    result = (u * sigma.pow(p).unsqueeze(-2)) @ vh
    if p == 0:
        result = result * shape_factor(O.shape[-2], O.shape[-1])
    return result.to(O.dtype)


def psi(O: torch.Tensor, p: float, ns_iters: int = 15, method: str = "ns", damping: bool = True
        ) -> torch.Tensor:
    """Ψ_p(O) for p ∈ {1, ½, ¼, 0} on a (…, rows, cols) tensor in (out, in) orientation.

    method="ns" is the optimizer path (matrix products only); method="svd" the exact reference.
    p = 1 returns O itself. p = 0 includes Muon's shape factor √max(1, rows/cols) in both methods,
    so that they are interchangeable; divide it out for the pure polar factor U Vᵀ.
    `damping` only affects the coupled Newton iteration of p = ½, ¼.
    """
    p = float(p)
    if p not in SUPPORTED_POWERS:
        raise ValueError(f"p must be one of {SUPPORTED_POWERS}, not {p}")
    if method not in ("ns", "svd"):
        raise ValueError(f"method must be 'ns' or 'svd', not '{method}'")
    if O.ndim < 2:
        raise ValueError(f"Ψ_p needs a matrix (…, rows, cols), got shape {tuple(O.shape)}")
    if p == 1.0:
        return O
    if method == "svd":
        return psi_svd(O, p)
    if p == 0.0:
        return newton_schulz5(O, ns_iters)
    if p == 0.5:
        return psi_half(O, ns_iters, damping)
    return psi_quarter(O, ns_iters, damping)


def psi_many(matrices: list[torch.Tensor], p: float, ns_iters: int = 15, method: str = "ns",
             damping: bool = True) -> list[torch.Tensor]:
    """Ψ_p of every 2-D matrix of `matrices` (each in (out, in) orientation), batched.

    An optimizer step transforms many small matrices of a few shapes (the layers repeat, and so
    do the split QKV blocks). Each matrix is brought to its wide orientation (Ψ_p(Oᵀ) = Ψ_p(O)ᵀ,
    and the iterations work on the wide side anyway), matrices of equal shape are stacked into one
    (B, rows, cols) tensor and transformed by one call of `psi`, so the per-call overhead is paid
    once per shape. Every norm, trace, damping term and convergence test of `psi` is per matrix,
    so each result equals `psi` of that matrix alone up to float32 round-off. For p = 0 Muon's
    shape factor is applied per matrix in its own (out, in) orientation.
    """
    p = float(p)
    if p == 1.0:
        return list(matrices)
    by_shape: dict[tuple[int, int], list[int]] = {}
    wide = []
    for index, O in enumerate(matrices):
        if O.ndim != 2:
            raise ValueError(f"psi_many needs 2-D matrices, got shape {tuple(O.shape)}")
        wide.append(O.mT if O.shape[0] > O.shape[1] else O)
        by_shape.setdefault(tuple(wide[-1].shape), []).append(index)
    results: list[torch.Tensor | None] = [None] * len(matrices)
    for indices in by_shape.values():
        transformed = psi(torch.stack([wide[i] for i in indices]), p, ns_iters, method, damping)
        for i, result in zip(indices, transformed.unbind(0)):
            rows, cols = matrices[i].shape
            if rows > cols:
                result = result.mT
                if p == 0.0:  # the wide orientation's factor is 1; the tall one's is √(rows/cols)
                    result = result * shape_factor(rows, cols)
            results[i] = result
    return results


# ----------------------------------------------------------------------------------------------
# Numerical study: accuracy against the float64 SVD, conditioning, and speed against an SVD.
# ----------------------------------------------------------------------------------------------

def random_orthonormal(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A (rows, cols) float64 matrix with orthonormal columns, Haar-distributed (rows ≥ cols)."""
    q, r = torch.linalg.qr(torch.randn(rows, cols, dtype=torch.float64, generator=generator))
    # The sign fix makes Q Haar-distributed instead of depending on QR's sign convention.
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def conditioned_matrix(rows: int, cols: int, kappa: float, generator: torch.Generator
                       ) -> torch.Tensor:
    """O = U diag(σ) Vᵀ in float32, σ log-spaced from 1 down to 1/κ, U and V random orthonormal."""
    rank = min(rows, cols)
    u = random_orthonormal(rows, rank, generator)
    v = random_orthonormal(cols, rank, generator)
    sigma = torch.logspace(0.0, -math.log10(kappa), rank, dtype=torch.float64)
    return ((u * sigma) @ v.T).to(torch.float32)


def _condition_number(singular_values: torch.Tensor) -> float:
    return float(singular_values.max() / singular_values.min())


def _relative_error(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    estimate = estimate.to(torch.float64)
    return float(torch.linalg.matrix_norm(estimate - reference) / torch.linalg.matrix_norm(reference))


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _svd_transform_float32(O: torch.Tensor, p: float) -> torch.Tensor:
    """What an SVD-based optimizer would do: float32 SVD of the matrix, then U Σ^p Vᵀ."""
    u, sigma, vh = torch.linalg.svd(O, full_matrices=False)
    return (u * sigma.pow(p).unsqueeze(-2)) @ vh


def psi_benchmark(sizes: list[tuple[int, int]], kappas: list[float],
                  ps=(1, 0.5, 0.25, 0), repeats: int = 5, seed: int = 0, ns_iters: int = 15
                  ) -> list[dict]:
    """Accuracy, conditioning and speed of the SVD-free Ψ_p on matrices of known spectrum.

    Rows (one dict each, tagged variant `psi_<p>`, p, kappa, rows, cols, dtype, psi_method, damping):
    - psi_rel_error: ‖Ψ̂_p(O) − Ψ_p(O)‖_F/‖Ψ_p(O)‖_F against the float64 SVD of the same float32
      matrix; p = ½, ¼ with damping on and off; p = 0 the Newton–Schulz output against the exact
      polar factor (both with the shape factor).
    - psi_cond_exponent: log κ(Ψ̂_p(O)) / log κ(O) for p = 1, ½, ¼ (NaN when κ(O) ≈ 1).
    - psi_sv_min, psi_sv_max: extreme singular values of Ψ̂₀(O) divided by the shape factor, so
      the band around 1 is comparable across shapes.
    - psi_ms, svd_ms, psi_speedup (= svd_ms/psi_ms): median wall time over `repeats` calls after a
      warm-up, for every p < 1, on the largest-κ matrix of each size (the time of matrix products
      does not depend on the spectrum).
    The `damping` tag says whether the damping term was applied: "on" only for the coupled
    Newton iteration of p = ½, ¼ in its optimizer setting.
    """
    rows_out: list[dict] = []
    powers = [float(p) for p in ps]

    def record(p, metric, value, kappa, shape, method="ns", damping=False):
        rows_out.append({"variant": f"psi_{p:g}", "metric": metric, "value": float(value),
                         "p": p, "kappa": float(kappa), "rows": int(shape[0]), "cols": int(shape[1]),
                         "dtype": "float32", "psi_method": method,  # `method` names the method in metrics
                         "damping": "on" if damping else "off"})

    for size_index, shape in enumerate(sizes):
        rows, cols = shape
        matrices = {}
        for kappa_index, kappa in enumerate(kappas):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + size_index * 1_009 + kappa_index)
            O = conditioned_matrix(rows, cols, kappa, generator)
            matrices[kappa] = O
            sigma = torch.linalg.svdvals(O.to(torch.float64))
            log_kappa = math.log(_condition_number(sigma))
            # At κ = 1 the exponent is 0/0; float32 rounding would turn it into noise.
            exponent_defined = log_kappa > 1e-3
            for p in powers:
                if p == 1.0:  # measured like the others: Ψ₁ must leave the spectrum alone
                    estimate_sigma = torch.linalg.svdvals(psi(O, 1.0).to(torch.float64))
                    exponent = (math.log(_condition_number(estimate_sigma)) / log_kappa
                                if exponent_defined else math.nan)
                    record(p, "psi_cond_exponent", exponent, kappa, shape)
                elif p in (0.5, 0.25):
                    reference = psi_svd(O.to(torch.float64), p)
                    for damping in (True, False):
                        estimate = psi(O, p, ns_iters, "ns", damping)
                        record(p, "psi_rel_error", _relative_error(estimate, reference), kappa, shape,
                               damping=damping)
                        estimate_sigma = torch.linalg.svdvals(estimate.to(torch.float64))
                        exponent = (math.log(_condition_number(estimate_sigma)) / log_kappa
                                    if exponent_defined else math.nan)
                        record(p, "psi_cond_exponent", exponent, kappa, shape, damping=damping)
                elif p == 0.0:
                    reference = psi_svd(O.to(torch.float64), 0.0)
                    estimate = psi(O, 0.0, ns_iters, "ns")
                    record(p, "psi_rel_error", _relative_error(estimate, reference), kappa, shape)
                    band = torch.linalg.svdvals(estimate.to(torch.float64)) / shape_factor(rows, cols)
                    record(p, "psi_sv_min", band.min(), kappa, shape)
                    record(p, "psi_sv_max", band.max(), kappa, shape)
                else:
                    raise ValueError(f"p must be one of {SUPPORTED_POWERS}, not {p}")

        timing_kappa = max(kappas)
        O = matrices[timing_kappa]
        for p in powers:
            if p == 1.0:
                continue  # the identity costs nothing to time
            uses_damping = p in (0.5, 0.25)
            psi_ms = _median_ms(lambda: psi(O, p, ns_iters, "ns"), repeats)
            svd_ms = _median_ms(lambda: _svd_transform_float32(O, p), repeats)
            record(p, "psi_ms", psi_ms, timing_kappa, shape, damping=uses_damping)
            record(p, "svd_ms", svd_ms, timing_kappa, shape, method="svd")
            record(p, "psi_speedup", svd_ms / psi_ms, timing_kappa, shape, damping=uses_damping)
    return rows_out
