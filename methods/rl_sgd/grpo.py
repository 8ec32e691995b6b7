"""GRPO without a KL term, the optimizer arms, and one update of RL or of the SFT control.

Advantages are normalised within each group of G completions of one prompt,
    A_i = (r_i − mean_g r) / (std_g r + ε_std)      (population std),
and groups whose rewards are all equal are skipped: their tokens leave the numerator and the
denominator of the token-level clipped surrogate
    L = −(1/Σ_i|o_i|) Σ_i Σ_t min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1−ε, 1+ε) A_i),   ρ = π_θ/π_old.
With one optimizer step per batch π_old is the detached current policy, so ρ ≡ 1 exactly and the
gradient is the token-averaged policy gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from icml.cli import distributed
from icml.methods.rl_sgd.model import Prompts, completion_logprobs

# The optimizer of each arm as the spec's table gives it; weight decay 0 everywhere.
OPTIMIZER_OF = {"adamw": "AdamW", "sgd": "SGD", "sgd_momentum": "SGD(momentum=0.9)", "rmsprop": "RMSprop",
                "adam_nomomentum": "Adam(betas=(0, 0.999))", "sgd_bf16_master": "SGD (bf16 master)",
                "muon": "SpectralOptimizer(mSGDZ)", "sft_adamw": "AdamW", "sft_sgd": "SGD"}
MUON_VECTOR_LR = 1e-4  # Muon's vector (RMSNorm) parameters take AdamW at the AdamW arm's scale


def build_optimizer(arm: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if arm in ("adamw", "sft_adamw"):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if arm in ("sgd", "sft_sgd", "sgd_bf16_master"):
        return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=0.0)
    if arm == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
    if arm == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=0.99, eps=1e-8, momentum=0.0, weight_decay=0.0)
    if arm == "adam_nomomentum":
        return torch.optim.Adam(params, lr=lr, betas=(0.0, 0.999), eps=1e-8, weight_decay=0.0)
    if arm == "muon":
        from icml.methods.spectral_optim.optim import SpectralOptimizer

        return SpectralOptimizer(model, "mSGDZ", lr_matrix=lr, lr_vector=MUON_VECTOR_LR, weight_decay=0.0,
                                 model=model)
    raise ValueError(f"unknown arm '{arm}'")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Σ numel × element_size over every tensor in optimizer.state (scalar `step` tensors included)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def group_advantages(rewards: torch.Tensor, std_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [P, G], kept [P]) from rewards [P, G]: population-std normalisation within each group;
    a group is kept when its rewards are not all equal."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    kept = (rewards != rewards[:, :1]).any(dim=1)
    return (rewards - mean) / (std + std_eps), kept


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_eps: float, count: float | None = None) -> torch.Tensor:
    """The token-level clipped surrogate loss over the tokens of `mask` (rows: completions), divided
    by their number, or by `count` (under torchrun: the global batch's share, `distributed.sum_divisor`)."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    mask = mask.to(surrogate.dtype)
    return -(surrogate * mask).sum() / (mask.sum() if count is None else count)


@dataclass
class Rollout:
    prompts: Prompts  # [P·G, L], each prompt repeated G times (group-major)
    tokens: torch.Tensor  # [P·G, T]
    mask: torch.Tensor  # [P·G, T] completion tokens up to and including <eos>
    rewards: torch.Tensor  # [P, G]


def rank_share(prompts: Prompts, tokens: torch.Tensor, mask: torch.Tensor, *per_row: torch.Tensor):
    """Under torchrun, where every rank holds the whole batch: this rank's rows (`distributed.share`),
    their loss mask (zero on a stand-in row) and the divisor of their summed loss, then the rows of
    each of `per_row`. The token-summed loss over these rows ÷ that divisor, averaged over the ranks
    by DDP, is the global batch's token mean."""
    count = distributed.sum_divisor(float(mask.sum()))
    mine, real = distributed.share(len(tokens))
    loss_mask = mask[mine] if real else torch.zeros_like(mask[mine])
    return (Prompts(prompts.ids[mine], prompts.mask[mine]), tokens[mine], mask[mine], loss_mask, count,
            *(values[mine] for values in per_row))


def clip_and_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to max_norm; returns the norm before clipping."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def grpo_update(model, optimizer, rollout: Rollout, *, clip_eps: float, ppo_epochs: int, std_eps: float,
                skip_uniform_groups: bool, grad_clip: float, temperature: float = 1.0) -> dict:
    """One GRPO batch: `ppo_epochs` optimizer steps on the clipped surrogate. Returns step stats.
    If every group is skipped, no optimizer step is taken (the step still counts)."""
    advantages, kept = group_advantages(rollout.rewards, std_eps)
    if not skip_uniform_groups:
        kept = torch.ones_like(kept)
    groups, size = rollout.rewards.shape
    stats = {"reward_mean": float(rollout.rewards.float().mean()),
             "frac_groups_skipped": float(1 - kept.float().mean()), "grad_norm": 0.0, "loss": 0.0}
    if not kept.any():
        return stats
    rows = kept.repeat_interleave(size)  # completion rows of the kept groups
    prompts = Prompts(rollout.prompts.ids[rows], rollout.prompts.mask[rows])
    tokens, mask = rollout.tokens[rows], rollout.mask[rows]
    width = int(mask.sum(1).max())  # drop the all-padding tail columns: they carry no loss
    tokens, mask = tokens[:, :width], mask[:, :width]
    adv = advantages.reshape(-1)[rows].to(next(model.parameters()).dtype)
    loss_mask, count, replica = mask, None, distributed.is_replica(model)
    if replica:  # data-parallel: this rank's completions of the (shared) rollout
        prompts, tokens, mask, loss_mask, count, adv = rank_share(prompts, tokens, mask, adv)
    old_logp = None
    for epoch in range(ppo_epochs):
        loss, norm, old_logp = surrogate_step(model, optimizer, prompts, tokens, mask, adv, loss_mask, count,
                                              old_logp, clip_eps, grad_clip, temperature)
        if epoch == 0:
            stats["grad_norm"], stats["loss"] = float(norm), distributed.mean(loss.item()) if replica else loss.item()
    return stats


def surrogate_step(model, optimizer, prompts: Prompts, tokens: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                   loss_mask: torch.Tensor, count: float | None, old_logp: torch.Tensor | None, clip_eps: float,
                   grad_clip: float, temperature: float):
    """One optimizer step on the clipped surrogate: (loss, gradient norm before clipping, π_old's log-probs —
    these log-probs, detached, when `old_logp` is None), all tensors on the device."""
    optimizer.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, prompts, tokens, mask, temperature)
    if old_logp is None:
        old_logp = logp.detach()  # π_old: the policy that sampled the batch
    loss = clipped_surrogate(logp, old_logp, adv, loss_mask, clip_eps, count)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach(), norm, old_logp


def sft_update(model, optimizer, prompts: Prompts, tokens: torch.Tensor, mask: torch.Tensor,
               grad_clip: float) -> dict:
    """One cross-entropy step on gold completions (token mean over completion tokens only)."""
    optimizer.zero_grad(set_to_none=True)
    loss_mask, count, replica = mask, None, distributed.is_replica(model)
    if replica:  # data-parallel: this rank's rows of the batch
        prompts, tokens, mask, loss_mask, count = rank_share(prompts, tokens, mask)
    logp = completion_logprobs(model, prompts, tokens, mask)
    loss = -(logp * loss_mask).sum() / (mask.sum() if count is None else count)
    loss.backward()
    norm = clip_and_norm(model, grad_clip)
    optimizer.step()
    return {"sft_loss": distributed.mean(loss.item()) if replica else loss.item(), "grad_norm": norm}
