"""rl-sgd's identities: bf16 change counting at half and one ULP, the tolerance variant, effective
rank of a rank-r matrix, group advantages, skipped uniform groups, the clipped surrogate, SGD's
step with empty state and the optimizer-state bytes of every arm."""
from __future__ import annotations

import math

import pytest
import torch

from icml.methods.rl_sgd.grpo import (Rollout, build_optimizer, clipped_surrogate, group_advantages, grpo_update,
                                      optimizer_state_bytes)
from icml.methods.rl_sgd.model import Prompts, completion_logprobs, tiny_llama
from icml.methods.rl_sgd.updates import effective_rank, summarise, tensor_updates

EPS64 = torch.finfo(torch.float64).eps
ULP_AT_1 = 2.0 ** -7  # bf16 keeps 7 explicit mantissa bits: spacing 2^-7 on [1, 2)


# bf16 change counting -------------------------------------------------------------------------
def test_bf16_density_counts_crossings_of_half_an_ulp():
    one = torch.ones(6)
    # drift in ULPs: below half (rounds back), exactly half (tie → even mantissa of 1.0: unchanged),
    # just above half (rounds up), one ULP, 1.5 ULP (tie → even: 1 + 2 ULP), and a drift down
    drift = torch.tensor([0.49, 0.5, 0.51, 1.0, 1.5, -1.0]) * ULP_AT_1
    start, end = {"w": one}, {"w": one + drift}
    (record,) = tensor_updates(start, end, tol=0.0)
    changed = (end["w"].to(torch.bfloat16) != start["w"].to(torch.bfloat16)).tolist()
    assert changed == [False, False, True, True, True, True]
    assert record["changed_bf16"] == 4 and record["changed_fp32"] == 6
    assert record["density_bf16"] == pytest.approx(4 / 6, abs=0)
    assert end["w"].to(torch.bfloat16)[4].item() == 1 + 2 * ULP_AT_1  # the 1.5-ULP tie goes to the even neighbour


def test_tolerance_density_ignores_one_ulp_changes_of_small_weights():
    # near 1e-3 a bf16 ULP is 2^-10·2^-7 ≈ 7.6e-6 < 1e-5: one ULP counts in bf16 but not with tol 1e-5
    small = torch.full((4,), 2.0 ** -10)
    ulp = 2.0 ** -17
    end = small + torch.tensor([0.0, 1.0, 2.0, 3.0]) * ulp
    (record,) = tensor_updates({"w": small}, {"w": end}, tol=1e-5)
    assert record["changed_bf16"] == 3
    assert record["changed_tol"] == 2  # |Δ| = 2 ULP = 1.53e-5 and 3 ULP only
    assert record["changed_fp32"] == 3


def test_density_summary_weights_tensors_by_size_and_matrices_apart():
    start = {"a.weight": torch.zeros(4, 5), "norm.weight": torch.ones(10)}
    end = {"a.weight": torch.zeros(4, 5), "norm.weight": torch.ones(10) + 0.1}
    end["a.weight"][0, :2] = 1.0
    summary = summarise(tensor_updates(start, end, tol=1e-5))
    assert summary["update_density_bf16"] == pytest.approx(12 / 30, abs=0)
    assert summary["update_density_bf16_matrices"] == pytest.approx(2 / 20, abs=0)
    assert summary["effective_rank_99"] == pytest.approx(1 / 4, abs=0)  # a rank-1 delta of a 4×5 weight


# effective rank -------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [1, 3, 7])
def test_effective_rank_of_a_rank_r_matrix_with_equal_singular_values(rank):
    generator = torch.Generator().manual_seed(rank)
    u, _ = torch.linalg.qr(torch.randn(40, rank, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, rank, generator=generator, dtype=torch.float64))
    delta = u @ v.T  # σ = 1 (r times), then 0: the energy fraction is k/r, ≥ 0.99 first at k = r
    assert effective_rank(delta) == rank
    assert effective_rank(delta.float()) == rank


def test_effective_rank_closed_form_and_zero():
    # σ² = 0.9, 0.08, 0.015, 0.005: cumulative 0.9, 0.98, 0.995 → r₉₉ = 3, r₉₀ = 1, r₁₀₀ = 4
    sigma = torch.tensor([0.9, 0.08, 0.015, 0.005], dtype=torch.float64).sqrt()
    q1, _ = torch.linalg.qr(torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    q2, _ = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    delta = q1 @ torch.diag(sigma) @ q2.T
    assert effective_rank(delta, 0.99) == 3
    assert effective_rank(delta, 0.89) == 1
    assert effective_rank(delta, 1.0 - 1e-9) == 4
    assert effective_rank(torch.zeros(5, 3)) == 0


def test_effective_rank_defaults_to_the_fp32_delta_and_reports_the_bf16_one_beside_it():
    # a rank-1 ΔW of 1e-3-sized steps on O(1) weights: bf16 rounds it entry by entry (ULP 2^-7 on [1, 2)),
    # so the snapshots' ΔW is a full-rank rounding pattern while the masters' ΔW is exactly rank 1
    generator = torch.Generator().manual_seed(0)
    start = 1 + torch.rand(32, 24, generator=generator)
    u, v = torch.randn(32, 1, generator=generator), torch.randn(1, 24, generator=generator)
    end = start + 1e-3 * u @ v
    (record,) = tensor_updates({"w": start}, {"w": end}, tol=0.0)
    assert record["effective_rank_99"] == record["effective_rank_99_fp32"] == 1
    assert record["effective_rank_99_bf16"] > 10
    summary = summarise([record])
    assert summary["effective_rank_99"] == pytest.approx(1 / 24, abs=0)
    assert summary["effective_rank_99_bf16"] == pytest.approx(record["effective_rank_99_bf16"] / 24, abs=0)
    (bf16_lens,) = tensor_updates({"w": start}, {"w": end}, tol=0.0, rank_source="bf16")
    assert bf16_lens["effective_rank_99"] == record["effective_rank_99_bf16"]


def test_a_bf16_master_run_is_measured_from_bf16_theta0():
    # the run held bf16(θ₀) and changed one row: its master ΔW is rank 1; against the fp32 θ₀ the cast's
    # rounding of every entry would make it full rank, and it alone makes the fp32 density ≈ 1
    start = 1 + torch.rand(16, 12, generator=torch.Generator().manual_seed(1))
    end = start.to(torch.bfloat16)
    end[3] += 0.5
    (record,) = tensor_updates({"w": start}, {"w": end}, tol=0.0, rank_source="fp32")
    assert record["effective_rank_99"] == record["effective_rank_99_bf16"] == 1
    assert record["changed_bf16"] == 12
    assert record["changed_fp32"] == int((start.to(torch.bfloat16).float() != start).sum()) > 0.95 * 16 * 12


# advantages and the surrogate -----------------------------------------------------------------
def test_group_advantages_population_std_with_epsilon():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    advantages, kept = group_advantages(rewards, 1e-4)
    std = math.sqrt(0.25 * 0.75)  # population std of one success in four
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) / (std + 1e-4)
    torch.testing.assert_close(advantages[0], expected, rtol=4 * EPS64, atol=0)  # a few roundings of O(1) values
    assert kept.tolist() == [True, False, False]
    assert (advantages[1:] == 0).all()  # uniform groups: zero advantage, not 0/0
    assert advantages[0].sum().abs() < 8 * EPS64  # centred within the group


def test_clipped_surrogate_is_the_token_mean_and_clips_one_sided():
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss = clipped_surrogate(logp, logp.detach(), adv, mask, 0.2)
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3, abs=4 * EPS64)  # ρ ≡ 1: −Σ A_i|o_i| / Σ|o_i|
    loss.backward()
    expected = -(adv[:, None] * mask) / 3  # ∇ of −(1/N) Σ A_i log π at ρ = 1
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=EPS64)
    # ρ = 1.5 with A > 0 and ρ = 0.5 with A < 0 are clipped: no gradient; inside the band there is
    old = torch.log(torch.tensor([[1 / 1.5, 1 / 1.1, 1.0], [1 / 0.5, 1.0, 1.0]], dtype=torch.float64))
    logp.grad = None
    clipped_surrogate(logp, old, adv, mask, 0.2).backward()
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] == 0
    assert logp.grad[0, 1].item() == pytest.approx(-2 * 1.1 / 3, rel=8 * EPS64)


class _Float64RMSNorm(torch.nn.Module):
    """HF's LlamaRMSNorm computes in float32 whatever the input dtype, which would round the
    float64 reference gradients to float32; this keeps the same function in the input's dtype."""

    def forward(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _tiny_policy(dtype=torch.float64):
    specials = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = tiny_llama(16, 16, 1, 2, 1, 32, 32, specials, init_seed=0).to(dtype)
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = _Float64RMSNorm.forward.__get__(module)
    return model


def _rollout(rewards: list[list[float]]) -> Rollout:
    groups, size = len(rewards), len(rewards[0])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 16, (groups * size, 5), generator=generator)
    tokens = torch.randint(3, 16, (groups * size, 4), generator=generator)
    mask = torch.ones_like(tokens)
    mask[::3, 2:] = 0  # completions of different lengths
    return Rollout(Prompts(ids, torch.ones_like(ids)), tokens, mask, torch.tensor(rewards, dtype=torch.float64))


def _update(model, rollout, arm="sgd", lr=0.1, skip=True, grad_clip=1e9):
    optimizer = build_optimizer(arm, model, lr)
    stats = grpo_update(model, optimizer, rollout, clip_eps=0.2, ppo_epochs=1, std_eps=1e-4,
                        skip_uniform_groups=skip, grad_clip=grad_clip)
    return stats, optimizer


def test_uniform_groups_give_zero_gradient_and_leave_the_denominator():
    mixed = [[1.0, 0.0, 0.0, 1.0]]
    uniform = [[1.0, 1.0, 1.0, 1.0]]
    both = _rollout(mixed + uniform)
    alone = Rollout(Prompts(both.prompts.ids[:4], both.prompts.mask[:4]), both.tokens[:4], both.mask[:4],
                    both.rewards[:1])
    model_a, model_b, model_c = _tiny_policy(), _tiny_policy(), _tiny_policy()
    stats, _ = _update(model_a, both)
    _update(model_b, alone)
    assert stats["frac_groups_skipped"] == 0.5
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)  # the skipped group changes nothing
    # without skipping, the uniform group's tokens still carry zero gradient but dilute the mean:
    # the step is the skipped one scaled by (kept tokens)/(all tokens)
    _update(model_c, both, skip=False)
    kept_tokens, all_tokens = both.mask[:4].sum().item(), both.mask.sum().item()
    start = _tiny_policy()
    for p0, pa, pc in zip(start.parameters(), model_a.parameters(), model_c.parameters()):
        # θ − p0 of O(0.1) entries: a few float64 roundings of values ≤ O(1) each side
        torch.testing.assert_close(pc - p0, (pa - p0) * kept_tokens / all_tokens, rtol=0, atol=16 * EPS64)


def test_all_uniform_batch_makes_no_update_but_counts():
    model = _tiny_policy()
    start = [p.detach().clone() for p in model.parameters()]
    stats, optimizer = _update(model, _rollout([[0.0] * 4, [1.0] * 4]), arm="adamw", lr=1e-2)
    assert stats == {"reward_mean": 0.5, "frac_groups_skipped": 1.0, "grad_norm": 0.0, "loss": 0.0}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))
    assert optimizer_state_bytes(optimizer) == 0  # no step: AdamW never initialised its moments


def test_sgd_step_is_theta_minus_lr_times_the_policy_gradient():
    rollout = _rollout([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    model = _tiny_policy()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the reference gradient: autograd of the token-averaged policy gradient −(1/N) Σ_i A_i Σ_t log π
    reference = _tiny_policy()
    advantages, _ = group_advantages(rollout.rewards, 1e-4)
    logp = completion_logprobs(reference, rollout.prompts, rollout.tokens, rollout.mask)
    (-(advantages.reshape(-1, 1) * logp).sum() / rollout.mask.sum()).backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    stats, optimizer = _update(model, rollout, lr=0.05)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e3 * EPS64)  # ~1e3 summed float64 products
    for name, p in model.named_parameters():
        # one rounding of θ − lr·g per entry, plus the gradient's own float64 summation error
        torch.testing.assert_close(p, start[name] - 0.05 * grads[name], rtol=0, atol=1e3 * EPS64)
    assert all(not state or state == {"momentum_buffer": None} for state in optimizer.state.values())
    assert optimizer_state_bytes(optimizer) == 0


def test_gradient_clipping_bounds_the_sgd_step():
    rollout = _rollout([[1.0, 0.0, 0.0, 1.0]])
    free, clipped = _tiny_policy(), _tiny_policy()
    stats, _ = _update(free, rollout, lr=1.0)
    max_norm = stats["grad_norm"] / 4
    _update(clipped, rollout, lr=1.0, grad_clip=max_norm)
    scale = max_norm / (stats["grad_norm"] + 1e-6)  # torch's clip coefficient (its 1e-6 guards a zero norm)
    start = _tiny_policy()
    for p0, pf, pc in zip(start.parameters(), free.parameters(), clipped.parameters()):
        # Δ = −lr·g is O(0.1); both sides carry a few float64 roundings of the subtraction from θ₀ ~ O(1)
        torch.testing.assert_close(pc - p0, (pf - p0) * scale, rtol=0, atol=16 * EPS64)


@pytest.mark.parametrize("arm,bytes_per_param", [("sgd", 0), ("sgd_bf16_master", 0), ("sgd_momentum", 4),
                                                 ("rmsprop", 4), ("adamw", 8), ("adam_nomomentum", 8)])
def test_optimizer_state_bytes_per_parameter(arm, bytes_per_param):
    model = _tiny_policy(torch.float32)
    optimizer = build_optimizer(arm, model, 1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    step_counters = 4 * n_tensors if arm in ("rmsprop", "adamw", "adam_nomomentum") else 0  # a float32 `step` each
    assert optimizer_state_bytes(optimizer) == bytes_per_param * n_params + step_counters
