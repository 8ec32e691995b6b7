"""Models and distances of MV-FGAD, dense and pure torch (client subgraphs are small).

- `normalise_adjacency`: Â = D^{-1/2}(A+I)D^{-1/2};
- `GCN`: the communicated stage-1 encoder z = ÂHW₂ + HW₃ + b with H = ReLU(ÂXW₁);
- `MLP`, `SignedView`: the three private views (V3 with the official signed normalisation);
- `Dominant`: the unsupervised DOMINANT baseline (GCN encoder, attribute and structure decoders, PyGOD's layout);
- `mahalanobis`, `margin_loss`: pseudo-inverse Mahalanobis distances and the semi-supervised loss.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

EPS_DIST = 1e-8
EPS_MINMAX = 1e-8


def normalise_adjacency(adj: torch.Tensor, add_identity: bool = True) -> torch.Tensor:
    """D^{-1/2}(A+I)D^{-1/2} (or of A itself when it already holds its self-loops)."""
    a = adj + torch.eye(len(adj), dtype=adj.dtype) if add_identity else adj
    d = a.sum(1).clamp(min=1e-12).rsqrt()
    return d[:, None] * a * d[None, :]


def propagated_features(x: torch.Tensor, a_hat: torch.Tensor, hops: int = 3) -> torch.Tensor:
    """S = [X ‖ ÂX ‖ Â²X ‖ Â³X]."""
    out = [x]
    for _ in range(hops):
        out.append(a_hat @ out[-1])
    return torch.cat(out, 1)


def cosine_matrix(z: torch.Tensor) -> torch.Tensor:
    z = F.normalize(z, dim=1)
    return z @ z.T


def similarity_graph(z: torch.Tensor, tau: float) -> torch.Tensor:
    """U_ij = 1[cos(z_i, z_j) > τ] for i ≠ j, zero diagonal."""
    u = (cosine_matrix(z) > tau).float()
    u.fill_diagonal_(0.0)
    return u


# stage 1: the communicated GCN ------------------------------------------------------------------------
class GCN(nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(n_in, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_out, bias=False)
        self.w3 = nn.Linear(hidden, n_out)  # the skip path carries the bias b
        self.dropout = dropout

    def forward(self, x: torch.Tensor, a_hat: torch.Tensor) -> torch.Tensor:
        h = F.relu(a_hat @ self.w1(x))
        h = F.dropout(h, self.dropout, self.training)
        return a_hat @ self.w2(h) + self.w3(h)


# stage 2: the private views ---------------------------------------------------------------------------
class MLP(nn.Module):
    """n_in → hidden → hidden → n_out; `act` between layers, dropout after each hidden layer."""

    def __init__(self, n_in: int, hidden: int, n_out: int, dropout: float, act=nn.ReLU):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(n_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, n_out)])
        self.acts = nn.ModuleList([act(), act()])
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers[:-1], self.acts):
            x = F.dropout(act(layer(x)), self.dropout, self.training)
        return self.layers[-1](x)


def signed_normalise(r: torch.Tensor, mode: str = "code") -> torch.Tensor:
    """Centre R by its global mean m; positive r̃ → r̃/(max R − m); non-positive r̃ → −(r̃+m)/m (the
    official map, `code`) or r̃/(m − min R) (`symmetric`); diagonal 1."""
    m = r.mean()
    centred = r - m
    positive = centred * (1 / (r.max() - m).clamp(min=EPS_MINMAX))  # scalar reciprocals: N² muls, not divs
    if mode == "code":
        negative = r * (-1 / m.clamp(min=EPS_MINMAX))  # −(r̃ + m)/m, m clamped as in the official code
    else:
        negative = centred * (1 / (m - r.min()).clamp(min=EPS_MINMAX))
    above = (centred > 0).to(r.dtype)  # a constant mask: cheaper to differentiate than torch.where
    return (above * positive + (1 - above) * negative).fill_diagonal_(1.0)


class SignedView(nn.Module):
    """V3: E = MLP_h(S); R = βU + (1−β)cos(E) (zero diagonal), signed-normalised;
    H₃ = softmax(PE) − softmax(QE) + E with P = PReLU(R), Q = PReLU(−R), softmax over the embedding
    dimension. As in the official code, one PReLU (one slope a) serves the MLP's hidden layers and
    both signals. Dense N_k×N_k."""

    def __init__(self, n_in: int, hidden: int, n_out: int, dropout: float, beta: float, mode: str):
        super().__init__()
        self.prelu = nn.PReLU()
        self.mlp = MLP(n_in, hidden, n_out, dropout, act=lambda: self.prelu)
        self.beta, self.mode = beta, mode

    def forward(self, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        e = self.mlp(s)
        r = (self.beta * u + (1 - self.beta) * cosine_matrix(e)).fill_diagonal_(0.0)
        r = signed_normalise(r, self.mode)
        # PReLU_a(R) = relu(R) − a·relu(−R) and PReLU_a(−R) = relu(−R) − a·relu(R): two N²×d products
        # serve both P E and Q E, and skip PReLU's slow N² backward
        pos_e, neg_e = F.relu(r) @ e, F.relu(-r) @ e
        a = self.prelu.weight
        return torch.softmax(pos_e - a * neg_e, dim=1) - torch.softmax(neg_e - a * pos_e, dim=1) + e


class Views(nn.Module):
    """The private detector of one client: V1 on X, V2 on S, V3 on (S, U)."""

    def __init__(self, n_features: int, hidden: int, n_out: int, dropout: float, beta: float, mode: str):
        super().__init__()
        self.attr = MLP(n_features, hidden, n_out, dropout)
        self.smooth = MLP(4 * n_features, hidden, n_out, dropout)
        self.signed = SignedView(4 * n_features, hidden, n_out, dropout, beta, mode)

    def forward(self, x: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> list[torch.Tensor]:
        return [self.attr(x), self.smooth(s), self.signed(s, u)]


# DOMINANT baseline ------------------------------------------------------------------------------------
class GraphConv(nn.Module):
    """One GCN layer on a dense normalised adjacency: Â(HW) + b, the bias added after propagation and
    glorot/zero initialisation, as torch-geometric's GCNConv."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.xavier_uniform_(self.lin.weight)

    def forward(self, h: torch.Tensor, a_hat: torch.Tensor) -> torch.Tensor:
        return a_hat @ self.lin(h) + self.bias


class Dominant(nn.Module):
    """DOMINANT (Ding et al., SDM 2019) as PyGOD builds it: GCN encoder F→hidden→out, GCN attribute
    decoder out→hidden→F (ReLU and dropout between layers, none after the last), structure decoder one
    GCN layer out→out then Â_rec = HHᵀ. No sigmoid on HHᵀ (the authors' code; PyGOD's default
    sigmoid_s=False): σ(ZZᵀ) of a ReLU embedding is ≥ 0.5 everywhere, which erased structural anomalies."""

    def __init__(self, n_in: int, hidden: int, n_out: int, dropout: float):
        super().__init__()
        self.encoder = nn.ModuleList([GraphConv(n_in, hidden), GraphConv(hidden, n_out)])
        self.attr_decoder = nn.ModuleList([GraphConv(n_out, hidden), GraphConv(hidden, n_in)])
        self.struct_decoder = GraphConv(n_out, n_out)
        self.dropout = dropout

    def _gcn(self, layers: nn.ModuleList, h: torch.Tensor, a_hat: torch.Tensor) -> torch.Tensor:
        for layer in layers[:-1]:
            h = F.dropout(F.relu(layer(h, a_hat)), self.dropout, self.training)
        return layers[-1](h, a_hat)

    def forward(self, x: torch.Tensor, a_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self._gcn(self.encoder, x, a_hat)
        h = self.struct_decoder(z, a_hat)
        return self._gcn(self.attr_decoder, z, a_hat), h @ h.T

    @staticmethod
    def errors(x, adj, x_hat, a_hat) -> torch.Tensor:
        """Per node 0.5‖x−x̂‖ + 0.5‖a−â‖: the loss terms and the anomaly score."""
        return 0.5 * (x - x_hat).norm(dim=1) + 0.5 * (adj - a_hat).norm(dim=1)


# distances and the margin loss ------------------------------------------------------------------------
def gaussian_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, pseudo-inverse covariance) with the n−1 divisor, in float64.

    The distance is affine-invariant only as far as Σ⁺ is accurate: in float32 an ill-conditioned
    Σ (condition ~1e6 after a random affine map) loses most digits of its small eigenvalues and
    distances moved by up to 48 % under Z·M + b. Float64 keeps them (the tests pin invariance)."""
    z = z.double()
    mu = z.mean(0)
    centred = z - mu
    cov = centred.T @ centred / max(len(z) - 1, 1)
    return mu, torch.linalg.pinv(cov, hermitian=True)


def mahalanobis(z: torch.Tensor, mu: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """d_i = √((z_i−μ)ᵀ P (z_i−μ) + 1e-8), computed in float64 and returned in z's dtype."""
    diff = z.double() - mu.double()
    return ((diff @ precision.double()) * diff).sum(1).add(EPS_DIST).sqrt().to(z.dtype)


def margin_loss(z: torch.Tensor, normal: torch.Tensor, anomalous: torch.Tensor) -> torch.Tensor:
    """mean_N d + max(0, 1 − (mean_A d − mean_N d)), d to the train-normal mean/pinv-covariance."""
    mu, precision = gaussian_stats(z[normal])
    d = mahalanobis(z, mu, precision)
    d_normal = d[normal].mean()
    if not anomalous.any():
        return d_normal
    return d_normal + F.relu(1 - (d[anomalous].mean() - d_normal))


def minmax(s: torch.Tensor) -> torch.Tensor:
    return (s - s.min()) / (s.max() - s.min() + EPS_MINMAX)


def view_scores(views: list[torch.Tensor], euclidean: bool = False) -> list[torch.Tensor]:
    """Per view: L2-normalised rows, distance to the mean (and pinv covariance) of all local nodes,
    min-max to [0, 1]."""
    out = []
    for z in views:
        z = F.normalize(z, dim=1)
        if euclidean:
            mu, precision = z.mean(0), torch.eye(z.shape[1])
        else:
            mu, precision = gaussian_stats(z)
        out.append(minmax(mahalanobis(z, mu, precision)))
    return out
