"""One run of the grid: an optimizer arm at one LR, from θ₀, under GRPO (RL) or cross-entropy on
gold completions (the SFT control); plus the SFT warm start that makes θ₀, and greedy accuracy.

Every run reloads θ₀ from its checkpoint directory with `from_pretrained`, the path a user's
`--model` takes, so all arms start from identical weights. Rollout prompts and sampling noise
are seeded by (seed, step) alone: the same seed gives the same first batch to every arm.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from icml.cli import distributed
from icml.methods.rl_sgd import task as tasks
from icml.methods.rl_sgd.grpo import OPTIMIZER_OF, Rollout, build_optimizer, grpo_update, optimizer_state_bytes, \
    sft_update
from icml.methods.rl_sgd.model import decode_completions, encode_prompts, generate, load_policy, sft_batch

EVAL_CHUNK = 512  # held-out prompts per greedy batch


@dataclass
class Task:
    """The problems and reward of a run: generated, or a user file split into train / held-out."""

    held_out: list[tasks.Problem]
    train_pool: list[tasks.Problem] | None  # user data: RL prompts and SFT sets are drawn from it
    reward: Callable[[str, str, str], float]
    use_chat_template: bool
    digits: int = 3  # operand digits of the generated RL and held-out problems

    def rl_problems(self, seed: int, step: int, n: int) -> list[tasks.Problem]:
        if self.train_pool is None:
            return tasks.problems_of(seed, tasks.STREAM_RL, n, self.digits, index=step)
        rng = tasks.stream_rng(seed, tasks.STREAM_RL, step)
        return [rng.choice(self.train_pool) for _ in range(n)]


def make_task(cfg, seed: int) -> Task:
    if cfg.data is None:
        held = tasks.problems_of(seed, tasks.STREAM_EVAL, cfg.eval_problems, cfg.digits)
        return Task(held, None, tasks.load_reward(cfg.reward, user_data=False), cfg.use_chat_template, cfg.digits)
    train, held = tasks.split_user_data(tasks.load_jsonl(cfg.data), cfg.held_out_frac, cfg.eval_problems, seed)
    return Task(held, train, tasks.load_reward(cfg.reward, user_data=True), cfg.use_chat_template)


def run_tags(cfg, arm: str, lr: float) -> dict:
    return {"variant": arm, "optimizer": OPTIMIZER_OF[arm], "lr": float(lr),
            "regime": "sft" if arm.startswith("sft_") else "rl",
            "master_dtype": "bf16" if arm == "sgd_bf16_master" else "fp32", "group_size": cfg.group_size}


def run_dir(checkpoints: Path, arm: str, lr: float) -> Path:
    return checkpoints / f"{arm}_lr{lr:.3g}"


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[tasks.Problem], reward, max_new_tokens: int,
             use_chat_template: bool) -> float:
    """Mean reward of greedy completions (the exact-match rate under the default rewards)."""
    total = 0.0
    for start in range(0, len(problems), EVAL_CHUNK):
        chunk = problems[start:start + EVAL_CHUNK]
        prompts = encode_prompts(tokenizer, [p.prompt for p in chunk], use_chat_template)
        tokens, mask = generate(model, prompts, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                greedy=True)
        texts = decode_completions(tokenizer, tokens, mask, tokenizer.eos_token_id)
        total += sum(reward(p.prompt, c, p.answer) for p, c in zip(chunk, texts))
    return total / len(problems)


def rollout(model, tokenizer, problems: list[tasks.Problem], group_size: int, cfg, reward,
            generator: torch.Generator) -> Rollout:
    texts = [p.prompt for p in problems for _ in range(group_size)]
    prompts = encode_prompts(tokenizer, texts, cfg.use_chat_template)
    tokens, mask = generate(model, prompts, cfg.max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            temperature=cfg.temperature, generator=generator)
    completions = decode_completions(tokenizer, tokens, mask, tokenizer.eos_token_id)
    answers = [p for p in problems for _ in range(group_size)]
    rewards = torch.tensor([reward(p.prompt, c, p.answer) for p, c in zip(answers, completions)], dtype=torch.float64)
    return Rollout(prompts, tokens, mask, rewards.reshape(len(problems), group_size))


def sampling_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))


def train_run(cfg, seed: int, arm: str, lr: float, theta0: Path, out: Path) -> tuple[list[dict], dict]:
    """Train one (arm, LR) run from θ₀; save θ_T (fp32 and bf16) under `out`; return curve rows and
    a summary with the held-out accuracy used to pick each arm's best LR."""
    task = make_task(cfg, seed)
    model, tokenizer = load_policy(theta0)
    if arm == "sgd_bf16_master":
        model = model.to(torch.bfloat16)  # weights held and updated in bf16: small steps round away
    optimizer = build_optimizer(arm, model, lr)
    # under torchrun: DDP replicas (rank 0's weights); every rank samples the whole rollout alike and
    # the update trains on its share of it (grpo.rank_share)
    replicas = distributed.wrap(model)
    tags = run_tags(cfg, arm, lr)
    rows: list[dict] = []
    sft = arm.startswith("sft_")
    started = time.perf_counter()
    for step in range(cfg.steps):
        if sft:
            problems = task.rl_problems(seed, step, cfg.sft_batch)
            prompts, tokens, mask = sft_batch(tokenizer, [p.prompt for p in problems], [p.answer for p in problems],
                                              cfg.use_chat_template)
            stats = sft_update(replicas, optimizer, prompts, tokens, mask, cfg.grad_clip)
        else:
            problems = task.rl_problems(seed, step, cfg.prompts_per_step)
            batch = rollout(model, tokenizer, problems, cfg.group_size, cfg, task.reward,
                            sampling_generator(seed, step))
            stats = grpo_update(replicas, optimizer, batch, clip_eps=cfg.clip_eps, ppo_epochs=cfg.ppo_epochs,
                                std_eps=cfg.std_eps, skip_uniform_groups=cfg.skip_uniform_groups,
                                grad_clip=cfg.grad_clip, temperature=cfg.temperature)
        if not all(math.isfinite(v) for v in stats.values()):
            stats["diverged"] = 1.0
        if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1 or "diverged" in stats:
            rows += [{**tags, "metric": k, "value": v, "step": step + 1, "split": "train"} for k, v in stats.items()]
        if "diverged" in stats:
            break
    wall = time.perf_counter() - started
    state_bytes = optimizer_state_bytes(optimizer)
    params = {name: p.detach() for name, p in model.named_parameters()}
    if distributed.is_main():  # every rank holds the same weights; rank 0 writes them
        out.mkdir(parents=True, exist_ok=True)
        torch.save({n: p.clone() for n, p in params.items()}, out / "theta_master.pt")  # fp32 (bf16 in bf16 mode)
        torch.save({n: p.to(torch.bfloat16) for n, p in params.items()}, out / "theta_bf16.pt")
    # scored in fp32 like every snapshot in eval (a bf16-master run's bf16 weights, fp32 compute)
    acc = accuracy(model.float(), tokenizer, task.held_out, task.reward, cfg.max_new_tokens, cfg.use_chat_template)
    summary = {**tags, "accuracy": acc, "optimizer_state_bytes": state_bytes, "wall_time_s": wall,
               "n_params": sum(p.numel() for p in params.values()), "steps_done": step + 1}
    if distributed.is_main():
        (out / "run.json").write_text(json.dumps(summary, indent=1))
    rows += [{**tags, "metric": "accuracy", "value": acc, "step": step + 1, "split": "val"},
             {**tags, "metric": "optimizer_state_bytes", "value": float(state_bytes), "step": step + 1,
              "split": "train"},
             {**tags, "metric": "wall_time_s", "value": wall, "step": step + 1, "split": "train"}]
    return rows, summary


# the SFT warm start ---------------------------------------------------------------------------
def warm_start(model, tokenizer, train: list[tasks.Problem], band: list[tasks.Problem], reward, sft, seed: int,
               max_new_tokens: int, use_chat_template: bool, log=lambda message: None) -> list[dict]:
    """AdamW + cosine on cross-entropy of gold completions; stop when the held-out band-check accuracy
    first reaches the band's lower edge (checked every `check_every` steps), or at max_steps.
    Returns the log (step, sft_loss, band_accuracy)."""
    import random

    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, sft.max_steps) / sft.max_steps)))
    rng = random.Random(f"rl-sgd/{seed}/sft-batches")
    history = []
    for step in range(1, sft.max_steps + 1):
        problems = [rng.choice(train) for _ in range(sft.batch_size)]
        prompts, tokens, mask = sft_batch(tokenizer, [p.prompt for p in problems], [p.answer for p in problems],
                                          use_chat_template)
        loss = sft_update(model, optimizer, prompts, tokens, mask, grad_clip=1.0)["sft_loss"]
        schedule.step()
        if step % sft.check_every == 0 or step == sft.max_steps:
            acc = accuracy(model, tokenizer, band, reward, max_new_tokens, use_chat_template)
            history.append({"step": step, "sft_loss": loss, "band_accuracy": acc})
            log(f"  SFT step {step}: loss {loss:.3f}, band-check accuracy {acc:.3f}")
            if sft.band_check and acc >= sft.band[0]:
                break
    return history
