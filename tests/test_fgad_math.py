"""MV-FGAD's mathematical identities: pseudo-inverse Mahalanobis invariances and limits, the margin
loss in closed form, the signed normalisation map, V3 against a direct PReLU implementation, the
GCN normalisation against torch-geometric, topology optimisation, AUROC, and the FedAvg algebra."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from icml.methods.fgad.algorithm import auroc, average_states, fedavg, gcn_loss, gcn_scores, topology
from icml.methods.fgad.model import (GCN, SignedView, gaussian_stats, mahalanobis, margin_loss, minmax,
                                     normalise_adjacency, signed_normalise, view_scores)
from icml.methods.fgad.partition import Client

torch.set_default_dtype(torch.float32)


def _gaussian(n=300, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)


def test_mahalanobis_is_invariant_to_invertible_affine_maps():
    z = _gaussian()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64) + 3 * torch.eye(6, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    d = mahalanobis(z, *gaussian_stats(z))
    w = z @ a + b
    torch.testing.assert_close(mahalanobis(w, *gaussian_stats(w)), d, rtol=1e-8, atol=1e-8)


def test_mahalanobis_of_float32_embeddings_is_invariant_under_ill_conditioned_affine_maps():
    """Float32 input, κ(M) = 1e3, N = 2000, D = 8/16/32, 20 draws. Storing W = Z·M + b in float32
    perturbs it by ~eps32·|W|, which whitening amplifies by up to κ(M): the bound is eps32·κ(M)
    (measured ≤ 0.07 of it). With Σ and Σ⁺ in float32 the distances moved by up to 70 %."""
    eps32, kappa = torch.finfo(torch.float32).eps, 1e3
    for draw in range(20):
        g = torch.Generator().manual_seed(draw)
        dim = (8, 16, 32)[draw % 3]
        z = torch.randn(2000, dim, generator=g)
        left, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        right, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        m = (left * torch.logspace(0, 3, dim, dtype=torch.float64)) @ right.T  # singular values 1 … 1e3
        w = (z.double() @ m + 10 * torch.randn(dim, generator=g, dtype=torch.float64)).float()
        d, d_mapped = mahalanobis(z, *gaussian_stats(z)), mahalanobis(w, *gaussian_stats(w))
        assert d.dtype == torch.float32 and d_mapped.dtype == torch.float32
        assert float(((d_mapped.double() - d.double()).abs() / d.double()).max()) < eps32 * kappa, draw


def test_pinv_handles_rank_deficient_embeddings():
    """Embeddings in a 3-d subspace of R^6 (orthonormal basis): the pseudo-inverse distance equals
    the full-rank distance of the subspace coordinates; a plain inverse would not exist."""
    coords = _gaussian(d=3)
    basis, _ = torch.linalg.qr(torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    z = coords @ basis.T + 5.0
    mu, precision = gaussian_stats(z)
    assert torch.linalg.matrix_rank(torch.linalg.pinv(precision)).item() == 3
    torch.testing.assert_close(mahalanobis(z, mu, precision), mahalanobis(coords, *gaussian_stats(coords)),
                               rtol=1e-7, atol=1e-7)


def test_mahalanobis_with_identity_covariance_is_euclidean():
    z = _gaussian()
    mu = z.mean(0)
    expected = ((z - mu).pow(2).sum(1) + 1e-8).sqrt()
    torch.testing.assert_close(mahalanobis(z, mu, torch.eye(6, dtype=torch.float64)), expected, rtol=1e-12, atol=0)
    # whitened data has Σ = I, so its estimated Mahalanobis distance is its Euclidean one
    centred = z - mu
    cov = centred.T @ centred / (len(z) - 1)
    white = centred @ torch.linalg.inv(torch.linalg.cholesky(cov)).T
    torch.testing.assert_close(mahalanobis(white, *gaussian_stats(white)), (white.pow(2).sum(1) + 1e-8).sqrt(),
                               rtol=1e-8, atol=1e-8)


def test_margin_loss_closed_form():
    z = _gaussian(n=60, d=4)
    normal = torch.zeros(60, dtype=torch.bool)
    normal[:40] = True
    anomalous = torch.zeros(60, dtype=torch.bool)
    anomalous[50:] = True
    zn = z[:40].numpy()
    mu = zn.mean(0)
    precision = np.linalg.pinv(np.cov(zn, rowvar=False, ddof=1))
    d = np.sqrt(np.einsum("ij,jk,ik->i", z.numpy() - mu, precision, z.numpy() - mu) + 1e-8)
    expected = d[:40].mean() + max(0.0, 1 - (d[50:].mean() - d[:40].mean()))
    assert margin_loss(z, normal, anomalous).item() == pytest.approx(expected, rel=1e-10)
    assert margin_loss(z, normal, torch.zeros_like(anomalous)).item() == pytest.approx(d[:40].mean(), rel=1e-10)


def test_view_scores_min_max_and_euclidean_rule():
    z = _gaussian(n=50, d=5).float()
    (maha,), (eucl,) = view_scores([z]), view_scores([z], euclidean=True)
    assert maha.min().item() == 0.0 and maha.max().item() == pytest.approx(1.0, abs=1e-6)
    unit = torch.nn.functional.normalize(z, dim=1)
    torch.testing.assert_close(eucl, minmax(((unit - unit.mean(0)).pow(2).sum(1) + 1e-8).sqrt()))


def test_signed_normalisation_map():
    r = torch.tensor([[0.0, 0.8, 0.2], [0.8, 0.0, 0.5], [0.2, 0.5, 0.0]], dtype=torch.float64)
    m = 1.0 / 3.0  # mean of all nine entries
    top = 0.8 - m
    code = torch.tensor([[1.0, 1.0, -0.2 / m], [1.0, 1.0, (0.5 - m) / top], [-0.2 / m, (0.5 - m) / top, 1.0]],
                        dtype=torch.float64)
    torch.testing.assert_close(signed_normalise(r.clone(), "code"), code, rtol=1e-12, atol=1e-12)
    symmetric = code.clone()
    symmetric[0, 2] = symmetric[2, 0] = (0.2 - m) / (m - 0.0)
    torch.testing.assert_close(signed_normalise(r.clone(), "symmetric"), symmetric, rtol=1e-12, atol=1e-12)


def test_signed_view_matches_direct_prelu_formula():
    torch.manual_seed(0)
    n, f = 40, 12
    view = SignedView(f, 16, 8, dropout=0.5, beta=0.3, mode="code").double().eval()
    with torch.no_grad():
        view.prelu.weight.fill_(0.3)
    assert sum(p.numel() for p in view.parameters()) == sum(p.numel() for p in view.mlp.parameters())  # one slope
    s = torch.randn(n, f, dtype=torch.float64)
    u = (torch.rand(n, n) > 0.7).double()
    u = torch.triu(u, 1) + torch.triu(u, 1).T
    out = view(s, u)
    assert out.shape == (n, 8)
    e = view.mlp(s)
    unit = torch.nn.functional.normalize(e, dim=1)
    r = (0.3 * u + 0.7 * unit @ unit.T) * (1 - torch.eye(n, dtype=torch.float64))
    r = signed_normalise(r, "code")
    p = torch.nn.functional.prelu(r, view.prelu.weight)
    q = torch.nn.functional.prelu(-r, view.prelu.weight)
    expected = torch.softmax(p @ e, 1) - torch.softmax(q @ e, 1) + e
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_adjacency_normalisation_matches_torch_geometric():
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import to_dense_adj

    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3, 0, 4], [1, 0, 2, 1, 3, 2, 4, 0]])
    adj = to_dense_adj(edge_index, max_num_nodes=5)[0].double()
    ones = torch.ones(edge_index.shape[1], dtype=torch.float64)
    index, weight = gcn_norm(edge_index, ones, num_nodes=5, add_self_loops=True, dtype=torch.float64)
    expected = to_dense_adj(index, edge_attr=weight, max_num_nodes=5)[0]
    torch.testing.assert_close(normalise_adjacency(adj), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(normalise_adjacency(adj + torch.eye(5, dtype=torch.float64), add_identity=False),
                               expected, rtol=1e-12, atol=1e-12)


def _client(n=30, f=6, seed=0) -> Client:
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.random((n, n)) < 0.15, 1)
    adj = torch.as_tensor((upper | upper.T).astype(np.float32)) + torch.eye(n)
    y = np.zeros(n, dtype=np.int64)
    y[[1, 5, 9, 14, 20, 27]] = 1
    split = np.array([0, 1, 2] * (n // 3))
    return Client(np.arange(n), torch.as_tensor(rng.standard_normal((n, f)), dtype=torch.float32), adj, y, split,
                  y.copy())


def test_topology_optimisation_and_local_only():
    client = _client()
    z = torch.randn(30, 4)
    z[3] = z[7] * 2.5  # same direction: cosine 1
    u, a_hat, s = topology(client, z, tau=0.9, alpha=0.5)
    assert u[3, 7] == 1 and u[7, 3] == 1 and torch.all(u.diagonal() == 0)
    unit = z.numpy() / np.linalg.norm(z.numpy(), axis=1, keepdims=True)  # cosines in numpy, not the code's
    expected_u = (unit @ unit.T > 0.9).astype(np.float32)
    np.fill_diagonal(expected_u, 0.0)
    np.testing.assert_array_equal(u.numpy(), expected_u)
    expected = 0.5 * client.adj + 0.5 * u + torch.eye(30)
    d = expected.sum(1).rsqrt()
    torch.testing.assert_close(a_hat, d[:, None] * expected * d[None, :])
    torch.testing.assert_close(s[:, 6:12], a_hat @ client.x)
    torch.testing.assert_close(s[:, 18:], a_hat @ a_hat @ a_hat @ client.x, rtol=1e-5, atol=1e-5)
    # local_only: U ≡ 0, but A′ = αA keeps α, so Â′ ≠ the plain GCN normalisation of A
    u0, a_local, _ = topology(client, None, tau=0.9, alpha=0.5)
    assert u0.sum() == 0
    expected = 0.5 * client.adj + torch.eye(30)
    d = expected.sum(1).rsqrt()
    torch.testing.assert_close(a_local, d[:, None] * expected * d[None, :])
    assert not torch.allclose(a_local, normalise_adjacency(client.adj, add_identity=False))


def test_auroc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 10, 500).astype(float)  # many ties
    labels = rng.random(500) < 0.2
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert np.isnan(auroc(scores, np.zeros(500)))


def test_fedavg_node_weighted_average():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g), "steps": torch.tensor(k + 7)}
              for k in range(3)]
    n = [10, 30, 60]
    out = average_states(states, n)
    manual = (10 * states[0]["w"] + 30 * states[1]["w"] + 60 * states[2]["w"]) / 100
    torch.testing.assert_close(out["w"], manual, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["b"], sum(s["b"] * w for s, w in zip(states, n)) / 100, rtol=1e-6, atol=1e-7)
    assert out["steps"].item() == 7  # non-float buffers: client 0's


def test_fedavg_with_one_client_is_centralised_training():
    """K=1: every round's weights and losses equal full-batch Adam on the whole graph, restarted
    every `epochs` steps (a client starts each round with a fresh optimiser)."""
    client = _client()
    a_hat = normalise_adjacency(client.adj, add_identity=False)
    torch.manual_seed(0)
    model = GCN(6, 16, 4, dropout=0.5)
    central = copy.deepcopy(model)
    torch.manual_seed(1)
    fed = fedavg(model, [client], [a_hat], gcn_loss, gcn_scores, rounds=4, epochs=3, lr=1e-2, weight_decay=5e-4)
    torch.manual_seed(1)
    losses, states = [], []
    for step in range(12):
        if step % 3 == 0:
            opt = torch.optim.Adam(central.parameters(), lr=1e-2, weight_decay=5e-4)
        central.train()
        opt.zero_grad()
        loss = gcn_loss(central, client, a_hat)
        loss.backward()
        opt.step()
        if step % 3 == 2:
            losses.append(loss.item())
            states.append(copy.deepcopy(central.state_dict()))
    assert fed.losses == pytest.approx(losses, rel=1e-6, abs=1e-7)
    for key, value in states[fed.round].items():
        torch.testing.assert_close(fed.state[key], value, rtol=1e-6, atol=1e-7)


def test_fedavg_without_any_validation_anomaly_keeps_the_last_round():
    """AUROC is undefined in every round: the last round is kept (DOMINANT kept its initial weights
    before), with NaN validation AUROC."""
    client = _client()
    client.y[client.split == 1] = 0
    a_hat = normalise_adjacency(client.adj, add_identity=False)
    torch.manual_seed(0)
    model = GCN(6, 16, 4, dropout=0.0)
    initial = copy.deepcopy(model.state_dict())
    fed = fedavg(model, [client], [a_hat], gcn_loss, gcn_scores, rounds=3, epochs=2, lr=1e-2, weight_decay=0.0)
    assert fed.round == 2 and np.isnan(fed.val_auroc).all() and len(fed.scores) == 1
    assert not torch.equal(model.state_dict()["w1.weight"], initial["w1.weight"])
    model.eval()
    np.testing.assert_array_equal(fed.scores[0], gcn_scores(model, client, a_hat).numpy())


def test_stage_two_without_u_equals_local_only_bit_for_bit():
    """τ > 1 switches U off; stage 2 is seeded from (seed, client) alone, so the full method's fused
    scores equal local_only's exactly although stage 1 consumed the torch stream first."""
    from icml.methods.fgad.config import preset
    from icml.methods.fgad.pipeline import JobSpec, run_job

    cfg = preset("smoke")
    cfg.n_nodes, cfg.rounds, cfg.epochs, cfg.hidden, cfg.out_dim, cfg.tau = 300, 2, 3, 16, 8, 1.5
    full = run_job(cfg, JobSpec("mvfgad", 3, 0, "louvain"))
    local = run_job(cfg, JobSpec("local_only", 3, 0, "louvain"))
    assert full.diag["mvfgad"]["u_density"] == 0.0
    np.testing.assert_array_equal(full.scores["mvfgad"], local.scores["local_only"])
    cfg.tau = 0.9  # with U on, they differ
    assert not np.array_equal(run_job(cfg, JobSpec("mvfgad", 3, 0, "louvain")).scores["mvfgad"], local.scores["local_only"])


def test_communication_bytes_are_those_of_the_serialised_state_dict():
    """One round moves every client's upload and download of the shared weights: the bytes of the
    tensors torch.save writes for the GCN's state dict, counted here from the saved file."""
    import io
    import zipfile

    from icml.methods.fgad.algorithm import _comm, n_params

    gcn = GCN(32, 64, 32, 0.5)
    buffer = io.BytesIO()
    torch.save(gcn.state_dict(), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:  # tensor payloads live in data/
        payload = sum(item.file_size for item in archive.infolist() if "/data/" in item.filename)
    comm = _comm(n_params(gcn), 10, 50)
    assert comm["comm_bytes_per_round"] == 2 * 10 * payload
    assert comm["comm_bytes_total"] == 50 * comm["comm_bytes_per_round"]
    assert _comm(n_params(gcn), 10, 0)["comm_bytes_total"] == 0
