"""Population dynamics of joint learning in (overlap, Hermite coefficient) coordinates.

With x ~ N(0, I_d), unit w and m = ⟨w, w*⟩, the risk is L(m, a) = ½ Σ_k (a_k² + a*_k² − 2 a_k a*_k m^k).
The alternating scheme's gradient flow, written in these coordinates:

  ȧ_k = −λ_k (a_k − a*_k m^k)                     φ-flow in the RKHS with eigenvalues λ_k (λ ≡ 1: L²)
  ṁ   = η (1 − m²) Σ_k k a_k a*_k m^{k−1}         spherical gradient flow of w, seen through m

`planted` fixes a ≡ a*; `argmin_phi` sets a_k = a*_k m^k at every instant. Escape times T½ (first
|m_t| ≥ ½) grow like d^{s−1} from m₀ = d^{−1/2}, up to ~10⁷ time units, so the flows are integrated with
LSODA (stiff: the a-modes relax at rate λ_k ~ 1 while m moves on scale d^{s−1}) with an analytic
Jacobian and a root-found escape event; never fixed-step Euler.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from icml.methods.single_index.hermite import risk

ETA = 1.0  # ODE time is measured with η = 1


def eigenvalues(K: int, lam: float) -> np.ndarray:
    """λ_k = lam^k, k = 0..K (lam = 1: the L² flow)."""
    return lam ** np.arange(K + 1, dtype=float)


def m_velocity(m: float, a: np.ndarray, a_star: np.ndarray) -> float:
    """ṁ = η(1 − m²) Σ_k k a_k a*_k m^{k−1}: the tangent-projected population gradient of w along w*."""
    k = np.arange(len(a_star))
    return ETA * (1 - m * m) * float(np.sum(k * a * a_star * m ** np.maximum(k - 1, 0)))


def planted_velocity(m: float, a_star: np.ndarray) -> float:
    return m_velocity(m, a_star, a_star)


def argmin_velocity(m: float, a_star: np.ndarray) -> float:
    return m_velocity(m, a_star * m ** np.arange(len(a_star)), a_star)


@dataclass(frozen=True)
class Flow:
    """One ODE run: which flow, which target, from where."""

    variant: str  # joint | planted | l2_flow | argmin_phi
    a_star: tuple[float, ...]  # target coefficients, length K + 1
    m0: float
    lam: float = 0.8  # λ_k = lam^k of the φ-flow (joint); l2_flow uses 1
    a0: tuple[float, ...] | None = None  # φ-flow start (joint/l2_flow); None: zeros
    argmin: bool = False  # joint with the instantaneous φ-step (`ode.phi_update=argmin`)

    @property
    def has_a_state(self) -> bool:
        return self.variant in ("joint", "l2_flow") and not self.argmin


@dataclass
class FlowResult:
    escape_time: float  # first t with |m_t| ≥ ½ (inf if never before t_max)
    t: np.ndarray  # trajectory times (0, then log-spaced to t_max)
    m: np.ndarray
    a: np.ndarray  # (len(t), K + 1)
    risk: np.ndarray

    @property
    def final_m(self) -> float:
        return float(self.m[-1])

    @property
    def final_a(self) -> np.ndarray:
        return self.a[-1]


def _system(flow: Flow):
    """(rhs, jac, state0, coefficients(state)) of a flow."""
    a_star = np.asarray(flow.a_star, float)
    k = np.arange(len(a_star))
    km1 = np.maximum(k - 1, 0)
    if flow.has_a_state:
        lam = eigenvalues(len(a_star) - 1, 1.0 if flow.variant == "l2_flow" else flow.lam)
        a0 = np.zeros(len(a_star)) if flow.a0 is None else np.asarray(flow.a0, float)

        c = k * a_star  # ṁ = η(1 − m²) Σ_k c_k a_k m^{k−1}
        decay = lam * a_star

        def rhs(t, y):
            m, a = y[0], y[1:]
            powers = m ** km1  # m^{k−1} (m⁰ for k = 0, whose c_0 = 0)
            out = np.empty_like(y)
            out[0] = ETA * (1 - m * m) * np.dot(c, a * powers)
            out[1:] = decay * powers * m - lam * a  # −λ_k (a_k − a*_k m^k), with m^k = m·m^{k−1} for k ≥ 1
            out[1] = -lam[0] * a[0] + decay[0]  # k = 0: m⁰ = 1
            return out

        def jac(t, y):
            m, a = y[0], y[1:]
            powers = m ** km1
            s = np.dot(c, a * powers)
            ds = np.dot(c * km1, a * m ** np.maximum(k - 2, 0))
            J = np.zeros((len(y), len(y)))
            J[0, 0] = ETA * (-2 * m * s + (1 - m * m) * ds)
            J[0, 1:] = ETA * (1 - m * m) * c * powers
            J[1:, 0] = decay * k * powers
            J[1:, 1:] = -np.diag(lam)
            return J

        return rhs, jac, np.concatenate([[flow.m0], a0]), lambda y: y[1:]

    # one-dimensional flows in m: a ≡ a* (planted) or a = a* m^k (argmin)
    power = 1 if flow.variant == "planted" else 2  # ṁ = η(1−m²) Σ k a*_k² m^{power·k − 1}

    def velocity_parts(m):
        weights = k * a_star ** 2
        exps = np.maximum(power * k - 1, 0)
        s = np.sum(weights * m ** exps)
        ds = np.sum(weights * exps * m ** np.maximum(exps - 1, 0))
        return s, ds

    def rhs(t, y):
        return np.array([ETA * (1 - y[0] ** 2) * velocity_parts(y[0])[0]])

    def jac(t, y):
        s, ds = velocity_parts(y[0])
        return np.array([[ETA * (-2 * y[0] * s + (1 - y[0] ** 2) * ds)]])

    def coefficients(y):
        return a_star if flow.variant == "planted" else a_star * y[0] ** k

    return rhs, jac, np.array([flow.m0]), coefficients


def time_grid(t_max: float, n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.logspace(-2, np.log10(t_max), n)])


def integrate(flow: Flow, t_max: float, n_grid: int = 160, rtol: float = 1e-10, atol: float = 1e-14) -> FlowResult:
    """Integrate a flow to t_max; the escape event is root-found by the solver's dense output."""
    from scipy.integrate import solve_ivp

    rhs, jac, y0, coefficients = _system(flow)

    def escape(t, y):
        return y[0] * y[0] - 0.25

    escape.direction = 1.0
    grid = time_grid(t_max, n_grid)
    sol = solve_ivp(rhs, (0.0, t_max), y0, method="LSODA", jac=jac, t_eval=grid, events=[escape],
                    rtol=rtol, atol=atol)
    if sol.status < 0:
        raise RuntimeError(f"ODE integration failed ({sol.message}) for {flow}")
    if abs(flow.m0) >= 0.5:
        t_half = 0.0
    else:
        t_half = float(sol.t_events[0][0]) if len(sol.t_events[0]) else float("inf")
    a = np.array([coefficients(y) for y in sol.y.T])
    a_star = np.asarray(flow.a_star, float)
    return FlowResult(t_half, sol.t, sol.y[0], a, risk(sol.y[0], a, a_star))


def escape_slope(d: np.ndarray, times: np.ndarray, min_d: int) -> float:
    """Least-squares slope of log T½ against log d over d ≥ min_d (nan with < 2 finite points)."""
    d, times = np.asarray(d, float), np.asarray(times, float)
    keep = (d >= min_d) & np.isfinite(times) & (times > 0)
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(d[keep]), np.log(times[keep]), 1)[0])


def planted_fixed_points(a_star: np.ndarray) -> list[tuple[float, bool]]:
    """Zeros of the planted velocity in (−1, 1) with their stability (ṁ′ < 0): the traps."""
    k = np.arange(len(a_star))
    # (1 − m²) Σ k a*_k² m^{k−1} = 0 inside (−1, 1)  ⇔  the polynomial Σ k a*_k² m^{k−1} = 0
    poly = np.polynomial.Polynomial((k * np.asarray(a_star) ** 2)[1:])
    out = []
    for root in poly.roots():
        if abs(root.imag) < 1e-12 and -1 < root.real < 1:
            m = float(root.real)
            out.append((m, bool(poly.deriv()(m) * (1 - m * m) < 0)))
    return sorted(out)
