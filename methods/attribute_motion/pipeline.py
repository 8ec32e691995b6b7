"""The attribute-motion lifecycle.

train:  render (or load) the clip sets → pretrain the base video model (or load --model) → train the
        motion classifier and appearance net → save base (save_pretrained), evaluators, clips.
select: featurize pool + queries for a selector (cached projected gradients) → influence →
        aggregate → scores.parquet rows and a selection list (also the `select` verb).
eval:   every selector on every target (retrieval metrics) → one fine-tuned copy of the base per
        arm, equal budget → shared-seed generation → VBench-style metrics and win rate vs base.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext

# motive's features scored again: another aggregation or another per-clip Z(x) (no gradient pass of their own)
MOTIVE_RESCORED = ("mean_agg", "motive_frames", "no_length_norm")
GRADIENT_GROUPS = {"motive": "motive", "motive_dense": "motive", **{v: "motive" for v in MOTIVE_RESCORED},
                   "no_mask": "no_mask", "indep_noise": "indep_noise", "multi_draw": "multi_draw"}
SEEDLESS = ("flow_magnitude", "appearance_match", "full")
# Scored at the first attribution seed only: the dense projection and the unmasked gradients are a full
# gradient pass each; seed stability is measured on motive, indep_noise, multi_draw (and motive's cheap kin).
FIRST_SEED_ONLY = SEEDLESS + ("motive_dense", "no_mask")
LENGTH_NORMS = {"no_length_norm": "none", "motive_frames": "frames"}  # else attr.length_norm


# run files ---------------------------------------------------------------------------------------
def base_dir(run_path: Path) -> Path:
    return run_path / "checkpoints" / "base"


def load_base(run_path: Path, cfg):
    """The base model as a loss space: the run's stacked-frame UNet (`model.StackedFrames`), or on the Wan
    path (backend wan) the WanPipeline of --model, read from its directory (never copied into the run)."""
    from icml.methods.attribute_motion.model import StackedFrames, load_unet

    if cfg.backend == "wan":
        from icml.methods.attribute_motion import wan

        return wan.load(cfg.model)
    return StackedFrames(load_unet(base_dir(run_path), cfg.clips.frames, cfg.clips.size))


def load_state(run_path: Path, cfg):
    """Base model (a loss space, `load_base`), evaluators and clip sets of a trained run."""
    import torch

    from icml.methods.attribute_motion.clips import ClipSets, evaluator_grid
    from icml.methods.attribute_motion.vbench import AppearanceNet, MotionClassifier

    checkpoints = run_path / "checkpoints"
    base = ("base/model_index.json",) if cfg.backend == "unet" else ()  # the Wan base stays in --model
    for needed in (*base, "evaluators.pt", "clips.npz", "manifest.json"):
        if not (checkpoints / needed).exists():
            raise IcmlError(f"{checkpoints / needed} is missing", f"re-train: icml attribute-motion train")
    manifest = json.loads((checkpoints / "manifest.json").read_text())
    table = pd.read_parquet(run_path / "clips.parquet")
    sets = ClipSets.load(checkpoints / "clips.npz", table, manifest["has_flow"])
    model = load_base(run_path, cfg)
    state = torch.load(checkpoints / "evaluators.pt", weights_only=True)
    motion_net, appearance_net = MotionClassifier(evaluator_grid(cfg)[0]), AppearanceNet()
    motion_net.load_state_dict(state["motion"])
    appearance_net.load_state_dict(state["appearance"])
    motion_net.eval()
    appearance_net.eval()
    return model, motion_net, appearance_net, sets


# train ---------------------------------------------------------------------------------------------
def train(ctx: RunContext) -> None:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.attribute_motion import clips as clip_sets
    from icml.methods.attribute_motion.model import (as_tensor, build_unet, load_unet, parameter_count, save_pipeline,
                                                     seed_of, train_fm)
    from icml.methods.attribute_motion.vbench import train_evaluators

    cfg = ctx.config
    with single_thread():
        sets = clip_sets.build(cfg, ctx.seed, staging=ctx.checkpoints / "decoded")
        if distributed.is_main():  # under torchrun every rank renders the same clips; rank 0 writes them
            ctx.write_table("clips", sets.table)
            sets.save(ctx.checkpoints / "clips.npz")
        ctx.log(f"clips: { {k: int(v) for k, v in sets.table.groupby('split').size().items()} } ({'user folder' if cfg.data else 'synthetic'})")

        if cfg.backend == "wan":  # Motive on a WanPipeline: the given pipeline is the base, read again by eval
            from icml.methods.attribute_motion import wan

            space = wan.load(cfg.model)
            ctx.log(f"base: WanPipeline from {cfg.model} (transformer {parameter_count(space.model):,} parameters, "
                    f"VAE grid {space.temporal}× time, {space.spatial}× space); no pretraining")
            model = None
        elif cfg.model:
            model = load_unet(cfg.model, cfg.clips.frames, cfg.clips.size)
            ctx.log(f"base model from {cfg.model} ({parameter_count(model):,} parameters); no pretraining")
        else:
            model = build_unet(cfg.clips.frames, cfg.clips.size, cfg.unet.block_out_channels,
                               cfg.unet.layers_per_block, seed_of(ctx.seed, 1))
            pre = sets.index("pretrain")
            ctx.log(f"pretraining {parameter_count(model):,} parameters for {cfg.unet.steps} steps")
            rows = []
            with ctx.progress("pretrain (steps)", cfg.unet.steps) as advance:
                every = max(1, cfg.unet.steps // 20)

                def on_step(step, loss):
                    advance(1)
                    if step % every == 0 or step == cfg.unet.steps - 1:
                        rows.append({"metric": "loss", "value": loss, "variant": "base", "step": step + 1})

                started = time.perf_counter()
                with distributed.ranks_stop_together():  # torchrun: data-parallel, a failing rank stops all
                    train_fm(model, as_tensor(sets.videos[pre]), as_tensor(sets.valid[pre], torch.bool),
                             as_tensor(sets.labels[pre], torch.long), steps=cfg.unet.steps,
                             batch_size=cfg.unet.batch_size, lr=cfg.unet.lr, label_dropout=cfg.unet.label_dropout,
                             seed=seed_of(ctx.seed, 2), data_parallel=True, on_step=on_step)
            ctx.record(rows, split="train")
            ctx.log(f"pretrain loss {rows[-1]['value']:.4f} in {time.perf_counter() - started:.0f} s")
        if not distributed.is_main():  # every rank holds the same base; rank 0 writes it and the evaluators
            return
        if model is not None:
            save_pipeline(model, base_dir(ctx.run.path))

        videos, valid, motions, shapes, hues = clip_sets.evaluator_clips(cfg, ctx.seed)
        with ctx.progress("evaluators", None):
            motion_net, appearance_net, accuracy = train_evaluators(
                as_tensor(videos), torch.as_tensor(motions), torch.as_tensor(shapes), torch.as_tensor(hues),
                torch.as_tensor(valid), cfg.eval.evaluator_steps, seed_of(ctx.seed, 3))
        torch.save({"motion": motion_net.state_dict(), "appearance": appearance_net.state_dict()},
                   ctx.checkpoints / "evaluators.pt")
        ctx.record([{"metric": "evaluator_acc", "value": value, "variant": f"evaluator_{name}"}
                    for name, value in accuracy.items()], split="heldout")
        ctx.log("evaluators held-out accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
        manifest = {"has_flow": sets.has_flow, "data": cfg.data, "model": cfg.model, "targets": cfg.clips.targets,
                    "splits": {k: int(v) for k, v in sets.table.groupby("split").size().items()}}
        (ctx.checkpoints / "manifest.json").write_text(json.dumps(manifest, indent=1))


# featurize and score ---------------------------------------------------------------------------------
def selector_setting(cfg, variant: str, attr_seed: int):
    from icml.methods.attribute_motion.attribution import Setting

    a = cfg.attr
    setting = Setting(mask=True, shared_noise=True, prompt=a.prompt, t_star=a.t_star,
                      attr_seed=attr_seed, patch=a.patch, draws=a.draws, camera=a.camera, floor=a.flow_floor)
    if variant == "no_mask":
        return replace(setting, mask=False)
    if variant == "indep_noise":
        return replace(setting, shared_noise=False)
    if variant == "multi_draw":  # motive's gradients averaged over attr.multi_draws shared (t*, ε) draws
        return replace(setting, draws=a.multi_draws)
    return setting


def attribution_flow(cfg, sets, rows: np.ndarray):
    """Flow of the given clips: analytic where the generator stored it, else estimated."""
    import torch

    from icml.methods.attribute_motion.flow import estimate_flow

    if cfg.attr.flow == "analytic" and sets.has_flow:
        return torch.as_tensor(sets.flow[rows])
    method = "lk" if cfg.attr.flow == "analytic" else cfg.attr.flow
    return estimate_flow(torch.as_tensor(sets.videos[rows]), method)


def features(run_path: Path, cfg, model, sets, variant: str, attr_seed: int, *, dense: bool, progress=None) -> dict:
    """Projected gradients of pool + every query (rows: sets.index('pool') then sets.index('query')),
    cached under checkpoints/features/<gradient group>/<setting key>_D<dim>_ps<proj seed>/."""
    import torch

    from icml.methods.attribute_motion.attribution import featurize

    setting = selector_setting(cfg, variant, attr_seed)
    folder = (run_path / "checkpoints" / "features" / GRADIENT_GROUPS[variant]
              / f"{setting.key()}_D{cfg.attr.dim}_ps{cfg.attr.proj_seed}")
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["dense"] or not dense:
            out = {"fastfood": np.load(folder / "fastfood.npy", mmap_mode="r"),
                   "dense": np.load(folder / "dense.npy", mmap_mode="r") if meta["dense"] else None,
                   **{k: meta[k] for k in meta if k.endswith("_s")}}
            for name in ("exact_cos", "fastfood_cos", "dense_cos"):
                if (folder / f"{name}.npy").exists():
                    out[name] = np.load(folder / f"{name}.npy")
            out["cached"] = True
            return out
    rows = np.concatenate([sets.index("pool"), sets.index("query")])
    result = featurize(model, torch.as_tensor(sets.videos[rows]), torch.as_tensor(sets.valid[rows]),
                       attribution_flow(cfg, sets, rows), torch.as_tensor(sets.labels[rows]), rows, setting,
                       cfg.attr.dim, cfg.attr.proj_seed, cfg.attr.chunk, dense, cfg.attr.cos_subset, progress)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("fastfood", "dense", "exact_cos", "fastfood_cos", "dense_cos"):
        if result.get(name) is not None:
            memmap = np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=np.float32,
                                               shape=result[name].shape)
            memmap[:] = result[name]
            memmap.flush()
    meta = {"dense": dense, "setting": setting.key(), **{k: result[k] for k in result if k.endswith("_s")}}
    meta_path.write_text(json.dumps(meta))
    result["cached"] = False
    return result


def selector_scores(run_path: Path, cfg, model, sets, appearance_net, variant: str, target: str, attr_seed: int,
                    query_rows: np.ndarray | None = None, progress=None) -> tuple[np.ndarray, dict]:
    """Influence matrix (pool, queries) of a selector; info holds timing and the projection check."""
    import torch

    from icml.methods.attribute_motion.attribution import featurize, influence, proj_cos_err
    from icml.methods.attribute_motion.flow import patch_magnitude
    from icml.methods.attribute_motion.model import seed_of
    from icml.methods.attribute_motion.vbench import clip_appearance

    pool = sets.index("pool")
    queries = sets.index("query", target) if query_rows is None else query_rows
    info: dict = {}
    if variant == "random":
        rng = np.random.default_rng(seed_of(attr_seed, 505))
        return np.repeat(rng.random(len(pool))[:, None], len(queries), 1), info
    if variant == "flow_magnitude":  # no gradients: mean motion magnitude of each pool clip
        magnitude = patch_magnitude(attribution_flow(cfg, sets, pool), torch.as_tensor(sets.valid[pool]), cfg.attr.patch)
        per_clip = (magnitude.sum((1, 2, 3)) / (torch.as_tensor(sets.valid[pool]).sum(1)
                                                * magnitude.shape[2] * magnitude.shape[3])).numpy()
        return np.repeat(per_clip[:, None], len(queries), 1), info
    if variant == "appearance_match":
        from icml.methods.attribute_motion.clips import evaluator_grid
        from icml.methods.attribute_motion.vbench import to_grid

        videos = torch.as_tensor(sets.videos)
        feats = clip_appearance(to_grid(videos, videos.shape[1], evaluator_grid(cfg)[1]), torch.as_tensor(sets.valid),
                                appearance_net)
        return influence(feats[pool], feats[queries]), info
    dense = variant == "motive_dense" or ("motive_dense" in cfg.selectors and variant == "motive"
                                          and attr_seed == cfg.attr.attr_seeds[0])
    feat = features(run_path, cfg, model, sets, variant, attr_seed, dense=dense, progress=progress)
    all_rows = np.concatenate([pool, sets.index("query")])
    proj = "dense" if variant == "motive_dense" else "fastfood"
    projected = np.asarray(feat[proj])
    cached = set(all_rows.tolist())
    extra = np.array([r for r in queries if r not in cached], dtype=np.int64)
    if len(extra):  # user queries (select --queries DIR): same setting and projector, not cached
        more = featurize(model, torch.as_tensor(sets.videos[extra]), torch.as_tensor(sets.valid[extra]),
                         attribution_flow(cfg, sets, extra), torch.as_tensor(sets.labels[extra]), extra,
                         selector_setting(cfg, variant, attr_seed), cfg.attr.dim, cfg.attr.proj_seed, cfg.attr.chunk,
                         proj == "dense", 0)
        all_rows = np.concatenate([all_rows, extra])
        projected = np.concatenate([projected, more[proj]])
    position = {row: i for i, row in enumerate(all_rows)}
    take_pool = np.array([position[r] for r in pool])
    take_query = np.array([position[r] for r in queries])
    scores = influence(projected[take_pool], projected[take_query], pool_normaliser(cfg, sets, variant, attr_seed))
    grad_s, proj_s = feat.get("grad_s", 0.0), feat.get(f"{proj}_s", 0.0)
    info["featurize_s_per_clip"] = (grad_s + proj_s) / len(all_rows)
    if variant not in MOTIVE_RESCORED and f"{proj}_cos" in feat and "exact_cos" in feat:  # not twice
        info["proj_cos_err"] = proj_cos_err(np.asarray(feat["exact_cos"]), np.asarray(feat[f"{proj}_cos"]))
        info["cos_pairs"] = (np.asarray(feat["exact_cos"]), np.asarray(feat[f"{proj}_cos"]))
    return scores, info


def length_norm_of(cfg, variant: str) -> str:
    return LENGTH_NORMS.get(variant, cfg.attr.length_norm)


def pool_normaliser(cfg, sets, variant: str, attr_seed: int) -> np.ndarray | None:
    """Z(x) of every pool clip under the variant's length_norm (valid frames, ΣM or 1: the clip's own, never
    the pool's); None for grad_norm, where `influence` divides by the clip's gradient norm (the cosine)."""
    import torch

    from icml.methods.attribute_motion.attribution import clip_masks, normaliser

    norm = length_norm_of(cfg, variant)
    if norm == "grad_norm":
        return None
    pool = sets.index("pool")
    valid = torch.as_tensor(sets.valid[pool])
    mask = (clip_masks(attribution_flow(cfg, sets, pool), valid, selector_setting(cfg, variant, attr_seed))
            if norm == "mask_sum" else None)
    return normaliser(mask, valid, norm).double().numpy()


def score_rows(run_id: str, sets, variant: str, target: str, attr_seed: int, scores: np.ndarray, budget: int,
               agg: str, query_rows: np.ndarray) -> pd.DataFrame:
    """scores.parquet rows: the aggregated ranking (query_id −1) and each query's own ranking."""
    from icml.methods.attribute_motion.attribution import aggregate, selection_flags

    pool_table = sets.table.iloc[sets.index("pool")].reset_index(drop=True)
    mean, votes, rank = aggregate(scores, budget, agg)
    factors = pool_table[["clip_id", "motion", "shape", "hue", "background", "valid_len", "decoy_type"]]
    factors = factors.rename(columns={"hue": "colour"})
    frames = [factors.assign(query_id=-1, score=mean, votes=votes, rank=rank, selected=selection_flags(rank, budget))]
    for q in range(scores.shape[1]):
        own = np.empty(len(scores), dtype=np.int64)
        own[np.argsort(-scores[:, q], kind="stable")] = np.arange(len(scores))
        frames.append(factors.assign(query_id=int(query_rows[q]), score=scores[:, q], votes=0, rank=own,
                                     selected=selection_flags(own, budget)))
    out = pd.concat(frames, ignore_index=True)
    return out.assign(run_id=run_id, variant=variant, attr_seed=attr_seed, target_motion=target)[
        ["run_id", "variant", "attr_seed", "target_motion", "query_id", "clip_id", "score", "votes", "rank",
         "selected", "motion", "shape", "colour", "background", "valid_len", "decoy_type"]]


def budget_of(cfg, n_pool: int, frac: float | None = None) -> int:
    return max(1, int(round((frac if frac is not None else cfg.attr.frac) * n_pool)))


def agg_of(variant: str) -> str:
    return "mean" if variant in ("mean_agg", "flow_magnitude", "appearance_match", "random") else "vote"


def select(run_path: Path, cfg, variant: str, target: str, frac: float | None = None,
           queries_dir: str | None = None, attr_seed: int | None = None) -> dict:
    """The `select` verb: score one selector, merge its rows into scores.parquet, write the selection list."""
    from icml.cli.results import write_frame
    from icml.methods.attribute_motion.config import SELECTORS

    if variant not in SELECTORS or variant == "full":
        raise IcmlError(f"unknown selector '{variant}'",
                        f"use one of {', '.join(v for v in SELECTORS if v != 'full')}")
    if target not in cfg.clips.targets:
        raise IcmlError(f"target '{target}' is not a target of this run ({', '.join(cfg.clips.targets)})",
                        "pick one of them or train a run with --set clips.targets=…")
    model, _, appearance_net, sets = load_state(run_path, cfg)
    attr_seed = cfg.attr.attr_seeds[0] if attr_seed is None else attr_seed
    query_rows = None
    if queries_dir is not None:
        sets, query_rows = with_user_queries(sets, cfg, queries_dir, target)
    scores, _ = selector_scores(run_path, cfg, model, sets, appearance_net, variant, target, attr_seed,
                                query_rows=query_rows)
    n_pool = len(sets.index("pool"))
    budget = budget_of(cfg, n_pool, frac)
    used_queries = sets.index("query", target) if query_rows is None else query_rows
    rows = score_rows(run_path.name, sets, variant, target, attr_seed, scores, budget, agg_of(variant), used_queries)
    path = run_path / "scores.parquet"
    if path.exists():
        old = pd.read_parquet(path)
        keep = ~((old["variant"] == variant) & (old["target_motion"] == target) & (old["attr_seed"] == attr_seed))
        rows = pd.concat([old[keep], rows], ignore_index=True)
    write_frame(path, rows)
    chosen = rows[(rows["variant"] == variant) & (rows["target_motion"] == target) & (rows["attr_seed"] == attr_seed)
                  & (rows["query_id"] == -1) & (rows["selected"] == 1)].sort_values("rank")
    selection = {"variant": variant, "target": target, "attr_seed": attr_seed, "budget": budget,
                 "clip_ids": chosen["clip_id"].tolist()}
    out = run_path / "selections" / f"{variant}_{target}_s{attr_seed}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(selection, indent=1))
    return {**selection, "path": str(out)}


def with_user_queries(sets, cfg, folder: str, target: str):
    """Append the clips of a folder (video files, .npy/.npz, PNG folders) as queries of `target`."""
    from icml.data.videos import NULL_PROMPT, VideoDataError
    from icml.methods.attribute_motion.clips import ClipSets

    from icml.methods.attribute_motion.video_files import is_clip, read_clip

    root = Path(folder)
    if not root.is_dir():
        raise IcmlError(f"--queries '{folder}' is not a folder",
                        "pass a folder of .mp4/.webm videos, .npy/.npz clips or PNG frame folders")
    paths = sorted(p for p in root.iterdir() if is_clip(p))
    if not paths:
        raise IcmlError(f"--queries '{folder}' holds no video file, .npy/.npz clip or PNG frame folder", "add query clips")
    try:
        loaded = [read_clip(p, cfg.clips.frames, cfg.clips.size) for p in paths]
    except VideoDataError as exc:
        raise IcmlError(str(exc), "fix or remove that clip") from None
    import torch

    from icml.methods.attribute_motion.flow import estimate_flow

    user_videos = np.stack([v for v, _ in loaded])
    method = "lk" if cfg.attr.flow == "analytic" else cfg.attr.flow  # user clips have no analytic flow
    user_flow = estimate_flow(torch.as_tensor(user_videos), method).numpy()
    videos = np.concatenate([sets.videos, user_videos])
    valid = np.concatenate([sets.valid, np.stack([m for _, m in loaded])])
    flow = np.concatenate([sets.flow, user_flow])
    labels = np.concatenate([sets.labels, np.full(len(loaded), NULL_PROMPT)])
    extra = pd.DataFrame({"clip_id": [f"user-query-{p.stem}" for p in paths], "split": "user_query",
                          "prompt_id": NULL_PROMPT, "motion": "unknown", "valid_len": [int(m.sum()) for _, m in loaded],
                          "query_target": target})
    table = pd.concat([sets.table, extra], ignore_index=True)
    merged = ClipSets(videos, valid, flow, labels, table, sets.has_flow)
    return merged, np.arange(len(sets.videos), len(videos))


# eval ------------------------------------------------------------------------------------------------
def evaluate(ctx: RunContext) -> None:
    from icml.cli.results import write_frame
    from icml.cli.threads import single_thread
    from icml.methods.attribute_motion.attribution import spearman

    cfg = ctx.config
    model, motion_net, appearance_net, sets = load_state(ctx.run.path, cfg)
    pool = sets.index("pool")
    budget = budget_of(cfg, len(pool))
    all_scores, retrieval, cos_pairs = [], [], []
    seed_vectors: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    jobs = [(target, variant, s) for target in cfg.clips.targets for variant in cfg.selectors if variant != "full"
            for s in (cfg.attr.attr_seeds[:1] if variant in FIRST_SEED_ONLY else cfg.attr.attr_seeds)]
    with ctx.progress("selectors (target × selector × seed)", len(jobs)) as advance:
        for target, variant, attr_seed in jobs:
            scores, info = selector_scores(ctx.run.path, cfg, model, sets, appearance_net, variant, target, attr_seed)
            queries = sets.index("query", target)
            frame = score_rows(ctx.run.path.name, sets, variant, target,
                               attr_seed, scores, budget, agg_of(variant), queries)
            all_scores.append(frame)
            aggregated = frame[frame["query_id"] == -1]
            seed_vectors.setdefault((target, variant), {})[attr_seed] = aggregated["score"].to_numpy()
            retrieval += retrieval_rows(cfg, sets, variant, target, attr_seed, aggregated, budget, info)
            if "cos_pairs" in info and target == cfg.clips.targets[0]:
                exact, projected = info["cos_pairs"]
                upper = np.triu_indices(len(exact), 1)
                cos_pairs.append(pd.DataFrame({"variant": variant, "attr_seed": attr_seed,
                                               "proj": "dense" if variant == "motive_dense" else "fastfood",
                                               "exact": exact[upper], "projected": projected[upper]}))
            advance(1)
    for (target, variant), by_seed in seed_vectors.items():
        if len(by_seed) >= 2:
            first, second = (by_seed[s] for s in cfg.attr.attr_seeds[:2])
            retrieval.append({**tags(cfg, variant, target, None), "metric": "seed_spearman",
                              "value": spearman(first, second)})
    ctx.record(retrieval, split="pool")
    write_frame(ctx.run.table_path("scores"), pd.concat(all_scores, ignore_index=True))
    if cos_pairs:
        write_frame(ctx.run.table_path("cosines"), pd.concat(cos_pairs, ignore_index=True))
    if cfg.arms:
        with single_thread():
            finetune_and_generate(ctx, model, motion_net, appearance_net, sets, pd.concat(all_scores), budget)


def tags(cfg, variant: str, target: str, attr_seed: int | None) -> dict:
    a = cfg.attr
    return {"variant": variant, "target_motion": target, "budget_frac": a.frac, "attr_seed": attr_seed,
            "proj": {"motive_dense": "dense"}.get(variant, "fastfood") if variant in GRADIENT_GROUPS else None,
            "dim": a.dim if variant in GRADIENT_GROUPS else None,
            "length_norm": length_norm_of(cfg, variant) if variant in GRADIENT_GROUPS else None,
            "agg": agg_of(variant), "mask": ("off" if variant == "no_mask" else "on") if variant in GRADIENT_GROUPS else None}


def retrieval_rows(cfg, sets, variant, target, attr_seed, aggregated: pd.DataFrame, budget: int, info: dict) -> list:
    from icml.methods.attribute_motion.attribution import retrieval_metrics

    base = tags(cfg, variant, target, attr_seed)
    rows = []
    if sets.has_flow:  # synthetic pool: the motion labels are known
        pool = sets.table.iloc[sets.index("pool")].reset_index(drop=True)
        metrics = retrieval_metrics(pool, aggregated["rank"].to_numpy(), aggregated["score"].to_numpy(), target,
                                    budget, [10, budget])
        for key, value in metrics.items():
            if isinstance(key, tuple):
                rows.append({**base, "metric": key[0], "k": key[1], "value": value})
            else:
                rows.append({**base, "metric": key, "value": value})
    for key in ("proj_cos_err", "featurize_s_per_clip"):
        if key in info and target == cfg.clips.targets[0]:
            rows.append({**base, "metric": key, "value": info[key]})
    return rows


def finetune_and_generate(ctx: RunContext, base, motion_net, appearance_net, sets, scores: pd.DataFrame,
                          budget: int) -> None:
    import torch

    from icml.data.videos import MOTIONS, SHAPES, prompt_id
    from icml.methods.attribute_motion.flow import estimate_flow
    from icml.methods.attribute_motion.clips import evaluator_grid
    from icml.methods.attribute_motion.model import as_tensor, heldout_loss, seed_of, train_fm
    from icml.methods.attribute_motion.vbench import (dynamic_degree, motion_probabilities, motion_smoothness,
                                                      subject_consistency, to_grid, top_flow, win_rate)

    cfg = ctx.config
    target = cfg.primary_target
    pool = sets.index("pool")
    pool_ids = sets.table["clip_id"].to_numpy()[pool]
    first_seed = cfg.attr.attr_seeds[0]
    held = sets.index("heldout")
    held_args = (as_tensor(sets.videos[held]), as_tensor(sets.valid[held], torch.bool),
                 as_tensor(sets.labels[held], torch.long))
    labels = torch.tensor([prompt_id(target, SHAPES[i % len(SHAPES)]) for i in range(cfg.eval.n_videos)])
    target_index = MOTIONS.index(target)
    gen_seed = seed_of(ctx.seed, 404)
    results, samples = [], {}

    def measure(name: str, model, seconds: float | None) -> np.ndarray:
        videos = model.generate(labels, cfg.clips.frames, cfg.clips.size, steps=cfg.unet.sample_steps,
                                cfg_scale=cfg.unet.cfg_scale, seed=gen_seed)  # MotionPipeline or WanPipeline
        on_grid = to_grid(videos, *evaluator_grid(cfg))  # the evaluators' clips (the same unless eval.grid_*)
        all_probs = motion_probabilities(on_grid, motion_net)
        flow = estimate_flow(videos, cfg.eval.flow)[:, :-1]
        values = {"target_motion_acc": float((all_probs.argmax(1) == target_index).mean()),
                  "dynamic_degree": float(dynamic_degree(videos, flow=flow).mean()),
                  "top_flow_px": float(top_flow(videos, flow=flow).mean()),
                  "motion_smoothness": float(motion_smoothness(videos, cfg.eval.flow, cfg.eval.interp).mean()),
                  "subject_consistency": float(subject_consistency(on_grid, appearance_net).mean()),
                  "fm_loss_heldout": heldout_loss(model, *held_args, seed=seed_of(ctx.seed, 606))}
        if seconds is not None:
            values["finetune_s"] = seconds
        results.extend({"metric": m, "value": v, "variant": name, "target_motion": target, "budget_frac": cfg.attr.frac,
                        "attr_seed": first_seed if name not in ("base", "full") else None}
                       for m, v in values.items())
        samples[name] = videos[:6].numpy()
        ctx.log(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))
        return all_probs[:, target_index]

    with ctx.progress("fine-tune arms + generate", len(cfg.arms) + 1) as advance:
        base_probs = measure("base", base, None)
        advance(1)
        for arm in cfg.arms:
            if arm == "full":
                chosen = pool
            else:
                picked = scores[(scores["variant"] == arm) & (scores["target_motion"] == target)
                                & (scores["attr_seed"] == first_seed) & (scores["query_id"] == -1)
                                & (scores["selected"] == 1)]
                if picked.empty:
                    raise IcmlError(f"arm '{arm}' has no selection (it is not among the selectors)",
                                    f"add it: --set selectors=…,{arm}")
                chosen = pool[np.isin(pool_ids, picked["clip_id"].to_numpy())]
            model = base.with_model(copy.deepcopy(base.model))  # only the denoiser is copied and tuned
            started = time.perf_counter()
            train_fm(model, as_tensor(sets.videos[chosen]), as_tensor(sets.valid[chosen], torch.bool),
                     as_tensor(sets.labels[chosen], torch.long), steps=cfg.finetune.steps,
                     batch_size=cfg.finetune.batch_size, lr=cfg.finetune.lr, label_dropout=cfg.unet.label_dropout,
                     seed=seed_of(ctx.seed, 303))  # the same random stream for every arm
            seconds = time.perf_counter() - started
            probs = measure(arm, model, seconds)
            results.append({"metric": "win_rate_vs_base", "value": win_rate(probs, base_probs), "variant": arm,
                            "target_motion": target, "budget_frac": cfg.attr.frac,
                            "attr_seed": first_seed if arm != "full" else None})
            advance(1)
    ctx.record(results, split="generated")
    np.savez_compressed(ctx.checkpoints / "samples.npz", **samples)
