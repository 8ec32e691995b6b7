"""train: every arm from the same init seed and data order, with the spec's optimiser and schedule;
eval: nats/byte per Jacobi J and exact, the Jacobi residual/error per iteration, the exact-vs-cached
check, FLOPs and throughput."""
from __future__ import annotations

import math
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from icml.cli import distributed
from icml.cli.errors import UsageError
from icml.cli.threads import intra_op_threads
from icml.methods.latent_thought.data import check_sizes, load_corpus, target_bytes, train_windows, val_windows
from icml.methods.latent_thought.model import (ArmSpec, ThoughtLM, arm_spec, build_arm, flops_per_token, load_arm,
                                               save_arm)

EVAL_CHUNK = 16  # validation windows per forward


def uses_scaling(cfg) -> bool:
    return {"true": True, "false": False}.get(cfg.scale_embeds, cfg.model is None)


def spec_of(name: str, cfg) -> ArmSpec:
    return arm_spec(name, cfg.K, cfg.baseline_k, uses_scaling(cfg))


def load_tokenizer(cfg):
    if cfg.model is None:
        return None
    from transformers import AutoTokenizer

    from icml.cli import checkpoints

    ckpt = checkpoints.resolve(cfg.model)
    return AutoTokenizer.from_pretrained(*ckpt.args(), **ckpt.kwargs())


def corpus_for(cfg):
    try:
        corpus = load_corpus(cfg.data, load_tokenizer(cfg))
        check_sizes(corpus, cfg.seq_len, cfg.n_val)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return corpus


def lr_at(step: int, cfg) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine from lr to min_lr_frac·lr."""
    warmup = max(1, int(round(cfg.warmup_frac * cfg.steps)))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and embeddings), none on norm gains."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))


@torch.no_grad()
def nats_per_byte(model: ThoughtLM, windows: torch.Tensor, J: int, tokenizer=None) -> float:
    ce = 0.0
    for chunk in windows.split(EVAL_CHUNK):
        logits = model(chunk[:, :-1], J)
        ce += float(F.cross_entropy(logits.flatten(0, 1).double(), chunk[:, 1:].flatten(), reduction="sum"))
    return ce / target_bytes(windows.cpu().numpy(), tokenizer)


def tags(spec: ArmSpec, cfg, J=None, solve=None, iteration=None) -> dict:
    return {"K": spec.K, "J": J, "solve": solve, "iter": iteration, "seq_len": cfg.seq_len}


def train(ctx) -> None:
    cfg = ctx.config
    with intra_op_threads(cfg.train_threads):
        corpus = corpus_for(cfg)
        ctx.run.update(corpus=corpus.info)
        curve_windows = torch.from_numpy(val_windows(corpus.val, cfg.seq_len, cfg.val_windows_train))
        finished = [name for name in cfg.arms if (ctx.checkpoints / name / "config.json").exists()]
        finished = distributed.from_main(finished)  # under torchrun: what rank 0's run directory holds
        for name in cfg.arms:
            if name in finished:  # --resume: this arm finished before the interruption
                ctx.log(f"{name}: checkpoint exists, skipped")
                continue
            if ctx.resumed:  # an arm stopped mid-training starts over: its rows so far go with it
                ctx.forget(variant=name)
            with distributed.ranks_stop_together():  # torchrun: a rank that fails stops all with its line
                train_arm(ctx, name, corpus, curve_windows, ctx.checkpoints / name)


def train_step(model: ThoughtLM, replicas, optimizer, batch: torch.Tensor, J: int, lr: float,
               clip: float) -> torch.Tensor:
    """One optimizer step on this process's windows [B, T+1] (`replicas`: the model or its DDP wrapper);
    also the step `icml latent-thought plan` sizes."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = replicas(batch[:, :-1], J)
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())  # the B·T real targets only
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


def train_arm(ctx, name: str, corpus, curve_windows: torch.Tensor, directory) -> None:
    cfg = ctx.config
    spec = spec_of(name, cfg)
    model = build_arm(spec, cfg.tiny, ctx.seed, cfg.thought_scale, cfg.model).to(ctx.device).train()
    optimizer = optimizer_for(model, cfg)
    replicas = distributed.wrap(model)  # DistributedDataParallel under torchrun; the model itself otherwise
    data_rng = np.random.default_rng(ctx.seed)  # same windows in the same order for every arm
    j_rng = random.Random(ctx.seed)  # same J draws for every PonderLM-2 arm
    curve_windows = curve_windows.to(ctx.device)
    eval_J = cfg.eval_J
    solve = "jacobi" if spec.kind == "ponderlm2" else "exact"
    seconds = 0.0
    with ctx.progress(f"train {name}", cfg.steps) as advance:
        for step in range(cfg.steps):
            windows = train_windows(corpus.train, cfg.seq_len, cfg.batch, data_rng)  # every rank draws the global batch
            batch = distributed.shard(torch.from_numpy(windows)).to(ctx.device)  # and trains on its equal slice
            J = j_rng.choice(cfg.train_J)
            started = time.perf_counter()
            loss = train_step(model, replicas, optimizer, batch, J, lr_at(step, cfg), cfg.clip)
            seconds += time.perf_counter() - started
            loss_value = distributed.mean(loss.item())  # the global batch's: every rank stops alike
            if not math.isfinite(loss_value):
                raise UsageError(f"{name}: the training loss diverged at step {step}", "lower lr (--set lr=…)")
            done = step + 1
            rows = []
            if done % cfg.train_log_every == 0 or done == cfg.steps:
                rows.append({"variant": name, "metric": "train_loss", "value": loss_value, "step": done,
                             **tags(spec, cfg, J if solve == "jacobi" else None, solve)})
            if done % cfg.val_every == 0 or done == cfg.steps:
                model.eval()
                value = nats_per_byte(model, curve_windows, eval_J, corpus.tokenizer)
                model.train()
                rows.append({"variant": name, "metric": "val_nats_per_byte", "value": value, "step": done,
                             **tags(spec, cfg, eval_J if solve == "jacobi" else None, solve)})
            if rows:
                ctx.record(rows, split="val")
            advance(1)
    tokens = cfg.steps * cfg.batch * cfg.seq_len
    ctx.record([{"variant": name, "metric": "wall_s", "value": seconds, "step": cfg.steps, **tags(spec, cfg)},
                {"variant": name, "metric": "train_tokens_per_s", "value": tokens / seconds, "step": cfg.steps,
                 **tags(spec, cfg)}], split="train")
    if distributed.is_main():  # every rank holds the same weights; rank 0 writes them
        save_arm(model, directory, cfg.train_J)
    ctx.log(f"{name}: {cfg.steps} steps in {seconds:.1f} s, final train loss {loss_value:.4f}")


# --- eval -----------------------------------------------------------------------------------------
def evaluate(ctx) -> None:
    cfg = ctx.config
    with intra_op_threads(cfg.train_threads):
        corpus = corpus_for(cfg)
        windows = torch.from_numpy(val_windows(corpus.val, cfg.seq_len, cfg.n_val)).to(ctx.device)
        diffs = []
        for name in cfg.arms:
            directory = ctx.checkpoints / name
            if not (directory / "config.json").exists():
                raise UsageError(f"arm {name} has no checkpoint in {ctx.checkpoints}",
                                 f"finish training: icml latent-thought train --resume {ctx.run.path}")
            started = time.perf_counter()
            model = load_arm(directory, ctx.device)
            rows = evaluate_arm(model, cfg, windows, corpus.tokenizer, diffs)
            rows += throughput(model, cfg, corpus)
            rows.append({"metric": "wall_s", **tags(model.spec, cfg), "value": time.perf_counter() - started})
            ctx.record([{"variant": name, "step": cfg.steps, **row} for row in rows], split="val")
            ctx.log(f"{name}: evaluated in {time.perf_counter() - started:.1f} s")
        ctx.write_table("logit_diff", pd.DataFrame(diffs, columns=["variant", "J", "position", "max_abs_diff"]))


def evaluate_arm(model: ThoughtLM, cfg, windows: torch.Tensor, tokenizer, diffs: list) -> list[dict]:
    spec, K = model.spec, model.K
    rows = [{"metric": m, "value": v, **tags(spec, cfg)}
            for m, v in flops_per_token(model, cfg.seq_len, cfg.train_J).items()]

    def nats(metric_rows, value, J, solve):
        metric_rows += [{"metric": "val_nats_per_byte", "value": value, **tags(spec, cfg, J, solve)},
                        {"metric": "val_bits_per_byte", "value": value / math.log(2), **tags(spec, cfg, J, solve)}]

    with torch.no_grad():
        if spec.kind != "ponderlm2":
            nats(rows, nats_per_byte(model, windows, 0, tokenizer), None, "exact")
        else:
            J_max = max([*cfg.eval_Js, cfg.eval_J])
            ce = np.zeros(J_max + 1)
            ce_exact, n_bytes = 0.0, target_bytes(windows.cpu().numpy(), tokenizer)
            step_sq = np.zeros(J_max + 1)  # Σ‖z⁽ʲ⁾ − z⁽ʲ⁻¹⁾‖², Σ‖z⁽ʲ⁻¹⁾‖²
            prev_sq = np.zeros(J_max + 1)
            err_sq, star_sq = np.zeros(J_max + 1), 0.0
            for chunk in windows.split(EVAL_CHUNK):
                ids, targets = chunk[:, :-1], chunk[:, 1:].flatten()
                solve = model.jacobi(ids, J_max, all_iterations=True)
                exact_logits, z_star = model.sequential(ids)
                for j, logits in enumerate(solve.logits):
                    ce[j] += float(F.cross_entropy(logits.flatten(0, 1).double(), targets, reduction="sum"))
                ce_exact += float(F.cross_entropy(exact_logits.flatten(0, 1).double(), targets, reduction="sum"))
                z = [t.double() for t in solve.thoughts]
                z_star = z_star.double()
                star_sq += float(z_star.square().sum())
                for j in range(J_max + 1):
                    err_sq[j] += float((z[j] - z_star).square().sum())
                    if j:
                        step_sq[j] += float((z[j] - z[j - 1]).square().sum())
                        prev_sq[j] += float(z[j - 1].square().sum())
            for J in sorted(set([*cfg.eval_Js, cfg.eval_J])):
                nats(rows, ce[J] / n_bytes, J, "jacobi")
            nats(rows, ce_exact / n_bytes, None, "exact")
            rows.append({"metric": "jacobi_gap", "value": (ce[cfg.eval_J] - ce_exact) / n_bytes,
                         **tags(spec, cfg, cfg.eval_J, "jacobi")})
            for j in range(J_max + 1):
                rows.append({"metric": "jacobi_error", "value": err_sq[j] / star_sq, **tags(spec, cfg, None, "jacobi", j)})
                if j:
                    rows.append({"metric": "jacobi_residual", "value": step_sq[j] / prev_sq[j],
                                 **tags(spec, cfg, None, "jacobi", j)})
        if model.cached_decoding and cfg.n_exact:
            rows += exact_check(model, cfg, windows[: cfg.n_exact, :-1], diffs)
    return rows


def exact_check(model: ThoughtLM, cfg, ids: torch.Tensor, diffs: list) -> list[dict]:
    """Jacobi with J = K(T−1) against cached sequential decoding; |Δlogit| per position at J = 1, 2, 3."""
    K, T = model.K, ids.shape[1]
    cached, _ = model.sequential(ids)
    full_J = K * (T - 1)
    full = model.jacobi(ids, full_J).logits[-1]
    if K:
        for j, logits in enumerate(model.jacobi(ids, 3, all_iterations=True).logits[1:], start=1):
            per_position = (logits - cached).abs().amax(dim=(0, 2))
            diffs += [(model.spec.name, j, t + 1, float(v)) for t, v in enumerate(per_position)]
    return [{"metric": "exact_vs_cached_max_logit_diff", "value": float((full - cached).abs().max()),
             **tags(model.spec, cfg, full_J, "cached")}]


def prompt_ids(text: str, tokenizer=None) -> torch.Tensor:
    if tokenizer is None:
        return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def throughput(model: ThoughtLM, cfg, corpus) -> list[dict]:
    if not model.cached_decoding or cfg.gen_bytes == 0:
        return []
    ids = prompt_ids(cfg.gen_prompt, load_tokenizer(cfg)).to(next(model.parameters()).device)
    started = time.perf_counter()
    new, info = model.generate(ids, cfg.gen_bytes, prefill="jacobi", J=cfg.eval_J)
    seconds = time.perf_counter() - started
    spec = model.spec
    return [{"metric": "gen_tokens_per_s", "value": new.shape[1] / seconds, **tags(spec, cfg)},
            {"metric": "decoder_calls_per_token", "value": info["decoder_calls_per_token"], **tags(spec, cfg)}]
