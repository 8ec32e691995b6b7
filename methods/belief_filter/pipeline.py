"""The belief-filter lifecycle: train learns the E4 policies (the only learned part);
eval runs E1–E3 and evaluates the trained E4 policies on fresh episodes."""
from __future__ import annotations

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext


def e4_seeds(ctx: RunContext) -> list[int]:
    return [ctx.seed + i for i in range(ctx.config.seeds)]


def policy_checkpoint(ctx: RunContext, arm: str, seed: int):
    return ctx.checkpoints / f"policy_{arm}_seed{seed}.pt"


def train(ctx: RunContext) -> None:
    from icml.cli.threads import single_thread
    from icml.methods.belief_filter.ppo import train_arm

    cfg = ctx.config
    recorded = ctx.metrics()
    finished = set(zip(recorded["variant"], recorded["seed"]))  # curves already in metrics.parquet
    jobs = [(arm, seed) for seed in e4_seeds(ctx) for arm in cfg.arms]
    with ctx.progress("E4 PPO (env steps)", len(jobs) * cfg.ppo.total_steps) as advance, single_thread():
        for arm, seed in jobs:  # small recurrent nets: one thread is fastest
            if (arm, seed) in finished:
                advance(cfg.ppo.total_steps)
                continue
            rows = train_arm(cfg, arm, seed, policy_checkpoint(ctx, arm, seed), device=ctx.device,
                             progress=advance)
            ctx.record(rows, split="train")
            if rows:
                ctx.log(f"  {arm} seed {seed}: last episode_return {rows[-1]['value']:.3f}")


def load_user_hmm(ctx: RunContext):
    if ctx.config.hmm.path is None:
        return None
    from icml.methods.belief_filter.hmm import load_hmm_json

    try:
        return load_hmm_json(ctx.config.hmm.path)
    except ValueError as exc:
        raise IcmlError(str(exc), "fix the file, or drop --set hmm.path to use the built-in HMMs") from None


def evaluate(ctx: RunContext) -> None:
    from icml.cli.threads import single_thread
    from icml.methods.belief_filter.experiments import experiments_for, run_e1, run_e2, run_e3
    from icml.methods.belief_filter.ppo import evaluate_arm

    cfg = ctx.config
    hmm = load_user_hmm(ctx)
    applicable = experiments_for(hmm)
    if hmm is not None:
        ctx.log(f"user HMM {cfg.hmm.path}: runs {', '.join(applicable)}")
    ctx.record(run_e1(cfg.e1, ctx.seed, hmm=hmm))
    if "e2" in applicable:
        with ctx.progress("E2 two-state protocol (steps)", cfg.e2.horizon) as advance:
            ctx.record(run_e2(cfg.e2, ctx.seed, hmm=hmm, progress=_stepper(advance)))
    if "e3" in applicable:
        with ctx.progress("E3 action-controlled (steps)", cfg.e3.horizon) as advance:
            ctx.record(run_e3(cfg.e3, ctx.seed, hmm=hmm, progress=_stepper(advance)))
    jobs = [(arm, seed) for seed in e4_seeds(ctx) for arm in cfg.arms]
    with ctx.progress("E4 evaluation (policies)", len(jobs)) as advance, single_thread():
        for arm, seed in jobs:
            path = policy_checkpoint(ctx, arm, seed)
            if not path.exists():
                raise IcmlError(f"checkpoint {path} is missing",
                                f"re-train the run: icml belief-filter train --resume {ctx.run.path}")
            ctx.record(evaluate_arm(cfg, arm, seed, path, device=ctx.device))
            advance(1)


def _stepper(advance):
    """Adapt the experiments' progress(done, total) callback to a bar's advance(n)."""
    last = [0]

    def progress(done: int, total: int) -> None:
        advance(done - last[0])
        last[0] = done

    return progress
