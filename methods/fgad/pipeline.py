"""The fgad lifecycle.

The run seed shifts every grid seed (config.job_seeds), so runs of different seeds train different
graphs, injections, partitions, splits and initialisations.

train: builds the graph per seed (SBM + injection, or a user file), then runs every job of the grid
  — one job is a model family (mvfgad, local_only, dominant) × K × seed × partition — in
  `workers` single-threaded processes. A job saves its scores per variant, selection info, costs and
  weights under checkpoints/jobs/; the mvfgad jobs also hold the global GCN, the views and U.
  The training losses go to metrics.parquet; partition.parquet and injection.parquet are written.
eval: turns every job's selected scores into the spec's metrics (per group, client-weighted and
  pooled; plus the diagnostic `<group>_intact` clique members), client_metrics.parquet and
  score_histogram.parquet (mvfgad's fused test scores at the largest K, first seed). All model
  selection happened on validation AUROC in train.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from icml.cli.errors import IcmlError, UsageError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_torch_save, load_checkpoint
from icml.cli.workers import run_in_workers

VIEW_ABLATIONS = ("view_attr", "view_smooth", "view_signed", "euclidean")


# graph ---------------------------------------------------------------------------------------------------
def injection_params(cfg, seed: int):
    from icml.data.graphs import InjectionParams

    return InjectionParams(cfg.anomaly_fraction, cfg.m_strong, cfg.m_weak, cfg.p_drop_strong, cfg.p_drop_weak,
                           cfg.k_strong, cfg.k_weak, seed)


def dataset_name(cfg) -> str:
    return "sbm" if cfg.data == "sbm" else Path(cfg.data).stem


def build_graph(cfg, seed: int):
    """(Data, injection rows, inject_id) for one seed; every random choice follows the seed."""
    from icml.data.graphs import GraphFormatError, inject_into, load_graph, synthetic_graph

    inject = cfg.inject if cfg.inject is not None else cfg.data == "sbm"
    params = injection_params(cfg, seed) if inject else None
    if cfg.data == "sbm":
        if params is None:
            raise IcmlError("data=sbm without injection has no anomalies", "drop --set inject=false")
        data, rows = synthetic_graph(cfg.n_nodes, cfg.blocks, cfg.deg_in, cfg.deg_out, cfg.n_features,
                                     cfg.feature_noise, cfg.theta_sigma, params)
    else:
        try:
            data = load_graph(cfg.data, cfg.features)
        except GraphFormatError as exc:
            raise IcmlError(str(exc), "see `icml fgad` README for the accepted graph formats") from None
        rows = []
        if params is not None:
            from icml.methods.fgad.partition import louvain_chunks

            community = np.zeros(data.num_nodes, dtype=np.int64)
            for i, members in enumerate(louvain_chunks(data.edge_index.numpy(), data.num_nodes, 1, seed)):
                community[members] = i
            data, rows = inject_into(data, params, community)
    return data, rows, (params.inject_id() if params else "none")


# jobs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSpec:
    kind: str  # mvfgad | local_only | dominant
    K: int
    seed: int
    partition: str = "louvain"

    @property
    def key(self) -> str:
        return f"{self.kind}_{self.partition}_K{self.K}_s{self.seed}"

    @property
    def variant(self) -> str:
        """The name of the job's main scores (the fused rule for mvfgad-family jobs)."""
        if self.partition != "louvain":
            return f"partition_{self.partition}"
        return {"dominant": "fedavg_dominant"}.get(self.kind, self.kind)


def grid_config(ctx: RunContext):
    """The run's config with its grid seeds (`seeds`, `ablation_seeds`) shifted by the run seed."""
    from icml.methods.fgad.config import job_seeds

    cfg = ctx.config
    shifted = replace(cfg, seeds=job_seeds(cfg.seeds, ctx.seed), ablation_seeds=job_seeds(cfg.ablation_seeds, ctx.seed))
    if min(shifted.seeds + shifted.ablation_seeds) < 0:  # numpy and networkx refuse negative seeds
        raise UsageError(f"run seed {ctx.seed} gives negative grid seeds {shifted.seeds}", "use a run seed >= 0")
    return shifted


def job_grid(cfg) -> list[JobSpec]:
    """The jobs the selected variants need; central_* are the K=1 jobs, ablations run at
    (ablation_K, ablation_seeds), view/Euclidean ablations read the mvfgad jobs."""
    wanted = set(cfg.variants)
    jobs: list[JobSpec] = []

    def add(spec):
        if spec not in jobs:
            jobs.append(spec)

    for seed in cfg.seeds:
        for k in cfg.K:
            if wanted & {"mvfgad", "fedavg_gcn"}:
                add(JobSpec("mvfgad", k, seed))
            if "local_only" in wanted:
                add(JobSpec("local_only", k, seed))
            if "fedavg_dominant" in wanted:
                add(JobSpec("dominant", k, seed))
        if "central_mvfgad" in wanted:
            add(JobSpec("mvfgad", 1, seed))
        if "central_dominant" in wanted:
            add(JobSpec("dominant", 1, seed))
    for seed in cfg.ablation_seeds:
        if wanted & set(VIEW_ABLATIONS):
            add(JobSpec("mvfgad", cfg.ablation_K, seed))
        if "partition_random" in wanted:
            add(JobSpec("mvfgad", cfg.ablation_K, seed, "random"))
        if "partition_metis" in wanted:
            add(JobSpec("mvfgad", cfg.ablation_K, seed, "metis"))
    return jobs


_worker_graphs: dict = {}  # seed -> graph, per process


def run_job(cfg, spec: JobSpec):
    """One job, in this process or a worker; deterministic in (cfg, spec)."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.fgad.algorithm import JobResult, run_dominant, run_mvfgad
    from icml.methods.fgad.partition import build_clients, ensure_anomaly_per_split, partition, split_nodes

    if spec.seed not in _worker_graphs:
        _worker_graphs[spec.seed] = build_graph(cfg, spec.seed)[0]
    data = _worker_graphs[spec.seed]
    n = data.num_nodes
    y = data.y.numpy()
    client = partition(spec.partition, data.edge_index.numpy(), n, spec.K, spec.seed)
    split = split_nodes(client, cfg.split, spec.seed)
    client, moves = ensure_anomaly_per_split(client, split, y, spec.K, np.random.default_rng(spec.seed))
    with single_thread():
        torch.manual_seed(spec.seed)
        clients, cut = build_clients(data, client, split)
        job = JobResult(spec.kind, spec.K, spec.seed, spec.partition, client, split, moves, y, data.group.numpy(),
                        list(data.group_names), cut)
        job.missing = [(c, s) for c in range(spec.K) for s in range(3)
                       if not ((client == c) & (split == s) & (y > 0)).any()]
        if spec.kind == "dominant":
            run_dominant(job, clients, cfg)
        else:
            run_mvfgad(job, clients, cfg, spec.variant, local_only=spec.kind == "local_only")
    return job


def job_path(ctx: RunContext, spec: JobSpec) -> Path:
    return ctx.checkpoints / "jobs" / f"{spec.key}.pt"



def _plain(value, to_tensor: bool):
    """A job result's fields as tensors and plain containers (to_tensor) or back to numpy arrays: the job
    file then loads with weights_only=True, and a run directory from elsewhere cannot run code."""
    import torch

    if isinstance(value, dict):
        return {k: _plain(v, to_tensor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, to_tensor) for v in value)
    if to_tensor and isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if to_tensor and isinstance(value, np.generic):
        return value.item()
    if not to_tensor and isinstance(value, torch.Tensor):
        return value.numpy()
    return value


def _save(job, path: Path) -> None:
    import dataclasses

    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    checkpoint = fields.pop("checkpoint")  # model state dicts and node ids, exported as tensors: they stay tensors
    atomic_torch_save({**_plain(fields, True), "checkpoint": _plain(checkpoint, True)}, path)


def _load(ctx: RunContext, spec: JobSpec):
    from icml.methods.fgad.algorithm import JobResult

    path = job_path(ctx, spec)
    if not path.exists():
        raise IcmlError(f"job result {path} is missing",
                        f"finish training: icml fgad train --resume {ctx.run.path}")
    fields = load_checkpoint(path)
    checkpoint = fields.pop("checkpoint")
    return JobResult(**_plain(fields, False), checkpoint=checkpoint)


# train -----------------------------------------------------------------------------------------------------
def _loss_rows(spec: JobSpec, job, tags: dict) -> list[dict]:
    return [{"variant": variant, "metric": "loss", "value": float(v), "step": step, "stage": stage, "seed": spec.seed,
             "K": spec.K, **tags, "partition": spec.partition}
            for (variant, stage), curve in job.losses.items() for step, v in enumerate(curve)]


def train(ctx: RunContext) -> None:
    import pandas as pd

    cfg = grid_config(ctx)
    graphs = {seed: build_graph(cfg, seed) for seed in sorted(set(cfg.seeds) | set(cfg.ablation_seeds))}
    first = graphs[cfg.seeds[0]][0]
    ctx.log(f"graph {dataset_name(cfg)}: {first.num_nodes} nodes, {first.edge_index.shape[1] // 2} edges, "
            f"{int(first.y.sum())} anomalies; groups {first.group_names[1:]}")
    if any(first.num_nodes / k > cfg.max_client_nodes for k in cfg.K):
        ctx.log(f"warning: clients above {cfg.max_client_nodes} nodes; dense N_k×N_k matrices will be large")
    injections = []
    for seed, (_, rows, inject_id) in graphs.items():
        injections += [{**r, "seed": seed, "inject_id": inject_id} for r in rows]
    ctx.run.update(injection={"enabled": bool(injections), "groups_per_seed": {
        str(seed): {"inject_id": g[2], **(asdict(injection_params(cfg, seed)) if g[1] else {})}
        for seed, g in graphs.items()}})
    if injections:
        ctx.write_table("injection", pd.DataFrame(injections))
    _worker_graphs.update({seed: g[0] for seed, g in graphs.items()})

    tags = {"dataset": dataset_name(cfg)}
    jobs = job_grid(cfg)
    todo = [spec for spec in jobs if not job_path(ctx, spec).exists()]  # --resume: a job is the unit

    def done(spec: JobSpec, job):
        _save(job, job_path(ctx, spec))
        ctx.record(_loss_rows(spec, job, {**tags, "inject_id": graphs[spec.seed][2]}), split="train")
        for c, s in job.missing:
            ctx.log(f"warning: {spec.key}: client {c} has no anomaly in split {s} (too few anomalies to move)")
        undefined = [c for c, v in enumerate(job.val_auroc[spec.variant]) if np.isnan(v)]
        if undefined:
            ctx.log(f"warning: {spec.key}: validation AUROC undefined for client(s) {undefined}; their last "
                    "epoch/round is kept and their metrics are NaN")
        ctx.log(f"  {spec.key}: {len(job.moves)} anomaly move(s), cut edges {job.cut_edge_frac:.3f}, "
                f"val AUROC {np.nanmean(job.val_auroc[spec.variant]):.3f}")

    with ctx.progress("fgad jobs", len(jobs)) as advance:
        advance(len(jobs) - len(todo))
        # single-threaded workers, the most expensive jobs (smallest K) first
        ordered = sorted(todo, key=lambda spec: (spec.K, spec.kind != "mvfgad"))
        run_in_workers(cfg.workers, [(spec, run_job, (cfg, spec)) for spec in ordered],
                       lambda spec, job: (done(spec, job), advance(1)))
    _write_partitions(ctx, jobs)


def _write_partitions(ctx: RunContext, jobs: list[JobSpec]) -> None:
    import pandas as pd

    frames, seen = [], set()
    for spec in jobs:
        ident = (spec.K, spec.seed, spec.partition)
        if ident in seen:
            continue
        seen.add(ident)
        job = _load(ctx, spec)
        moved = np.zeros(len(job.client), dtype=bool)
        moved[[m["node_id"] for m in job.moves]] = True
        frames.append(pd.DataFrame({"node_id": np.arange(len(job.client)), "client": job.client,
                                    "split": np.array(["train", "val", "test"])[job.split], "moved": moved,
                                    "K": spec.K, "seed": spec.seed, "partition": spec.partition}))
        if spec.kind == "mvfgad" and spec.partition == "louvain":  # the spec's checkpoint layout
            folder = ctx.checkpoints / spec.key
            atomic_torch_save(job.checkpoint.get("global_gcn"), folder / "global_gcn.pt")
            atomic_torch_save(job.checkpoint.get("clients"), folder / "clients.pt")
    ctx.write_table("partition", pd.concat(frames, ignore_index=True))


# eval ------------------------------------------------------------------------------------------------------
def recall_at_k(scores: np.ndarray, labels: np.ndarray) -> float:
    """Recall within the top-k scores, k = the number of true anomalies."""
    k = int(labels.sum())
    if k == 0:
        return float("nan")
    top = np.argsort(-scores, kind="stable")[:k]
    return float(labels[top].sum() / k)


def group_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import average_precision_score

    from icml.methods.fgad.algorithm import auroc

    if labels.sum() == 0 or labels.sum() == len(labels):
        return {"auroc": float("nan"), "ap": float("nan"), "recall_at_k": float("nan")}
    return {"auroc": auroc(scores, labels), "ap": float(average_precision_score(labels, scores)),
            "recall_at_k": recall_at_k(scores, labels)}


def job_variants(cfg, spec: JobSpec) -> dict[str, str]:
    """Recorded variant -> the job's score key."""
    wanted = set(cfg.variants)
    out = {}
    if spec.partition != "louvain":
        return {spec.variant: spec.variant}
    if spec.kind == "mvfgad":
        if spec.K in cfg.K:
            out.update({v: v for v in ("mvfgad", "fedavg_gcn") if v in wanted})
        if spec.K == cfg.ablation_K and spec.seed in cfg.ablation_seeds:
            out.update({v: v for v in VIEW_ABLATIONS if v in wanted})
        if spec.K == 1 and "central_mvfgad" in wanted:
            out["central_mvfgad"] = "mvfgad"
    elif spec.kind == "dominant":
        if spec.K in cfg.K and "fedavg_dominant" in wanted:
            out["fedavg_dominant"] = "fedavg_dominant"
        if spec.K == 1 and "central_dominant" in wanted:
            out["central_dominant"] = "fedavg_dominant"
    elif spec.K in cfg.K:
        out["local_only"] = "local_only"
    return out


def intact_members(edge_index: np.ndarray, injection: list[dict], client: np.ndarray) -> dict[str, np.ndarray]:
    """The diagnostic groups `<group>_intact` of the injected cliques: the members that keep at least half of
    their clique edges inside their own client. Louvain may split a clique and an anomaly move may carry a
    member away; such a member has no clique neighbour left in its client, so it is no longer a structural
    anomaly there, yet it still counts in the official group (README: why str_strong stays low)."""
    clique = np.full(len(client), -1)
    names = {}
    for row in injection:
        if row["atype"] == "str":
            clique[row["node_id"]] = names.setdefault((row["group"], row["clique_id"]), len(names))
    src, dst = edge_index
    within = (clique[src] >= 0) & (clique[src] == clique[dst]) & (src != dst)  # both directions are stored
    total = np.bincount(src[within], minlength=len(client))
    kept = np.bincount(src[within & (client[src] == client[dst])], minlength=len(client))
    intact = (total > 0) & (2 * kept >= total)
    out = {}
    for (group, _), code in names.items():
        out.setdefault(f"{group}_intact", np.zeros(len(client), dtype=bool))
        out[f"{group}_intact"] |= intact & (clique == code)
    return out


def evaluate_job(cfg, spec: JobSpec, job, tags: dict, diagnostic: dict[str, np.ndarray] | None = None
                 ) -> tuple[list[dict], list[dict]]:
    """(metric rows, client_metrics rows) of every variant a job carries; `diagnostic` adds groups of
    anomalies (name -> member mask) beside the official ones."""
    from icml.methods.fgad.algorithm import weighted_mean

    rows, clients = [], []
    base = {"seed": spec.seed, "K": spec.K, "partition": spec.partition, **tags}
    weights = np.bincount(job.client, minlength=spec.K).astype(float)
    test = job.split == 2
    names = list(job.group_names)
    groups = [("all", job.y > 0)] + [(g, job.group == names.index(g)) for g in names[1:]]
    groups += list((diagnostic or {}).items())
    for variant, key in job_variants(cfg, spec).items():
        scores = job.scores[key]
        tag = {**base, "variant": variant}
        for group, members in groups:
            keep = test & ((job.y == 0) | members)
            per_client = []
            for c in range(spec.K):
                mask = keep & (job.client == c)
                metrics = group_metrics(scores[mask], job.y[mask])
                per_client.append(metrics)
                clients.append({"variant": variant, "seed": spec.seed, "K": spec.K, "partition": spec.partition,
                                "client": c, "n_nodes": int(weights[c]), "n_anom": int(job.y[mask].sum()),
                                "group": group, "auroc": metrics["auroc"], "ap": metrics["ap"]})
            pooled = group_metrics(scores[keep], job.y[keep])
            for metric in ("auroc", "ap", "recall_at_k"):
                rows.append({**tag, "metric": metric, "group": group, "agg": "client_weighted", "split": "test",
                             "value": weighted_mean([m[metric] for m in per_client], weights)})
                rows.append({**tag, "metric": metric, "group": group, "agg": "pooled", "split": "test",
                             "value": pooled[metric]})
        rows.append({**tag, "metric": "val_auroc", "group": "all", "agg": "client_weighted", "split": "val",
                     "value": weighted_mean(job.val_auroc[key], weights)})
        diag = dict(job.diag[key])
        if variant.startswith("central_"):  # one site holds the whole graph: nothing is communicated
            diag.update(comm_bytes_per_round=0.0, comm_bytes_total=0.0)
        diag.update(cut_edge_frac=job.cut_edge_frac, moved_nodes=float(len(job.moves)))
        rows += [{**tag, "metric": m, "value": float(v), "split": "diag"} for m, v in diag.items()]
    return rows, clients


def score_histogram(spec: JobSpec, job) -> list[dict]:
    """Density of mvfgad's fused test scores, normals vs each anomaly group (20 bins on [0, 1])."""
    test = job.split == 2
    names = list(job.group_names)
    edges = np.linspace(0, 1, 21)
    out = []
    for group, members in [("normal", job.y == 0)] + [(g, job.group == names.index(g)) for g in names[1:]]:
        density, _ = np.histogram(job.scores["mvfgad"][test & members], bins=edges, density=True)
        out += [{"variant": "mvfgad", "seed": spec.seed, "K": spec.K, "group": group, "bin": float((lo + hi) / 2),
                 "density": float(d)} for d, lo, hi in zip(density, edges[:-1], edges[1:])]
    return out


def evaluate(ctx: RunContext) -> None:
    import pandas as pd

    cfg = grid_config(ctx)
    jobs = job_grid(cfg)
    histogram_job = JobSpec("mvfgad", max(cfg.K), cfg.seeds[0])
    client_rows, histogram = [], []
    graphs: dict[int, tuple] = {}  # seed -> (edge_index, injection rows), for the *_intact groups
    with ctx.progress("fgad metrics (jobs)", len(jobs)) as advance:
        for spec in jobs:
            job = _load(ctx, spec)
            inject_id = ctx.run.info().get("injection", {}).get("groups_per_seed", {}).get(str(spec.seed), {})
            tags = {"dataset": dataset_name(cfg), "inject_id": inject_id.get("inject_id", "none")}
            if spec.seed not in graphs:
                data, injection, _ = build_graph(cfg, spec.seed)
                graphs[spec.seed] = (data.edge_index.numpy(), injection if data.num_nodes == len(job.client) else [])
            rows, clients = evaluate_job(cfg, spec, job, tags, intact_members(*graphs[spec.seed], job.client))
            ctx.record(rows)
            client_rows += [{"run_id": ctx.run.path.name, **r} for r in clients]
            if spec == histogram_job:
                histogram = score_histogram(spec, job)
            advance(1)
    ctx.write_table("client_metrics", pd.DataFrame(client_rows))
    if histogram:
        ctx.write_table("score_histogram", pd.DataFrame(histogram))

