import os
import time

import torch

from icml.cli.runstore import load_checkpoint


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 3, generator=gen, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(64, generator=gen,
                                                                                     dtype=torch.float64)
    return X, y


def _model_and_optimizer(variant: str, lr: float):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    momentum = 0.9 if variant == "momentum" else 0.0
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def train(ctx):
    cfg = ctx.config
    X, y = _problem(ctx.seed)
    recorded = ctx.metrics()
    with ctx.progress("toy", cfg.steps * len(cfg.variants)) as advance:
        for variant in cfg.variants:
            path = ctx.checkpoints / f"{variant}.pt"
            model, optimizer = _model_and_optimizer(variant, cfg.lr)
            generator = torch.Generator().manual_seed(ctx.seed)
            step = 0
            if path.exists():
                state = load_checkpoint(path)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                generator.set_state(state["rng"])
                step = state["step"]
            done = set(recorded.loc[recorded["variant"] == variant, "step"])
            rows = []
            while step < cfg.steps:
                batch = torch.randint(0, 64, (16,), generator=generator)
                loss = ((model(X[batch]).squeeze(-1) - y[batch]) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step not in done:
                    rows.append({"variant": variant, "metric": "loss", "value": loss.item(), "step": step,
                                 "lr": cfg.lr})
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    ctx.record(rows, split="train")
                    rows = []
                    tmp = path.with_suffix(".tmp")
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "rng": generator.get_state(), "step": step}, tmp)
                    os.replace(tmp, path)
                advance(1)
                time.sleep(cfg.sleep)


def evaluate(ctx):
    import pandas as pd

    X, y = _problem(ctx.seed + 1)
    predictions = []
    for variant in ctx.config.variants:
        model, _ = _model_and_optimizer(variant, ctx.config.lr)
        model.load_state_dict(load_checkpoint(ctx.checkpoints / f"{variant}.pt")["model"])
        with torch.no_grad():
            predicted = model(X).squeeze(-1)
        mse = ((predicted - y) ** 2).mean().item()
        ctx.record([{"variant": variant, "metric": "mse", "value": mse, "lr": ctx.config.lr}])
        predictions.append(pd.DataFrame({"variant": variant, "target": y.numpy(), "predicted": predicted.numpy()}))
    ctx.write_table("predictions", pd.concat(predictions, ignore_index=True))  # an extra declared table
