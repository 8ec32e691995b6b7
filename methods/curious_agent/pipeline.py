"""The curious-agent lifecycle: train runs the perception warm-up once per (environment, seed), then
every (arm, seed) job of the main experiment and of the zero-extrinsic-reward coverage experiment,
in `workers` processes; eval plays greedy episodes on env seeds disjoint from training."""
from __future__ import annotations

import copy

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext


def seeds(ctx: RunContext) -> list[int]:
    return [ctx.seed + i for i in range(ctx.config.seeds)]


def experiments(cfg) -> list[tuple[str, object]]:
    """(name, config) of each experiment: the main one, and `coverage` (its own environment, no
    task reward, its own arms and step budget) when coverage.env_id is set."""
    out = [("main", cfg)]
    if cfg.coverage.env_id:
        sub = copy.deepcopy(cfg)
        sub.env.id, sub.reward_mode = cfg.coverage.env_id, "intrinsic_only"
        sub.ppo.total_steps, sub.arms = cfg.coverage.total_steps, list(cfg.coverage.arms)
        sub.env.max_steps = 0  # FourRooms' own limit (100 steps)
        sub.coverage.env_id = ""
        out.append(("coverage", sub))
    return out


def checkpoint(ctx: RunContext, experiment: str, arm: str, seed: int):
    folder = ctx.checkpoints / ("" if experiment == "main" else experiment) / arm / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "agent.pt"


# `device` (the run's --device) places a --model VLM agent; the tiny agent always runs on the CPU
def warmup_job(cfg, seed: int, device: str = "cpu"):
    from icml.cli.threads import single_thread
    from icml.methods.curious_agent.ppo import warmup

    with single_thread():
        return warmup(cfg, seed, device)


def train_job(cfg, arm: str, seed: int, warm: dict | None, device: str = "cpu"):
    from icml.cli.threads import single_thread
    from icml.methods.curious_agent.ppo import train_arm

    with single_thread():
        return train_arm(cfg, arm, seed, warm, device=device)


def eval_job(cfg, arm: str, seed: int, state: dict, device: str = "cpu"):
    from icml.cli.threads import single_thread
    from icml.methods.curious_agent.ppo import evaluate_arm

    with single_thread():
        return evaluate_arm(cfg, arm, seed, state, device)


def train(ctx: RunContext) -> None:
    import pandas as pd
    import torch

    from icml.cli.workers import run_in_workers
    from icml.methods.curious_agent.ppo import arm_spec

    cfg = ctx.config
    pending = [(name, sub, arm, seed) for name, sub in experiments(cfg) for seed in seeds(ctx) for arm in sub.arms
               if not checkpoint(ctx, name, arm, seed).exists()]  # finished ones: their rows are recorded
    warm = {}
    needed = sorted({(name, seed) for name, sub, arm, seed in pending if arm_spec(arm, sub).cot})
    subs = dict(experiments(cfg))
    with ctx.progress("perception warm-up (env, seed)", len(needed)) as advance:
        def warmed(key, state):
            warm[key] = state  # all LM arms of an (environment, seed) start from these weights
            advance(1)

        run_in_workers(cfg.workers, [(key, warmup_job, (subs[key[0]], key[1], ctx.device)) for key in needed], warmed)
    jobs = [((name, arm, seed), train_job, (sub, arm, seed, warm.get((name, seed)), ctx.device))
            for name, sub, arm, seed in pending]
    visits = []
    with ctx.progress(f"train ({len(jobs)} arm x seed jobs, {cfg.workers} workers)", len(jobs)) as advance:
        def done(key, result):
            name, arm, seed = key
            rows, state, visited = result
            ctx.record(rows, split="train")
            torch.save(state, checkpoint(ctx, name, arm, seed))
            env_id = subs[name].env.id
            visits.extend({"variant": arm, "seed": seed, "env_id": env_id, "x": x, "y": y, "dir": d, "count": c}
                          for (x, y, d), c in visited.items())
            final = {r["metric"]: r["value"] for r in rows if r.get("experiment") == "final"}
            ctx.log(f"  {env_id} {arm} seed {seed}: coverage {final['coverage']:.3f}, "
                    f"first success at {final['steps_to_first_success']:.0f} steps")
            advance(1)

        run_in_workers(cfg.workers, jobs, done)
    if visits:
        old, frame = ctx.run.table("visits"), pd.DataFrame(visits)
        if old is not None and not old.empty and "env_id" in old:  # a resumed run keeps the earlier jobs' visits
            frame = pd.concat([old, frame], ignore_index=True)
        ctx.write_table("visits", frame)


def evaluate(ctx: RunContext) -> None:
    """Greedy evaluation of the main experiment's arms (the coverage experiment is measured in training)."""
    import torch

    from icml.cli.workers import run_in_workers

    cfg = ctx.config
    jobs = []
    for seed in seeds(ctx):
        for arm in cfg.arms:
            path = checkpoint(ctx, "main", arm, seed)
            if not path.exists():
                raise IcmlError(f"checkpoint {path} is missing",
                                f"re-train the run: icml curious-agent train --resume {ctx.run.path}")
            try:
                state = torch.load(path, weights_only=True)
            except Exception as exc:  # a truncated or foreign file
                raise IcmlError(f"checkpoint {path} cannot be read ({type(exc).__name__})",
                                f"delete it and re-train: icml curious-agent train --resume {ctx.run.path}") from None
            jobs.append(((arm, seed), eval_job, (cfg, arm, seed, state, ctx.device)))
    with ctx.progress(f"greedy evaluation ({len(jobs)} arm x seed jobs)", len(jobs)) as advance:
        def done(key, rows):
            ctx.record(rows, split="eval")
            advance(1)

        run_in_workers(cfg.workers, jobs, done)
