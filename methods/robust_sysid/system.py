"""Data of `icml robust-sysid`: the fading-memory system, its inputs, noise and attacks, the true
truncated map Θ*_p, the regressors φ_t, and user trajectories.

System (Hammerstein, partially observed): x_{t+1} = A x_t + B ψ(u_t) + w_t,  y_t = C x_t + v_t + d_t,
ψ(u) = [u, tanh 2u] per input channel. Unrolling p steps,
    y_t = Θ*_p φ_t + C A^p x_{t-p} + C Σ_{k<p} A^k w_{t-1-k} + v_t + d_t,
    φ_t = [ψ(u_{t-1}); …; ψ(u_{t-p})],   Θ*_p = [CB, CAB, …, CA^{p-1}B],
so the truncation term is of size ‖CA^p‖ ~ ρ^p, and it is correlated with φ_t because the inputs have
nonzero mean (the bias floor of every estimator).

Common random numbers: one `Trajectory` per (experiment, seed) holds every random draw (inputs, w, v,
the attack-time uniforms); the problems of every p, q, T and attack model are cut from it. Attack
times are `uniform < q` (nested in q), the bursty chain is driven by the same uniforms.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

OUTPUTS = 2


def features(u: np.ndarray) -> np.ndarray:
    """ψ(u) = [u, tanh 2u] per input channel: (N, k) -> (N, 2k)."""
    return np.concatenate([u, np.tanh(2 * u)], axis=1)


@dataclass(frozen=True)
class System:
    A: np.ndarray  # (n, n)
    B: np.ndarray  # (n, 2k) acting on ψ(u)
    C: np.ndarray  # (m, n)

    @property
    def rho(self) -> float:
        return float(np.max(np.abs(np.linalg.eigvals(self.A))))

    def truth(self, p: int) -> np.ndarray:
        """Θ*_p = [CB, CAB, …, CA^{p-1}B], (m, 2k·p), ordered like φ_t."""
        blocks, power = [], self.C
        for _ in range(p):
            blocks.append(power @ self.B)
            power = power @ self.A
        return np.hstack(blocks)

    def truncation_norm(self, p: int) -> float:
        """‖CA^p‖₂, the scale of the memory truncated at p."""
        return float(np.linalg.norm(self.C @ np.linalg.matrix_power(self.A, p), 2))

    def rescaled(self, rho: float) -> "System":
        """The same system with A scaled to spectral radius `rho` (eigenvectors kept)."""
        return System(self.A * (rho / self.rho), self.B, self.C)


def draw_system(n: int, spectrum: list[float], seed: int | list[int], inputs: int = 1) -> System:
    """A = Q diag(spectrum) Qᵀ with Q Haar-orthogonal; B, C with i.i.d. N(0, 1) entries (seed: numpy's
    default_rng entropy, an int or a list of ints)."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    q = q * np.sign(np.diag(r))  # the sign fix makes Q Haar-distributed
    A = q @ np.diag(np.asarray(spectrum, dtype=float)) @ q.T
    return System(A, rng.standard_normal((n, 2 * inputs)), rng.standard_normal((OUTPUTS, n)))


def draw_inputs(kind: str, n_steps: int, ar: float, mean: float, rng: np.random.Generator) -> np.ndarray:
    """(n_steps, 1) inputs: ar1_mean u = mean + z, z_t = ar z_{t-1} + e_t (stationary start);
    uniform U[mean-2, mean+2]; gaussian_iid N(0, 1)."""
    e = rng.standard_normal(n_steps)
    if kind == "ar1_mean":
        from scipy.signal import lfilter

        e[0] /= np.sqrt(1 - ar ** 2)  # z_0 from the stationary law
        return (mean + lfilter([1.0], [1.0, -ar], e))[:, None]
    if kind == "uniform":
        return (mean - 2 + 4 * rng.random(n_steps))[:, None]
    if kind == "gaussian_iid":
        return e[:, None]
    raise ValueError(f"unknown input kind '{kind}'")


@dataclass
class Trajectory:
    """Every random draw of one simulated trajectory; attacks and regressors are applied on demand."""

    system: System
    u: np.ndarray  # (N, k)
    w: np.ndarray  # (N, n) process noise, already scaled
    v: np.ndarray  # (N, m) measurement noise, already scaled
    attack_uniform: np.ndarray  # (N,) uniforms that place the attacks
    start: int  # the first sample time (burn-in + widest memory)
    n_train: int  # samples available for fitting (the widest T)
    holdout: int  # clean samples after them
    y_clean: np.ndarray  # (N, m) outputs without any attack

    @property
    def psi(self) -> np.ndarray:
        return features(self.u)


def draw_trajectory(system: System, cfg, n_train: int, p_max: int, noise: float,
                    rng: np.random.Generator) -> Trajectory:
    start = cfg.burn_in + p_max
    n_steps = start + n_train + cfg.holdout
    u = draw_inputs(cfg.input.kind, n_steps, cfg.input.ar, cfg.input.mean, rng)
    w = noise * rng.standard_normal((n_steps, system.A.shape[0]))
    v = noise * rng.standard_normal((n_steps, OUTPUTS))
    uniform = rng.random(n_steps)
    return Trajectory(system, u, w, v, uniform, start, n_train, cfg.holdout, simulate(system, features(u), w, v))


def simulate(system: System, psi: np.ndarray, w: np.ndarray, v: np.ndarray,
             state_attack: np.ndarray | None = None) -> np.ndarray:
    """y_t = C x_t + v_t with x_0 = 0, x_{t+1} = A x_t + B ψ_t + w_t (+ state attack)."""
    drive = psi @ system.B.T + w
    if state_attack is not None:
        drive = drive + state_attack
    x = np.zeros((len(psi), system.A.shape[0]))
    for t in range(len(psi) - 1):
        x[t + 1] = system.A @ x[t] + drive[t]
    return x @ system.C.T + v


def regressors(psi: np.ndarray, times: np.ndarray, p: int) -> np.ndarray:
    """φ_t = [ψ(u_{t-1}); …; ψ(u_{t-p})] for each t in `times`: (len(times), 2k·p). Never u_t."""
    return np.hstack([psi[times - lag] for lag in range(1, p + 1)])


def attack_times(kind: str, q: float, uniform: np.ndarray, stay: float) -> np.ndarray:
    """Boolean attack indicator: i.i.d. Bernoulli(q), or a two-state Markov chain with P(on→on) = stay
    and stationary rate q (P(off→on) = (1-stay) q/(1-q)), started from its stationary law."""
    if kind == "none" or q == 0:
        return np.zeros(len(uniform), dtype=bool)
    if kind in ("bias", "adaptive"):
        return uniform < q
    if kind == "bursty":
        enter = (1 - stay) * q / (1 - q)
        on = np.empty(len(uniform), dtype=bool)
        on[0] = uniform[0] < q
        for t in range(1, len(uniform)):
            on[t] = uniform[t] < (stay if on[t - 1] else enter)
        return on
    raise ValueError(f"unknown attack kind '{kind}'")


@dataclass
class Problem:
    """One fit: Y ≈ Θ Φᵀ on T samples, plus a clean held-out segment and the analytic truth."""

    Phi: np.ndarray  # (T, d)
    Y: np.ndarray  # (T, m)
    attacked: np.ndarray  # (T,) bool
    Phi_test: np.ndarray
    Y_test: np.ndarray
    truth: np.ndarray | None  # Θ*_p, (m, d); None for user data
    truncation_norm: float = float("nan")


def build_problem(traj: Trajectory, attack: str, on: str, q: float, p: int, T: int, attack_cfg) -> Problem:
    """Cut the problem (attack model, q, p, T) out of a trajectory; attacks never touch the held-out part."""
    system = traj.system
    n_steps = len(traj.u)
    psi = traj.psi
    theta = system.truth(p)
    times = np.arange(p, n_steps)  # every time with a full memory window
    phi_all = np.zeros((n_steps, theta.shape[1]))
    phi_all[times] = regressors(psi, times, p)
    hit = attack_times(attack, q, traj.attack_uniform, attack_cfg.burst_stay)
    hit[traj.start + traj.n_train:] = False  # the held-out segment is clean
    hit[:traj.start] = False
    if attack == "adaptive":  # the attacker sees the input history: d_t = -κ Θ*_p φ_t
        value = -attack_cfg.kappa * phi_all @ theta.T
    else:
        value = np.broadcast_to(np.asarray(attack_cfg.bias, dtype=float), (n_steps, OUTPUTS))
    d = np.where(hit[:, None], value, 0.0)
    if on == "state":  # x_{t+1} += C⁺ d_t: the attack propagates through the dynamics
        y = simulate(system, psi, traj.w, traj.v, d @ np.linalg.pinv(system.C).T)
    else:
        y = traj.y_clean + d
    train = np.arange(traj.start, traj.start + T)
    test = np.arange(traj.start + traj.n_train, n_steps)
    return Problem(phi_all[train], y[train], hit[train], phi_all[test], y[test], theta, system.truncation_norm(p))


# user trajectories -------------------------------------------------------------------------------
class TrajectoryFormatError(ValueError):
    """A user file that is not a (u, y) trajectory; the message names the file and the problem."""


def load_user_trajectory(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(u (N, k), y (N, m)) from CSV/Parquet with columns u*, y* or npz with arrays u, y."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                missing = [key for key in ("u", "y") if key not in archive.files]
                if missing:
                    raise TrajectoryFormatError(f"data '{path}' has no array(s) {missing} (found {archive.files})")
                u, y = np.asarray(archive["u"], dtype=float), np.asarray(archive["y"], dtype=float)
        else:
            import pandas as pd

            frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
            u_cols = [c for c in frame.columns if str(c).lower().startswith("u")]
            y_cols = [c for c in frame.columns if str(c).lower().startswith("y")]
            if not u_cols or not y_cols:
                raise TrajectoryFormatError(f"data '{path}' needs input columns u* and output columns y* "
                                            f"(found {list(frame.columns)})")
            u, y = frame[u_cols].to_numpy(dtype=float), frame[y_cols].to_numpy(dtype=float)
    except TrajectoryFormatError:
        raise
    except (ValueError, OSError, KeyError, UnicodeDecodeError) as exc:
        raise TrajectoryFormatError(f"data '{path}' cannot be read as a {suffix[1:]} trajectory "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    except Exception as exc:  # pandas/pyarrow parser errors have many types
        raise TrajectoryFormatError(f"data '{path}' cannot be read as a {suffix[1:]} trajectory "
                                    f"({type(exc).__name__})") from None
    u = u.reshape(len(u), -1) if u.ndim == 1 else u
    y = y.reshape(len(y), -1) if y.ndim == 1 else y
    if u.ndim != 2 or y.ndim != 2 or len(u) != len(y):
        raise TrajectoryFormatError(f"data '{path}': u and y must be (N, k) and (N, m) with the same N, "
                                    f"got {u.shape} and {y.shape}")
    if not (np.isfinite(u).all() and np.isfinite(y).all()):
        raise TrajectoryFormatError(f"data '{path}' has missing or non-finite values")
    return u, y


def user_problem(u: np.ndarray, y: np.ndarray, p: int, holdout_frac: float = 0.2) -> Problem:
    """Fit on the first 80 % of a user trajectory, hold out the last 20 % for pred_error."""
    times = np.arange(p, len(u))
    phi = regressors(features(u), times, p)
    split = int(round(len(times) * (1 - holdout_frac)))
    if split < 2 * phi.shape[1] or len(times) - split < 1:
        raise TrajectoryFormatError(f"the user trajectory has {len(u)} samples: too few for p = {p} "
                                    f"({2 * phi.shape[1]} fitting samples needed); lower p or pass more data")
    return Problem(phi[:split], y[times[:split]], np.zeros(split, dtype=bool), phi[split:], y[times[split:]], None)
