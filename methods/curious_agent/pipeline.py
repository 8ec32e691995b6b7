"""The curious-agent lifecycle: train runs the perception warm-up once per seed, then every arm;
eval plays greedy episodes on env seeds disjoint from training."""
from __future__ import annotations

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext


def seeds(ctx: RunContext) -> list[int]:
    return [ctx.seed + i for i in range(ctx.config.seeds)]


def checkpoint(ctx: RunContext, arm: str, seed: int):
    folder = ctx.checkpoints / arm / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "agent.pt"


def train(ctx: RunContext) -> None:
    import pandas as pd
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.curious_agent.ppo import arm_spec, train_arm, warmup

    cfg = ctx.config
    jobs = [(arm, seed) for seed in seeds(ctx) for arm in cfg.arms]
    per_arm = cfg.ppo.total_steps // (cfg.ppo.n_envs * cfg.ppo.rollout) * cfg.ppo.n_envs * cfg.ppo.rollout
    visits = []
    with ctx.progress("arms (env steps)", len(jobs) * per_arm) as advance, single_thread():
        warm = {}
        for arm, seed in jobs:
            path = checkpoint(ctx, arm, seed)
            if path.exists():  # finished before an interruption: its rows are in metrics.parquet
                advance(per_arm)
                continue
            if arm_spec(arm, cfg).cot and seed not in warm:
                warm[seed] = warmup(cfg, seed)  # all LM arms of a seed start from these weights
            rows, state, visited = train_arm(cfg, arm, seed, warm.get(seed), progress=advance)
            ctx.record(rows, split="train")
            torch.save(state, path)
            visits += [{"variant": arm, "seed": seed, "x": x, "y": y, "dir": d, "count": c}
                       for (x, y, d), c in visited.items()]
            final = {r["metric"]: r["value"] for r in rows if r.get("experiment") == "final"}
            ctx.log(f"  {arm} seed {seed}: coverage {final['coverage']:.3f}, "
                    f"first success at {final['steps_to_first_success']:.0f} steps")
    if visits:
        ctx.write_table("visits", pd.DataFrame(visits))


def evaluate(ctx: RunContext) -> None:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.curious_agent.ppo import evaluate_arm

    cfg = ctx.config
    jobs = [(arm, seed) for seed in seeds(ctx) for arm in cfg.arms]
    with ctx.progress("greedy evaluation (arms)", len(jobs)) as advance, single_thread():
        for arm, seed in jobs:
            path = checkpoint(ctx, arm, seed)
            if not path.exists():
                raise IcmlError(f"checkpoint {path} is missing",
                                f"re-train the run: icml curious-agent train --resume {ctx.run.path}")
            try:
                state = torch.load(path, weights_only=True)
            except Exception as exc:  # a truncated or foreign file
                raise IcmlError(f"checkpoint {path} cannot be read ({type(exc).__name__})",
                                f"delete it and re-train: icml curious-agent train --resume {ctx.run.path}") from None
            ctx.record(evaluate_arm(cfg, arm, seed, state), split="eval")
            advance(1)
