"""The two stages of MV-FGAD and its baselines, per job (one variant family × K × seed).

- stage 1: `fedavg` of the GCN (or DOMINANT) with node-weighted averaging; the round with the best
  node-weighted validation AUROC is kept;
- stage 2: `train_views` per client: topology optimisation with the global embeddings, the three
  private views trained on the summed margin losses, epoch selection by validation AUROC per
  scoring rule (the fused detector and the single-view / Euclidean ablations read the same training).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.stats import rankdata

from icml.methods.fgad.model import (GCN, Dominant, Views, gaussian_stats, mahalanobis, margin_loss, minmax,
                                     normalise_adjacency, propagated_features, similarity_graph, view_scores)
from icml.methods.fgad.partition import Client

FLOAT_BYTES = 4
VIEW_RULES = {"view_attr": [0], "view_smooth": [1], "view_signed": [2]}


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC-AUC by the rank-sum (ties share their average rank); nan without both classes."""
    labels = np.asarray(labels) > 0
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weighted_mean(values, weights) -> float:
    values, weights = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    ok = ~np.isnan(values)
    return float((values[ok] * weights[ok]).sum() / weights[ok].sum()) if ok.any() else float("nan")


# stage 1 -----------------------------------------------------------------------------------------------
def average_states(states: list[dict], weights: list[float]) -> dict:
    """θ = Σ_k w_k θ_k / Σ w_k for float tensors; other buffers copied from client 0."""
    total = float(sum(weights))
    out = {}
    for key, first in states[0].items():
        if torch.is_floating_point(first):
            out[key] = sum(state[key] * (w / total) for state, w in zip(states, weights))
        else:
            out[key] = first.clone()
    return out


def gcn_loss(model, client: Client, a_hat: torch.Tensor) -> torch.Tensor:
    z = model(client.x, a_hat)
    train = torch.as_tensor(client.split == 0)
    labels = torch.as_tensor(client.y > 0)
    return margin_loss(z, train & ~labels, train & labels)


def dominant_loss(model, client: Client, a_hat: torch.Tensor) -> torch.Tensor:
    x_hat, adj_hat = model(client.x, a_hat)
    return Dominant.errors(client.x, client.adj, x_hat, adj_hat).mean()


@torch.no_grad()
def gcn_scores(model, client: Client, a_hat: torch.Tensor) -> torch.Tensor:
    """Min-max Mahalanobis distance of the global embeddings to all of the client's nodes."""
    z = model(client.x, a_hat)
    return minmax(mahalanobis(z, *gaussian_stats(z)))


@torch.no_grad()
def dominant_scores(model, client: Client, a_hat: torch.Tensor) -> torch.Tensor:
    x_hat, adj_hat = model(client.x, a_hat)
    return minmax(Dominant.errors(client.x, client.adj, x_hat, adj_hat))


@dataclass
class FedResult:
    state: dict  # the selected global weights
    round: int
    scores: list[np.ndarray]  # per client, at the selected round
    val_auroc: list[float]
    losses: list[float]  # node-weighted mean training loss per round
    rounds: int = 0


def fedavg(model: torch.nn.Module, clients: list[Client], a_hats: list[torch.Tensor], loss_fn, score_fn,
           rounds: int, epochs: int, lr: float, weight_decay: float) -> FedResult:
    """Each round every client loads the global weights, runs `epochs` full-batch Adam steps with a
    fresh optimiser (as the official clients do) and uploads; the server averages by node counts
    and scores."""
    weights = [c.n for c in clients]
    local = [copy.deepcopy(model) for _ in clients]
    global_state = copy.deepcopy(model.state_dict())
    best = FedResult(global_state, -1, [], [], [], rounds)
    best_val = -np.inf
    for r in range(rounds):
        states, losses = [], []
        for m, client, a_hat in zip(local, clients, a_hats):
            m.load_state_dict(global_state)
            m.train()
            opt = torch.optim.Adam(m.parameters(), lr=lr, weight_decay=weight_decay)
            for _ in range(epochs):
                opt.zero_grad()
                loss = loss_fn(m, client, a_hat)
                loss.backward()
                opt.step()
            losses.append(loss.item())
            states.append({k: v.detach().clone() for k, v in m.state_dict().items()})
        global_state = average_states(states, weights)
        best.losses.append(weighted_mean(losses, weights))
        model.load_state_dict(global_state)
        model.eval()
        scores = [score_fn(model, c, a).numpy() for c, a in zip(clients, a_hats)]
        val = [auroc(s[c.split == 1], c.y[c.split == 1]) for s, c in zip(scores, clients)]
        mean_val = weighted_mean(val, weights)
        if mean_val > best_val:  # model selection on validation AUROC only
            best_val = mean_val
            best.state, best.round, best.scores, best.val_auroc = copy.deepcopy(global_state), r, scores, val
    if best.round < 0:  # no client has a validation anomaly: AUROC undefined in every round
        best.state, best.round, best.scores, best.val_auroc = global_state, rounds - 1, scores, val
    model.load_state_dict(best.state)
    return best


# stage 2 -----------------------------------------------------------------------------------------------
@dataclass
class LocalResult:
    scores: dict[str, np.ndarray]  # rule -> scores of the client's nodes at that rule's best epoch
    val_auroc: dict[str, float]
    epoch: dict[str, int]
    losses: list[float]
    state: dict  # the views at the best epoch of the fused rule
    u: torch.Tensor
    params: int


def topology(client: Client, z_global: torch.Tensor | None, tau: float, alpha: float):
    """(U, Â′, S): U from the global embeddings (zero without stage 1), A′ = αA + (1−α)U."""
    u = similarity_graph(z_global, tau) if z_global is not None else torch.zeros_like(client.adj)
    a_hat = normalise_adjacency(alpha * client.adj + (1 - alpha) * u)
    return u, a_hat, propagated_features(client.x, a_hat)


def stage2_seed(seed: int, client_index: int) -> int:
    """The torch seed of a client's stage 2, from (job seed, client) alone: the full method and
    local_only start their views from the same draws whatever stage 1 consumed (a paired comparison)."""
    return int(np.random.SeedSequence([seed, client_index]).generate_state(1)[0])


def train_views(client: Client, z_global: torch.Tensor | None, cfg, rules: dict[str, tuple[list[int], bool]],
                fused_rule: str, seed: int = 0) -> LocalResult:
    """Train the private views; every rule (view subset, euclidean?) keeps its best validation epoch.
    A client whose validation split has no anomaly (AUROC undefined) keeps the last epoch, with a
    NaN validation AUROC."""
    u, _, s = topology(client, z_global, cfg.tau, cfg.alpha)
    torch.manual_seed(seed)
    model = Views(client.x.shape[1], cfg.hidden, cfg.out_dim, cfg.dropout, cfg.beta, cfg.signed_norm)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train = torch.as_tensor(client.split == 0)
    labels = torch.as_tensor(client.y > 0)
    val = client.split == 1
    result = LocalResult({}, {r: -np.inf for r in rules}, {}, [], {}, u, n_params(model))
    for epoch in range(cfg.epochs):
        model.train()
        opt.zero_grad()
        loss = sum(margin_loss(z, train & ~labels, train & labels) for z in model(client.x, s, u))
        loss.backward()
        opt.step()
        result.losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            views = model(client.x, s, u)
            per_view = {False: view_scores(views), True: None}
            for rule, (which, euclid) in rules.items():
                if euclid and per_view[True] is None:
                    per_view[True] = view_scores(views, euclidean=True)
                score = torch.stack([per_view[euclid][i] for i in which]).mean(0).numpy()
                v = auroc(score[val], client.y[val])
                undefined = np.isnan(v) and epoch == cfg.epochs - 1
                if v > result.val_auroc[rule] or (undefined and rule not in result.scores):
                    result.val_auroc[rule], result.epoch[rule], result.scores[rule] = v, epoch, score
                    if rule == fused_rule:
                        result.state = copy.deepcopy(model.state_dict())
    return result


# jobs ---------------------------------------------------------------------------------------------------
@dataclass
class JobResult:
    """What eval needs: scores per variant over all nodes, selection info and costs."""

    kind: str
    K: int
    seed: int
    partition: str
    client: np.ndarray
    split: np.ndarray
    moves: list[dict]
    y: np.ndarray
    group: np.ndarray  # codes into group_names (0 normal)
    group_names: list[str]
    cut_edge_frac: float
    missing: list[tuple[int, int]] = field(default_factory=list)  # (client, split) left without an anomaly
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    val_auroc: dict[str, list[float]] = field(default_factory=dict)
    diag: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> metric -> value
    losses: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (variant, stage) -> curve
    checkpoint: dict = field(default_factory=dict)


def _scatter(n: int, clients: list[Client], per_client: list[np.ndarray]) -> np.ndarray:
    out = np.full(n, np.nan)
    for c, s in zip(clients, per_client):
        out[c.nodes] = s
    return out


def run_mvfgad(job: JobResult, clients: list[Client], cfg, variant: str, local_only: bool = False) -> None:
    """Stage 1 (unless local_only) then stage 2; fills the job's scores for the fused rule, and for
    the full method also fedavg_gcn and the single-view / Euclidean ablations."""
    n = len(job.client)
    n_features = clients[0].x.shape[1]
    weights = [c.n for c in clients]
    start = time.perf_counter()
    shared = 0
    z_global = [None] * len(clients)
    if not local_only:
        gcn = GCN(n_features, cfg.hidden, cfg.out_dim, cfg.dropout)
        a_hats = [normalise_adjacency(c.adj, add_identity=False) for c in clients]
        fed = fedavg(gcn, clients, a_hats, gcn_loss, gcn_scores, cfg.rounds, cfg.local_epochs, cfg.lr,
                     cfg.weight_decay)
        shared = n_params(gcn)
        gcn.eval()
        with torch.no_grad():
            z_global = [gcn(c.x, a) for c, a in zip(clients, a_hats)]
        job.checkpoint["global_gcn"] = fed.state
        if variant == "mvfgad":
            job.scores["fedavg_gcn"] = _scatter(n, clients, fed.scores)
            job.val_auroc["fedavg_gcn"] = fed.val_auroc
            job.diag["fedavg_gcn"] = {"wall_s": time.perf_counter() - start, "params_private": 0.0,
                                      **_comm(shared, len(clients), cfg.rounds)}
        job.losses[("fedavg_gcn" if variant == "mvfgad" else variant, "fedavg")] = fed.losses
    rules = {variant: ([0, 1, 2], False)}
    if variant == "mvfgad":
        rules.update({name: (which, False) for name, which in VIEW_RULES.items()})
        rules["euclidean"] = ([0, 1, 2], True)
    locals_ = [train_views(c, z, cfg, rules, variant, stage2_seed(job.seed, k))
               for k, (c, z) in enumerate(zip(clients, z_global))]
    wall = time.perf_counter() - start
    for rule in rules:
        job.scores[rule] = _scatter(n, clients, [r.scores[rule] for r in locals_])
        job.val_auroc[rule] = [r.val_auroc[rule] for r in locals_]
        job.diag[rule] = {"wall_s": wall, "params_private": float(locals_[0].params),
                          "u_density": weighted_mean([_density(r.u) for r in locals_], weights),
                          **_comm(shared, len(clients), 0 if local_only else cfg.rounds)}
    job.losses[(variant, "local")] = list(np.average([r.losses for r in locals_], axis=0, weights=weights))
    job.checkpoint["clients"] = [{"nodes": c.nodes, "views": r.state, "u": r.u.nonzero().numpy().astype(np.int32)}
                                 for c, r in zip(clients, locals_)]


def run_dominant(job: JobResult, clients: list[Client], cfg) -> None:
    n_features = clients[0].x.shape[1]
    start = time.perf_counter()
    model = Dominant(n_features, cfg.hidden, cfg.out_dim, cfg.dropout)
    a_hats = [normalise_adjacency(c.adj, add_identity=False) for c in clients]
    fed = fedavg(model, clients, a_hats, dominant_loss, dominant_scores, cfg.rounds, cfg.local_epochs, cfg.lr,
                 cfg.weight_decay)
    job.scores["fedavg_dominant"] = _scatter(len(job.client), clients, fed.scores)
    job.val_auroc["fedavg_dominant"] = fed.val_auroc
    job.diag["fedavg_dominant"] = {"wall_s": time.perf_counter() - start, "params_private": 0.0,
                                   **_comm(n_params(model), len(clients), cfg.rounds)}
    job.losses[("fedavg_dominant", "fedavg")] = fed.losses


def _comm(shared: int, k: int, rounds: int) -> dict[str, float]:
    per_round = 2 * k * shared * FLOAT_BYTES if rounds else 0
    return {"params_shared": float(shared), "comm_bytes_per_round": float(per_round),
            "comm_bytes_total": float(per_round * rounds)}


def _density(u: torch.Tensor) -> float:
    n = len(u)
    return float(u.sum() / (n * (n - 1))) if n > 1 else 0.0
