"""Interval-conditioned MeanFlow ("identity" mode) and its flow-matching baseline on scene latents
(spec: Method 4–5): (t, r) sampling, the JVP target with stop-gradient, adaptive weighting, few-step
sampling with classifier-free guidance, and masked outpainting with fixed nodes re-imposed."""
from __future__ import annotations

import torch
from torch.func import jvp


def sample_t_r(batch: int, cfg, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both logit-normal(mean, std), sorted so t ≥ r; r = t with probability r_equals_t; the last
    forced_frac of the batch forced to (t, r) = (1, 0)."""
    a = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(batch, generator=generator))
    b = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(batch, generator=generator))
    t, r = torch.maximum(a, b), torch.minimum(a, b)
    same = torch.rand(batch, generator=generator) < cfg.r_equals_t
    r = torch.where(same, t, r)
    n_forced = int(round(cfg.forced_frac * batch))
    if n_forced:
        t[batch - n_forced:], r[batch - n_forced:] = 1.0, 0.0
    return t, r


def mean_velocity_target(model, zl, za, r, t, cond, free_l, free_a):
    """u_tgt-side pieces of the identity u = v − (t−r)∂_t u: v_θ = u_θ(z_t, t, t) and ∂_t u, the JVP of
    u_θ at (z_t, t, r) along the tangent (v_θ, 1, 0) in (z, t, r) — both without gradients."""
    with torch.no_grad():
        vl, va = model(zl, za, t, t, cond)
        vl, va = vl * free_l[..., None], va * free_a[..., None]  # fixed nodes do not move
    _, (dl, da) = jvp(lambda zl_, za_, t_: model(zl_, za_, r, t_, cond), (zl, za, t), (vl, va, torch.ones_like(t)))
    return (vl, va), (dl.detach(), da.detach())


def scene_loss(model, xl, xa, cond, fixed_l, fixed_a, cfg, mode: str = "meanflow", generator=None):
    """Adaptive-weighted ‖V − v‖² over free valid nodes, V = u_θ(z_t, r, t) + (t−r)·sg(∂_t u) (meanflow)
    or u_θ(z_t, t, t) (flow); fixed nodes get ε = x, so z_t = x and v = 0 there."""
    B = xl.shape[0]
    lm, am = cond["lane_mask"], cond["agent_mask"]
    free_l, free_a = (lm & ~fixed_l).float(), (am & ~fixed_a).float()
    el = torch.randn(xl.shape, generator=generator)
    ea = torch.randn(xa.shape, generator=generator)
    el = torch.where(fixed_l[..., None], xl, el)
    ea = torch.where(fixed_a[..., None], xa, ea)
    if mode == "meanflow":
        t, r = sample_t_r(B, cfg, generator)
    else:
        t = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(B, generator=generator))
        r = t
    tl, tb = t[:, None, None], (t - r)[:, None, None]
    zl, za = (1 - tl) * xl + tl * el, (1 - tl) * xa + tl * ea
    vl, va = el - xl, ea - xa
    ul, ua = model(zl, za, r, t, cond)
    if mode == "meanflow":
        _, (dl, da) = mean_velocity_target(model, zl, za, r, t, cond, free_l, free_a)
        ul, ua = ul + tb * dl, ua + tb * da
    err_l = ((ul - vl) ** 2).sum(-1) * free_l
    err_a = ((ua - va) ** 2).sum(-1) * free_a
    per_scene = (err_a.sum(1) + cfg.w_lane * err_l.sum(1)) / (free_l.sum(1) + free_a.sum(1)).clamp_min(1)
    weight = (per_scene.detach() + 1e-3) ** (-cfg.adaptive_power)
    return (weight * per_scene).mean(), per_scene.mean().detach()


def guided(model, zl, za, r, t, cond, scale: float):
    """u^cfg = u(∅) + s·(u(c) − u(∅)), both halves in one batch."""
    if scale == 1.0:
        return model(zl, za, r, t, cond)
    null = dict(cond, label=torch.full_like(cond["label"], model.n_labels))
    both = {k: torch.cat([cond[k], null[k]]) for k in cond}
    ul, ua = model(torch.cat([zl, zl]), torch.cat([za, za]), torch.cat([r, r]), torch.cat([t, t]), both)
    B = zl.shape[0]
    return ul[B:] + scale * (ul[:B] - ul[B:]), ua[B:] + scale * (ua[:B] - ua[B:])


@torch.no_grad()
def sample(model, cond, lane_dim, agent_dim, steps: int, solver: str, scale: float, clamp: float,
           fixed=None, generator=None):
    """From noise at t = 1 to data at t = 0 on t_k = linspace(1, 0, K+1).
    meanflow: z ← z − (t_k − t_{k+1})·u^cfg(z, r=t_{k+1}, t=t_k); euler/heun: the flow field u(z, t, t).
    `fixed` = (xl, xa, fixed_l, fixed_a): those latents are imposed at init and after every step."""
    B, L = cond["lane_mask"].shape
    A = cond["agent_mask"].shape[1]
    zl = torch.randn((B, L, lane_dim), generator=generator)
    za = torch.randn((B, A, agent_dim), generator=generator)

    def impose(zl, za):
        if fixed is None:
            return zl, za
        xl, xa, fl, fa = fixed
        return torch.where(fl[..., None], xl, zl), torch.where(fa[..., None], xa, za)

    zl, za = impose(zl, za)
    ts = torch.linspace(1, 0, steps + 1)
    for k in range(steps):
        t, s = ts[k].expand(B), ts[k + 1].expand(B)
        dt = ts[k] - ts[k + 1]
        if solver == "meanflow":
            ul, ua = guided(model, zl, za, s, t, cond, scale)
        else:
            ul, ua = guided(model, zl, za, t, t, cond, scale)
            if solver == "heun":
                pl, pa = zl - dt * ul, za - dt * ua
                ul2, ua2 = guided(model, pl, pa, s, s, cond, scale)
                ul, ua = (ul + ul2) / 2, (ua + ua2) / 2
        zl, za = (zl - dt * ul).clamp(-clamp, clamp), (za - dt * ua).clamp(-clamp, clamp)
        zl, za = impose(zl, za)
    return zl, za
