"""The gated VAE and the edge-gated relational DiT (spec: Method 2–3).

Attention is dense, masked and with an explicit softmax (no SDPA / flash kernels) so that
`torch.func.jvp` runs through it; the official edge lists are complete per scene, so dense
attention over valid nodes is the same computation.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_EDGE_TYPES = 6
N_AGENT_TYPES = 3
NEG = -1e9


def mlp(sizes: list[int], act=nn.SiLU) -> nn.Sequential:
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


class EdgeGatedAttention(nn.Module):
    """Multi-head attention from `xq` (B, N, dq) to `xk` (B, M, dk), with the spec's relational gate:
    u = LN(Wx), e_ij = MLP([u_i, u_j, |u_i − u_j|]), out_i = Σ_j (1 + tanh(W_g e_ij)) ·
    softmax_j(q_i·k_j/√d + W_b e_ij) · v_j. The MLP's last layer, W_b and W_g start at zero, so a
    fresh block is plain attention. The gate reads learned node features, never edge labels."""

    def __init__(self, dq: int, dk: int, heads: int, edge_d: int, rel_gate: bool = True):
        super().__init__()
        self.heads, self.dh, self.rel_gate = heads, dq // heads, rel_gate
        self.q, self.k, self.v, self.o = nn.Linear(dq, dq), nn.Linear(dk, dq), nn.Linear(dk, dq), nn.Linear(dq, dq)
        if rel_gate:
            self.uq, self.uk = nn.Linear(dq, edge_d), nn.Linear(dk, edge_d)
            self.norm = nn.LayerNorm(edge_d)
            self.edge = mlp([3 * edge_d, edge_d, edge_d])
            self.bias, self.gate = nn.Linear(edge_d, heads), nn.Linear(edge_d, heads)
            for layer in (self.edge[-1], self.bias, self.gate):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, xq, xk, key_mask):
        B, N, _ = xq.shape
        M = xk.shape[1]
        q = self.q(xq).view(B, N, self.heads, self.dh).transpose(1, 2)
        k = self.k(xk).view(B, M, self.heads, self.dh).transpose(1, 2)
        v = self.v(xk).view(B, M, self.heads, self.dh).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        gate = None
        if self.rel_gate:
            ui, uj = self.norm(self.uq(xq))[:, :, None], self.norm(self.uk(xk))[:, None]
            ui, uj = ui.expand(-1, -1, M, -1), uj.expand(-1, N, -1, -1)
            e = self.edge(torch.cat([ui, uj, (ui - uj).abs()], -1))  # (B, N, M, edge_d)
            scores = scores + self.bias(e).permute(0, 3, 1, 2)
            gate = 1 + torch.tanh(self.gate(e).permute(0, 3, 1, 2))
        scores = scores.masked_fill(~key_mask[:, None, None, :], NEG)
        scores = scores - scores.amax(-1, keepdim=True)  # explicit softmax: jvp-safe
        weights = scores.exp() * key_mask[:, None, None, :]
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
        if gate is not None:
            weights = weights * gate
        out = (weights @ v).transpose(1, 2).reshape(B, N, -1)
        return self.o(out)


class Block(nn.Module):
    """Pre-LN residual attention + MLP; with `cond_d`, adaLN-Zero modulation from the condition c."""

    def __init__(self, dq, dk, heads, edge_d, rel_gate, cond_d: int | None = None):
        super().__init__()
        self.attn = EdgeGatedAttention(dq, dk, heads, edge_d, rel_gate)
        self.n1, self.n2 = nn.LayerNorm(dq, elementwise_affine=cond_d is None), nn.LayerNorm(dq, elementwise_affine=cond_d is None)
        self.nk = nn.LayerNorm(dk)
        self.ff = mlp([dq, 4 * dq, dq], nn.GELU)
        self.ada = None
        if cond_d is not None:
            self.ada = nn.Linear(cond_d, 6 * dq)
            nn.init.zeros_(self.ada.weight)
            nn.init.zeros_(self.ada.bias)

    def forward(self, xq, xk, key_mask, c=None, self_attn=False):
        if self.ada is None:
            s1 = b1 = s2 = b2 = 0.0
            g1 = g2 = 1.0
        else:
            s1, b1, g1, s2, b2, g2 = self.ada(c)[:, None].chunk(6, -1)
        h = self.n1(xq) * (1 + s1) + b1
        kv = h if self_attn else self.nk(xk)
        xq = xq + g1 * self.attn(h, kv, key_mask)
        return xq + g2 * self.ff(self.n2(xq) * (1 + s2) + b2)


def normalise(batch: dict, half: float) -> tuple[torch.Tensor, torch.Tensor]:
    lanes = batch["lanes"].flatten(2) / half
    a = batch["agents"]
    agents = torch.cat([a[..., :2] / half, a[..., 2:3] / 15.0, a[..., 3:5], a[..., 5:6] / 5.0, a[..., 6:7] / 2.5], -1)
    return lanes, agents


def denormalise_agents(a: torch.Tensor, half: float) -> torch.Tensor:
    return torch.cat([a[..., :2] * half, a[..., 2:3] * 15.0, a[..., 3:5], a[..., 5:6] * 5.0, a[..., 6:7] * 2.5], -1)


class GatedVAE(nn.Module):
    """Factorised lane/agent attention encoder–decoder; agents embed as e = (1−g)⊙h_static + g⊙h_motion
    with a per-channel gate g = σ(MLP([state, motion, type]))."""

    def __init__(self, lane_points: int, d: int, blocks: int, heads: int, lane_latent: int, agent_latent: int):
        super().__init__()
        self.lane_in = mlp([2 * lane_points, d, d])
        self.type_emb = nn.Embedding(N_AGENT_TYPES, d)
        self.static_in = mlp([7, d, d])
        self.motion_in = mlp([7 + 12, d, d])
        self.gate = mlp([7 + 12 + N_AGENT_TYPES, d, d])

        def stack():
            return nn.ModuleList(nn.ModuleList([Block(d, d, heads, 8, False), Block(d, d, heads, 8, False),
                                                Block(d, d, heads, 8, False)]) for _ in range(blocks))
        self.enc, self.dec = stack(), stack()
        self.lane_stats, self.agent_stats = nn.Linear(d, 2 * lane_latent), nn.Linear(d, 2 * agent_latent)
        self.lane_up, self.agent_up = nn.Linear(lane_latent, d), nn.Linear(agent_latent, d)
        self.lane_out, self.state_out, self.motion_out = nn.Linear(d, 2 * lane_points), nn.Linear(d, 7), nn.Linear(d, 12)
        self.pair = mlp([2 * d, d, N_EDGE_TYPES])

    @staticmethod
    def _run(blocks, hl, ha, lm, am):
        for l2l, a2l, a2a in blocks:
            hl = l2l(hl, hl, lm, self_attn=True)
            ha = a2l(ha, hl, lm)
            ha = a2a(ha, ha, am, self_attn=True)
        return hl, ha

    def embed_agents(self, agents, motion, agent_type):
        onehot = F.one_hot(agent_type, N_AGENT_TYPES).float()
        g = torch.sigmoid(self.gate(torch.cat([agents, motion, onehot], -1)))
        h_static = self.static_in(agents)
        h_motion = self.motion_in(torch.cat([agents, motion], -1))
        return (1 - g) * h_static + g * h_motion + self.type_emb(agent_type)

    def encode(self, lanes, agents, motion, agent_type, lm, am):
        hl, ha = self._run(self.enc, self.lane_in(lanes), self.embed_agents(agents, motion, agent_type), lm, am)
        return self.lane_stats(hl).chunk(2, -1), self.agent_stats(ha).chunk(2, -1)

    def decode(self, zl, za, lm, am):
        hl, ha = self._run(self.dec, self.lane_up(zl), self.agent_up(za), lm, am)
        L = hl.shape[1]
        pair = torch.cat([hl[:, :, None].expand(-1, -1, L, -1), hl[:, None].expand(-1, L, -1, -1)], -1)
        return dict(lanes=self.lane_out(hl), pair=self.pair(pair), agents=self.state_out(ha), motion=self.motion_out(ha))


def vae_loss(vae: GatedVAE, batch: dict, half: float, generator=None) -> tuple[torch.Tensor, dict]:
    """Lane L1 ×10, pair-type CE ×10, state L1 (xy ×3), motion L1 (static ×2), KL ×1e-2, second-difference
    smoothness ×1e-2, soft collision ×0.1 (spec: Method 2)."""
    lanes, agents = normalise(batch, half)
    lm, am = batch["lane_mask"], batch["agent_mask"]
    (ml, ll), (ma, la) = vae.encode(lanes, agents, batch["motion"], batch["agent_type"], lm, am)
    zl = ml + torch.randn(ml.shape, generator=generator) * (0.5 * ll).exp()
    za = ma + torch.randn(ma.shape, generator=generator) * (0.5 * la).exp()
    out = vae.decode(zl, za, lm, am)
    lmf, amf = lm.float(), am.float()
    n_l, n_a = lmf.sum().clamp_min(1), amf.sum().clamp_min(1)
    lane_l1 = ((out["lanes"] - lanes).abs().mean(-1) * lmf).sum() / n_l
    pair_mask = lm[:, :, None] & lm[:, None, :]
    ce = F.cross_entropy(out["pair"].flatten(0, 2), batch["edges"].flatten(), reduction="none").view_as(pair_mask.float())
    pair_ce = (ce * pair_mask).sum() / pair_mask.sum().clamp_min(1)
    w_state = torch.tensor([3.0, 3.0, 1, 1, 1, 1, 1])
    state_l1 = (((out["agents"] - agents).abs() * w_state).mean(-1) * amf).sum() / n_a
    w_motion = 1 + batch["static"].float()
    motion_l1 = ((out["motion"] - batch["motion"]).abs().mean(-1) * w_motion * amf).sum() / n_a
    kl_l = (0.5 * (ml ** 2 + ll.exp() - 1 - ll)).sum(-1)
    kl_a = (0.5 * (ma ** 2 + la.exp() - 1 - la)).sum(-1)
    kl = ((kl_l * lmf).sum() + (kl_a * amf).sum()) / (n_l + n_a)
    pts = out["lanes"].unflatten(-1, (-1, 2))
    smooth = ((pts[:, :, 2:] - 2 * pts[:, :, 1:-1] + pts[:, :, :-2]).abs().mean((-1, -2)) * lmf).sum() / n_l
    xy = out["agents"][..., :2] * half
    dist = torch.cdist(xy, xy)
    pair_a = am[:, :, None] & am[:, None, :] & ~torch.eye(am.shape[1], dtype=torch.bool)
    collision = (F.relu(2.0 - dist) * pair_a).sum() / pair_a.sum().clamp_min(1)
    total = 10 * lane_l1 + 10 * pair_ce + state_l1 + motion_l1 + 1e-2 * kl + 1e-2 * smooth + 0.1 * collision
    return total, dict(lane_l1=lane_l1.item(), pair_ce=pair_ce.item(), kl=kl.item())


def sinusoidal(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Raw t or h ∈ [0, 1] with the DiT frequencies exp(−ln(10⁴)·i/half) ∈ (10⁻⁴, 1], as officially: the
    embedding is smooth in t, so ∂_t u (the MeanFlow JVP) stays O(1); frequencies up to 10³ made the
    (t − r)·∂_t u target blow up (README)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float64) / half).to(x.dtype)
    angles = x[:, None] * freqs
    return torch.cat([angles.sin(), angles.cos()], -1)


class EGRDiT(nn.Module):
    """adaLN-Zero blocks a2l → l2l ×blocks → l2a → a2a on lane/agent latents; condition c = MLP(emb t ⊕ emb h)
    + scene label (index n_labels = the CFG null label) + #lanes and #agents embeddings."""

    def __init__(self, lane_latent, agent_latent, lane_d, agent_d, heads, blocks, edge_d, max_lanes, max_agents,
                 rel_gate=True, n_labels=2):
        super().__init__()
        c = lane_d
        self.n_labels = n_labels
        self.time = mlp([2 * c, c, c])
        self.label = nn.Embedding(n_labels + 1, c)
        self.n_lanes, self.n_agents = nn.Embedding(max_lanes + 1, c), nn.Embedding(max_agents + 1, c)
        self.lane_in, self.agent_in = nn.Linear(lane_latent, lane_d), nn.Linear(agent_latent, agent_d)
        self.a2l = Block(lane_d, agent_d, heads, edge_d, rel_gate, c)
        self.l2l = nn.ModuleList(Block(lane_d, lane_d, heads, edge_d, rel_gate, c) for _ in range(blocks))
        self.l2a = Block(agent_d, lane_d, heads, edge_d, rel_gate, c)
        self.a2a = Block(agent_d, agent_d, heads, edge_d, rel_gate, c)
        self.lane_out, self.agent_out = nn.Linear(lane_d, lane_latent), nn.Linear(agent_d, agent_latent)
        for layer in (self.lane_out, self.agent_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, zl, za, r, t, cond):
        lm, am = cond["lane_mask"], cond["agent_mask"]
        c = self.time(torch.cat([sinusoidal(t, self.time[0].in_features // 2),
                                 sinusoidal(t - r, self.time[0].in_features // 2)], -1))
        c = c + self.label(cond["label"]) + self.n_lanes(lm.sum(1)) + self.n_agents(am.sum(1))
        # a scene with no agents still needs a valid key for a2l: the masked softmax returns 0 there
        hl, ha = self.lane_in(zl), self.agent_in(za)
        hl = self.a2l(hl, ha, am, c)
        for block in self.l2l:
            hl = block(hl, hl, lm, c, self_attn=True)
        ha = self.l2a(ha, hl, lm, c)
        ha = self.a2a(ha, ha, am, c, self_attn=True)
        return self.lane_out(hl), self.agent_out(ha)
