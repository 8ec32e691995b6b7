"""The event-classify lifecycle.

train: simulate or load each dataset, window/subsample/augment it into clouds (saved under
checkpoints/data/), train SECNet per dataset (`loss`, `train_acc`, `val_window_acc`, `learned_w`),
save checkpoints/secnet.pt and the preprocessing config.
eval: evaluate SECNet; train and evaluate the baselines and ablations on the same clouds (CNN
baselines on the main budget, point models on the `compare` budget); profile MACs, parameters,
latency and throughput, and the N-scaling and fixed-S sweeps; write profile.parquet.
"""
from __future__ import annotations

import json
from pathlib import Path

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_torch_save, atomic_write, load_checkpoint
from icml.cli.workers import run_in_workers
from icml.methods.event_classify.config import CNN_VARIANTS, POINT_VARIANTS
from icml.methods.event_classify.training import Budget

TRAIN_METRICS = ("loss", "train_acc", "val_window_acc", "learned_w")


def data_file(ctx: RunContext, dataset: str, n_points: int) -> Path:
    return ctx.checkpoints / "data" / f"{dataset}_n{n_points}.npz"



def prepare(ctx: RunContext) -> list[dict]:
    """Clouds of every dataset at every N the jobs need; returns the data-sanity rows."""
    import numpy as np

    from icml.data.events import EventFileError
    from icml.methods.event_classify.data import load_dataset, make_clouds, split_indices, split_validation

    cfg = ctx.config
    rows = []
    for dataset in cfg.datasets:
        sizes = {cfg.arch.n_points} | ({cfg.compare.arch.n_points} if dataset in cfg.compare.datasets else set())
        if all(data_file(ctx, dataset, n).exists() for n in sizes):
            continue
        ctx.log(f"data: {dataset} …")
        try:
            events = load_dataset(dataset, cfg, ctx.seed)
        except EventFileError as exc:
            raise IcmlError(str(exc), "check the file or pass --set format=… / sensor_size=W,H") from None
        train_idx, test_idx = split_indices(events, cfg.test_fraction, ctx.seed)
        train_idx, val_idx = split_validation(train_idx, cfg.val_fraction, ctx.seed)
        if len(train_idx) < 2 or len(test_idx) < 1:
            raise IcmlError(f"{dataset}: {len(train_idx)} training and {len(test_idx)} test samples",
                            "provide more labelled samples")
        if events.events:
            counts = [len(e) for e in events.events]
            rows.append({"dataset": dataset, "variant": "data", "metric": "events_per_sample",
                         "value": float(np.mean(counts))})
        for n in sorted(sizes):
            train = make_clouds(events, train_idx, cfg, n, ctx.seed, augment=True)
            val = make_clouds(events, val_idx, cfg, n, ctx.seed + 2, augment=False)
            test = make_clouds(events, test_idx, cfg, n, ctx.seed + 1, augment=False)
            atomic_write(data_file(ctx, dataset, n), lambda p: np.savez(
                p, train_x=train.x, train_y=train.y, train_mark=train.mark, val_x=val.x, val_y=val.y, val_mark=val.mark,
                test_x=test.x, test_y=test.y, test_mark=test.mark, classes=np.array(events.classes),
                sensor=np.array(events.sensor)))
            ctx.log(f"  N={n}: {len(train)} training clouds (augmented), {len(val)} validation and {len(test)} test clouds, "
                    f"{len(events.classes)} classes, sensor {events.sensor[0]}×{events.sensor[1]}")
    return rows


def _job(args):
    from icml.methods.event_classify.training import run_job

    return run_job(*args)


def run_jobs(ctx: RunContext, jobs: list[tuple], on_done) -> None:
    """Jobs (variant, dataset, budget) in `workers` spawned single-threaded processes (results do not
    depend on which worker ran what); `on_done(job, rows, state)` runs here, in the parent."""
    cfg = ctx.config
    args = [(cfg, ctx.seed, v, d, b, str(data_file(ctx, d, b.n_points)), ctx.device) for v, d, b in jobs]
    with ctx.progress("trainings", len(jobs)) as advance:
        run_in_workers(cfg.workers, [(job, _job, (arg,)) for job, arg in zip(jobs, args)],
                       lambda job, result: (on_done(job, *result), advance(1)))


def _summary(rows: list[dict], job) -> str:
    last = {r["metric"]: r["value"] for r in rows if r["metric"] in ("val_window_acc", "window_acc", "sample_acc")}
    return f"{job[0]} on {job[1]} ({job[2].name}): " + ", ".join(f"{k} {v:.3f}" for k, v in last.items())


def secnet_path(ctx: RunContext) -> Path:
    return ctx.checkpoints / "secnet.pt"


def train(ctx: RunContext) -> None:
    import torch

    cfg = ctx.config
    ctx.record(prepare(ctx), split="data")
    path = secnet_path(ctx)
    saved = load_checkpoint(path) if path.exists() else {"states": {}}
    jobs = [("secnet", d, Budget.of(cfg, "main", d)) for d in cfg.datasets if d not in saved["states"]]

    def done(job, rows, state):
        ctx.record([r for r in rows if r["metric"] in TRAIN_METRICS], split="train")
        ctx.log("  " + _summary([r for r in rows if r["metric"] == "val_window_acc"], job))
        saved["states"][job[1]] = state
        atomic_torch_save(saved, path)

    run_jobs(ctx, jobs, done)
    (ctx.checkpoints / "preprocessing.json").write_text(json.dumps({
        "columns": ["t", "x", "y", "p"], "n_points": cfg.arch.n_points, "windows": cfg.windows,
        "polarity": cfg.polarity, "norm_size": cfg.norm_size, "t": "min-max per window",
        "datasets": cfg.datasets}, indent=1))


def evaluate(ctx: RunContext) -> None:
    import torch

    from icml.methods.event_classify.training import run_job

    cfg = ctx.config
    ctx.record(prepare(ctx), split="data")  # rebuilds the clouds only if checkpoints/data was removed
    path = secnet_path(ctx)
    if not path.exists():
        raise IcmlError(f"{path} is missing", f"re-train: icml event-classify train --resume {ctx.run.path}")
    saved = load_checkpoint(path)
    for dataset in cfg.datasets:
        main = Budget.of(cfg, "main", dataset)
        rows, _ = run_job(cfg, ctx.seed, "secnet", dataset, main, str(data_file(ctx, dataset, main.n_points)),
                          ctx.device, saved["states"][dataset])
        ctx.record(rows)
        ctx.log("  " + _summary(rows, ("secnet", dataset, main)))
    jobs = [(v, d, Budget.of(cfg, "main", d)) for d in cfg.datasets for v in cfg.variants if v in CNN_VARIANTS]
    jobs += [(v, d, Budget.of(cfg, "compare", d)) for d in cfg.compare.datasets for v in POINT_VARIANTS
             if v in cfg.variants or (v == "secnet" and any(x in cfg.variants for x in POINT_VARIANTS))]

    def done(job, rows, state):
        ctx.record(rows)
        ctx.log("  " + _summary(rows, job))

    run_jobs(ctx, jobs, done)
    with ctx.progress("profiler (MACs, latency, sweeps)", None):
        rows, table = profile(ctx)
    ctx.record(rows, split="profile")
    ctx.write_table("profile", table)


# profiler -----------------------------------------------------------------------------------------
def profile(ctx: RunContext):
    """Parameters, analytic MACs per part, latency (batch 1) and throughput (batch 32) of every variant
    at the main arch, then the N-scaling (S₁ = N/8) and fixed-S sweeps of SECNet and secnet_attn."""
    import numpy as np
    import pandas as pd
    import torch

    from icml.cli.threads import intra_op_threads
    from icml.methods.event_classify.costs import layer_macs, parameters, secnet_costs, time_forward, time_parts
    from icml.methods.event_classify.model import ABLATION_OPTIONS, Arch, build_model

    cfg, p = ctx.config, ctx.config.profile
    run_id = ctx.run.path.name
    data = np.load(data_file(ctx, cfg.datasets[0], cfg.arch.n_points))
    n_classes, sensor = len(data["classes"]), tuple(int(v) for v in data["sensor"])
    rows, table = [], []
    torch.manual_seed(ctx.seed)

    def measure(variant, arch, sweep, timed=True):
        model = build_model(variant, arch, sensor, ctx.seed).eval()
        options = ABLATION_OPTIONS.get(variant)
        if options is not None:
            costs = secnet_costs(arch.n_points, arch.groups, arch.k, arch.d0, n_classes, options.spatial,
                                 options.pool, options.temporal, options.knn_space)
        else:
            costs = {"macs_total": layer_macs(model, torch.rand(1, arch.n_points, 4))}
            if variant == "pointnet2":
                n_in, grouping = arch.n_points, 0
                for s in arch.groups:
                    grouping, n_in = grouping + 2 * s * n_in * 3, s
                costs["grouping_ops"] = grouping
        costs["params"] = parameters(model)
        cloud = torch.rand(1, arch.n_points, 4)
        cloud[..., 0] = cloud[..., 0].sort(-1).values
        parts_ms = {}
        if timed:
            costs["latency_ms_b1"] = time_forward(model, cloud, p.latency_runs, p.warmups)
            if options is not None:
                parts_ms = time_parts(model, cloud, max(1, p.latency_runs // 4))
        tags = {"dataset": cfg.datasets[0], "n_points": arch.n_points, "s1": arch.groups[0], "k": arch.k,
                "d0": arch.d0, "windows": cfg.windows, "sweep": sweep, "variant": variant}
        out = [{**tags, "metric": m, "value": float(v)} for m, v in costs.items()]
        out += [{**tags, "metric": "latency_ms_part", "part": part, "value": ms} for part, ms in parts_ms.items()]
        for part in ("embed", "spatial_fa", "pool", "temporal_fa", "temporal_scores", "residual", "head", "grouping",
                     "total"):
            macs = costs.get("macs_total" if part == "total" else "grouping_ops" if part == "grouping"
                             else f"macs_{part}")
            if macs is None:
                continue
            table.append({"run_id": run_id, "variant": variant, "n_points": arch.n_points, "s1": arch.groups[0],
                          "part": part, "macs": float(macs), "params": float(costs["params"]),
                          "latency_ms": costs.get("latency_ms_b1") if part == "total" else parts_ms.get(part),
                          "sweep": sweep})
        return model, out

    with intra_op_threads(p.threads):
        base = cfg.arch
        variants = ["secnet"] + [v for v in cfg.variants if v != "secnet"]
        for variant in variants:
            arch = Arch(base.n_points, tuple(base.groups), base.k, base.d0, n_classes)
            model, out = measure(variant, arch, "none")
            batch = torch.rand(p.throughput_batch, base.n_points, 4)
            ms = time_forward(model, batch, max(1, p.latency_runs // 5), 1)
            rows += out + [{**out[0], "metric": "throughput_sps", "value": 1e3 * p.throughput_batch / ms,
                            "part": None}]
        for sweep in ("n_scaling", "fixed_s"):
            for n in p.sweep_n:
                s1 = n // 8 if sweep == "n_scaling" else p.fixed_s1
                groups = (s1, s1 // 2, s1 // 4)
                if min(groups[:-1]) < base.k or s1 > n:  # k neighbours need k points to pick from
                    continue
                for variant in ("secnet", "secnet_attn"):
                    rows += measure(variant, Arch(n, groups, base.k, base.d0, n_classes), sweep,
                                    timed=p.time_sweep and variant == "secnet")[1]
    return rows, pd.DataFrame(table)
