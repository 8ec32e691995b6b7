"""The gradient-route lifecycle.

train: the baseline (its validation curve every cr.eval_every steps), GRAM and its ablations, one
filtered model per profile, then MaxEnt per profile from the baseline; the power laws of the
compute ratio are fit to the baseline curves (fits.parquet).
eval: every variant × profile is pruned to its deployed model; losses, CRs, the relearning attack on
each forget dataset (elicit.parquet), titration, the all-on profile and the costs.
Independent models train and attack in worker processes; the parent alone records.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_torch_save, load_checkpoint
from icml.cli.workers import run_in_workers

GRAM_VARIANTS = ("gram", "gram_pcr0", "gram_pas0", "gram_uniform_accum", "gram_single_optimizer", "gram_partial")
FILTER_VARIANTS = ("filter", "filter_partial")
PROFILE_MEAN_METRICS = ("core_cr", "retain_cr", "forget_cr", "elicited_cr", "elicit_gain_cr")

_corpus_cache: dict = {}


def corpus_for(cfg, seed: int):
    """The run's corpus, built once per process (workers rebuild it: it is a function of the seed)."""
    from icml.methods.gradient_route.data import build_corpus

    key = (cfg.data, cfg.tokenizer, cfg.model, seed, cfg.gpt.context, cfg.val_windows, cfg.elicit.attack_windows)
    if key not in _corpus_cache:
        _corpus_cache.clear()
        _corpus_cache[key] = build_corpus(cfg, seed)
    return _corpus_cache[key]


def expand_profiles(cfg, corpus) -> list[str]:
    """`all` → core and core + each module (5 profiles for 4 modules); otherwise as listed."""
    if cfg.profiles == ["all"]:
        return ["core"] + [f"core+{a}" for a in corpus.aux]
    for profile in cfg.profiles:
        unknown = [m for m in profile.split("+")[1:] if m not in corpus.aux]
        if unknown:
            raise ValueError(f"profile '{profile}' names unknown module(s) {unknown}; the domains are "
                             f"{', '.join(corpus.aux)}")
    return list(dict.fromkeys(cfg.profiles))


def retained(profile: str, corpus) -> list[str]:
    return list(corpus.aux) if profile == "all" else profile.split("+")[1:]


def checkpoint_path(folder: Path, variant: str, profile: str | None, seed: int) -> Path:
    return folder / f"{variant}{'_' + profile if profile else ''}_s{seed}.pt"


def load_model(path: Path, cfg, corpus, device: str = "cpu"):
    from icml.methods.gradient_route.model import build_model

    if not path.exists():
        raise IcmlError(f"checkpoint {path} is missing", "re-train: icml gradient-route train --resume RUN")
    state = load_checkpoint(path, map_location="cpu")
    model = build_model(cfg, corpus.vocab_size, state["width"], state["aux"], cfg.d_aux, 0)
    model.load_state_dict(state["model"])
    return model.to(device)


def _save(model, path: Path, width: int, aux: list[str]) -> None:
    atomic_torch_save({"model": model.state_dict(), "width": width, "aux": aux}, path)


def _moved(windows: dict, device: str) -> dict:
    return {d: w.to(device) for d, w in windows.items()}


# --- train jobs ----------------------------------------------------------------------------------------
def _val_sets(corpus) -> list[tuple[str, str, object]]:
    """(dataset, split, windows) of every validation set."""
    sets = [(d, "val", w) for d, w in corpus.val.items()]
    return sets + [(d, "val_heldout", w) for d, w in corpus.val_heldout.items()]


def dataset_losses(model, corpus, pad_id: int, route=None, splits=("val", "val_heldout"),
                   datasets=None) -> dict[tuple[str, str], float]:
    """Mean per-token CE per (dataset, split), with the core's topics (t0–t7) as datasets of their own."""
    from icml.methods.gradient_route.training import window_losses

    device = next(model.parameters()).device
    out = {}
    for dataset, split, windows in _val_sets(corpus):
        if split not in splits or (datasets is not None and dataset not in datasets):
            continue
        losses = window_losses(model, windows.to(device), pad_id, route).cpu()
        out[(dataset, split)] = float(losses.mean())
        if dataset == "core" and split == "val" and set(corpus.val_topics) != {"core"}:
            for topic in dict.fromkeys(corpus.val_topics):
                picked = [i for i, t in enumerate(corpus.val_topics) if t == topic]
                out[(topic, "val")] = float(losses[picked].mean())
    return out


def select_crs(model, corpus, fits: dict) -> dict[str, float]:
    """CR of `model` on each dataset's held-apart `select` windows, through the baseline's val fits (the
    select stream is drawn like val, so the same loss → CR map applies)."""
    from icml.methods.gradient_route.training import mean_loss

    device = next(model.parameters()).device
    return {d: _cr(fits, d, "val", mean_loss(model, w.to(device), corpus.pad_id)) for d, w in corpus.select.items()}


def filter_distance(crs: dict[str, float], reference: dict[str, float], keep: list[str], aux: list[str]) -> float:
    """The released code's MaxEnt tuning objective: the mean over the roles core, retain, forget (those
    the profile has) of the mean squared CR difference to the profile's filtered model."""
    by_role: dict[str, list[float]] = {}
    for dataset, cr in crs.items():
        by_role.setdefault(_role(dataset, keep, aux), []).append((cr - reference[dataset]) ** 2)
    return _mean(_mean(errors) for errors in by_role.values())


def train_job(cfg, corpus_seed: int, seed: int, variant: str, profile: str | None, folder: Path,
              device: str, fits: dict | None = None) -> dict:
    """Train one model of a variant (a profile's, for filter/maxent), save it; rows for the parent.
    `fits` (the baseline's power laws) convert a MaxEnt λ sweep's held-apart losses to CRs."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.gradient_route import training as T
    from icml.methods.gradient_route.model import build_model, group_sizes

    started = time.perf_counter()
    corpus = corpus_for(cfg, corpus_seed)
    base = T.baseline_counts(cfg, corpus)
    dense_params = sum(group_sizes(build_model(cfg, corpus.vocab_size, cfg.d_dense, [], cfg.d_aux, seed)).values())
    tags = {"variant": variant, "profile": profile, "seed": seed}
    rows, info = [], {}
    with single_thread():
        if variant == "ft_lora" and profile is not None:  # profile core+d: domain d's LoRA on the core-only base
            from icml.methods.gradient_route.model import add_lora, lora_rank, lora_state

            domain = retained(profile, corpus)[0]
            model = load_model(checkpoint_path(folder, "ft_lora", None, seed), cfg, corpus, device)
            rank = cfg.lora_rank or lora_rank(model, cfg.d_aux)
            lora = add_lora(model, rank, seed * 1000 + corpus.aux.index(domain))
            windows = {"core": corpus.train("core", 2 * base[domain]), domain: corpus.train(domain, base[domain])}
            steps = T.plan(_moved(windows, device), cfg, seed, routed=False, modules=[])
            losses = T.train_steps(model, steps, cfg, corpus.pad_id)
            info["flops"] = T.flops(windows, {"core": dense_params + sum(p.numel() for p in lora)}, 0.0, False)
            info["params"] = sum(p.numel() for p in lora)
            info["rank"] = rank
            if distributed.is_main():
                atomic_torch_save({"lora": lora_state(model), "rank": rank},
                                  checkpoint_path(folder, variant, profile, seed))
        elif variant == "maxent":
            from icml.methods.gradient_route.config import maxent_lambdas

            keep = retained(profile, corpus)
            forget = torch.cat([corpus.train(d, base[d]) for d in corpus.aux if d not in keep]).to(device)
            retain_aux = torch.cat([corpus.train(d, base[d]) for d in keep]).to(device) if keep else None
            retain_core = corpus.train("core", base["core"]).to(device)
            lambdas = maxent_lambdas(cfg)
            start = load_model(checkpoint_path(folder, "baseline", None, seed), cfg, corpus, device)
            if len(lambdas) > 1:
                reference = select_crs(load_model(checkpoint_path(folder, "filter", profile, seed), cfg, corpus,
                                                  device), corpus, fits)
                rows += [{**tags, "variant": "filter", "metric": "maxent_select_cr", "value": cr, "split": "select",
                          "dataset": d, "role": _role(d, keep, corpus.aux)} for d, cr in reference.items()]
            best = None
            for lam in lambdas:
                model = copy.deepcopy(start)
                losses = T.maxent_unlearn(model, forget, retain_core, retain_aux, cfg, corpus.pad_id, seed, lam)
                score = 0.0
                if len(lambdas) > 1:
                    crs = select_crs(model, corpus, fits)
                    score = filter_distance(crs, reference, keep, corpus.aux)
                    rows += [{**tags, "metric": "maxent_select_cr", "value": cr, "split": "select", "dataset": d,
                              "role": _role(d, keep, corpus.aux), "weight": lam} for d, cr in crs.items()]
                    rows.append({**tags, "metric": "maxent_select_score", "value": score, "split": "select",
                                 "weight": lam})
                if best is None or score < best[0]:  # a tie keeps the earlier λ of the grid
                    best = (score, lam, model, losses)
            _, lam, model, losses = best
            rows.append({**tags, "metric": "maxent_lambda", "value": lam, "split": "train"})
            # every candidate of the sweep was trained: its tuning counts in the cost
            tokens = len(lambdas) * 2 * cfg.maxent.steps * cfg.maxent.batch * (corpus.length - 1)  # forget + retain
            info["flops"] = tokens * dense_params
            width, aux = cfg.d_dense, []
        else:  # baseline, GRAM variants, filters, and ft_lora's core-only base
            routed = variant in GRAM_VARIANTS
            width, aux = (cfg.d_core, list(corpus.aux)) if routed else (cfg.d_dense, [])
            model = build_model(cfg, corpus.vocab_size, width, aux, cfg.d_aux, seed).to(device)
            sizes = group_sizes(model)
            p_cr = 0.0 if variant == "gram_pcr0" else cfg.p_cr
            if routed:
                label_frac = cfg.label_frac if variant == "gram_partial" else 1.0
                windows, info["lambda"] = T.gram_windows(cfg, corpus, base, dense_params, sizes,
                                                         label_frac=label_frac, p_cr=p_cr)
            else:
                windows = _dense_windows(variant, profile, corpus, base, cfg)
            steps = T.plan(_moved(windows, device), cfg, seed, routed=routed, modules=aux,
                           window_level=variant == "gram_uniform_accum",
                           p_as=0.0 if variant == "gram_pas0" else None, p_cr=p_cr)
            if routed:
                info["routing_freq"] = T.routing_frequencies(steps)
            info["flops"] = T.flops(windows, sizes, p_cr, routed)
            on_step = None
            if variant == "baseline":
                def on_step(done: int) -> None:
                    if done % cfg.cr.eval_every == 0 or done == len(steps):
                        for (dataset, split), loss in dataset_losses(model, corpus, corpus.pad_id).items():
                            rows.append({**tags, "metric": "val_loss", "value": loss, "step": done, "split": split,
                                         "dataset": dataset})
            losses = T.train_steps(model, steps, cfg, corpus.pad_id,
                                   single_optimizer=variant == "gram_single_optimizer", on_step=on_step)
    if not (variant == "ft_lora" and profile is not None):
        if distributed.is_main():  # under torchrun every rank holds the same weights; rank 0 writes them
            _save(model, checkpoint_path(folder, variant, profile, seed), width, aux)
        info["params"] = sum(p.numel() for p in model.parameters())
    distributed.barrier()  # the next job may read this checkpoint (maxent, ft_lora's LoRAs)
    rows += [{**tags, "metric": "train_loss", "value": loss, "step": i + 1, "split": "train"}
             for i, loss in enumerate(losses)]
    rows.append({**tags, "metric": "wall_s", "value": time.perf_counter() - started, "split": "train"})
    for dataset, freq in info.get("routing_freq", {}).items():
        rows.append({**tags, "metric": "routing_freq", "value": freq, "split": "train", "dataset": dataset})
    info["final_train_loss"] = losses[-1]
    info["dense_params"] = dense_params
    return {"rows": rows, "info": info}


def _dense_windows(variant: str, profile: str | None, corpus, base: dict, cfg) -> dict:
    """Baseline: every domain. Filter: D₁ ∪ R (unlabelled data count as core). filter_partial: also the
    unlabelled (1 − label_frac) share of every forget domain, which filtering cannot see is aux."""
    if variant == "baseline":
        return {d: corpus.train(d, n) for d, n in base.items()}
    keep = [] if variant == "ft_lora" else retained(profile, corpus)  # ft_lora's base: D₁ alone
    windows = {d: corpus.train(d, base[d]) for d in ["core", *keep] + (["unlabelled"] if "unlabelled" in base else [])}
    if variant == "filter_partial":
        import torch

        leaked = []
        for d in corpus.aux:
            if d not in keep:
                pool = corpus.train(d, base[d])
                leaked.append(pool[int(round(base[d] * cfg.label_frac)):])  # gram_partial's unlabelled windows
        windows["unlabelled"] = torch.cat([windows.get("unlabelled", pool[:0]), *leaked])
    return {d: w for d, w in windows.items() if len(w)}


def model_jobs(cfg, profiles: list[str]) -> tuple[list, list]:
    """(variant, profile) of the first wave (independent trainings) and of MaxEnt (needs the baseline)."""
    first, second = [], []
    for variant in cfg.variants:
        if variant in FILTER_VARIANTS:
            first += [(variant, p) for p in profiles]
        elif variant == "maxent":
            second += [(variant, p) for p in profiles]
        elif variant == "ft_lora":  # the core-only base, then a LoRA per domain some profile retains
            first.append((variant, None))
            second += [(variant, f"core+{d}") for d in dict.fromkeys(m for p in profiles for m in p.split("+")[1:])]
        else:
            first.append((variant, None))
    return first, second


def train(ctx: RunContext) -> None:
    from icml.methods.gradient_route.config import maxent_lambdas

    cfg = ctx.config
    try:
        corpus = corpus_for(cfg, ctx.seed)
        profiles = expand_profiles(cfg, corpus)
    except ValueError as exc:
        raise IcmlError(str(exc), "fix the data folder, tokenizer or profiles") from None
    seeds = [ctx.seed + k for k in range(cfg.seeds)]
    folder = distributed.from_main(ctx.checkpoints)  # torchrun: every rank reads rank 0's checkpoints
    ctx.log(f"data: {corpus.source}; vocab {corpus.vocab_size}; domains {', '.join(corpus.domains)}; "
            f"profiles {', '.join(profiles)}; {len(seeds)} seed(s); "
            + (f"{distributed.world_size()} torchrun ranks (data-parallel)" if distributed.launched()
               else f"{cfg.workers} worker(s)"))
    first, second = model_jobs(cfg, profiles)
    recorded = ctx.metrics()
    done_keys = set()
    if not recorded.empty:
        walls = recorded[(recorded["metric"] == "wall_s") & (recorded["split"] == "train")]
        done_keys = {(v, None if p is None or p != p else p, int(s))
                     for v, p, s in zip(walls["variant"], walls["profile"], walls["seed"])}
    infos = dict(_load_infos(ctx))

    def done(key, result) -> None:
        ctx.record(result["rows"])
        infos[key] = result["info"]
        _save_infos(ctx, infos)
        variant, profile, seed = key
        ctx.log(f"  {variant}{' ' + profile if profile else ''} seed {seed}: final train_loss "
                f"{result['info']['final_train_loss']:.3f}")

    for wave in (first, second):
        fits = None
        if wave is second and len(maxent_lambdas(cfg)) > 1 and "maxent" in cfg.variants:
            # the sweep scores MaxEnt in CRs: the baseline (first wave) fixes the fits the eval will use
            fits = distributed.from_main(fits_of(_baseline_fits(ctx)) if distributed.is_main() else None)
        jobs = [((v, p, s), train_job, (cfg, ctx.seed, s, v, p, folder, ctx.device, fits))
                for s in seeds for v, p in wave
                if not ((v, p, s) in done_keys and checkpoint_path(folder, v, p, s).exists())]
        jobs = distributed.from_main(jobs)  # under torchrun: what rank 0's run directory still lacks
        total = len(wave) * len(seeds)
        with ctx.progress("training models", total) as advance:
            advance(total - len(jobs))
            run_in_workers(cfg.workers, jobs, lambda key, result: (done(key, result), advance(1)))
    if distributed.is_main():  # the other ranks lack a resumed run's earlier infos, and write nothing real
        _record_costs(ctx, infos, profiles, seeds)
        _fit_curves(ctx)


def _infos_path(ctx: RunContext) -> Path:
    return ctx.checkpoints / "train_info.json"


def _load_infos(ctx: RunContext):
    import json

    path = _infos_path(ctx)
    if not path.exists():
        return []
    return [((v, p, s), info) for v, p, s, info in json.loads(path.read_text())]


def _save_infos(ctx: RunContext, infos: dict) -> None:
    import json

    from icml.cli.runstore import atomic_write_text

    atomic_write_text(_infos_path(ctx), json.dumps([[*key, info] for key, info in infos.items()]))


def _record_costs(ctx: RunContext, infos: dict, profiles: list[str], seeds: list[int]) -> None:
    """train_flops_ratio (Σ over a variant's models ÷ the baseline's; MaxEnt adds its unlearning to the
    baseline it starts from) and serve_params_ratio (parameters that serve every profile ÷ the baseline's)."""
    cfg = ctx.config
    rows = []
    for seed in seeds:
        base = infos[("baseline", None, seed)]
        for variant in cfg.variants:
            models = [info for (v, _, s), info in infos.items() if v == variant and s == seed]
            spent = sum(m["flops"] for m in models) + (base["flops"] if variant == "maxent" else 0.0)
            served = sum(m["params"] for m in models)
            for metric, value in (("train_flops_ratio", spent / base["flops"]),
                                  ("serve_params_ratio", served / base["params"])):
                rows.append({"variant": variant, "metric": metric, "value": value, "split": "train", "seed": seed})
            if models and "lambda" in models[0]:
                rows.append({"variant": variant, "metric": "compute_lambda", "value": models[0]["lambda"],
                             "split": "train", "seed": seed})
    ctx.record(rows)


def _baseline_fits(ctx: RunContext):
    """One power law per (dataset, split) on the pooled baseline curves; S̄ from the final losses."""
    import pandas as pd

    from icml.methods.gradient_route.cr import fit_power_law, reference_steps

    frame = ctx.metrics()
    curve = frame[(frame["variant"] == "baseline") & (frame["metric"] == "val_loss") & (frame["phase"] == "train")]
    fits = []
    for (dataset, split), group in curve.groupby(["dataset", "split"]):
        law = fit_power_law(group["step"].to_numpy(), group["value"].to_numpy())
        finals = group[group["step"] == group.groupby("seed")["step"].transform("max")]["value"].to_numpy()
        fits.append({"run_id": ctx.run.path.name, "dataset": dataset, "split": split, "a": law.a, "log_a": law.log_a,
                     "alpha": law.alpha, "s0": law.s0, "rmse": law.rmse, "n_points": law.n_points,
                     "s_bar": reference_steps(law, finals)})
    return pd.DataFrame(fits)


def _fit_curves(ctx: RunContext) -> None:
    fits = _baseline_fits(ctx)
    ctx.write_table("fits", fits)
    ctx.record([{"variant": "baseline", "metric": metric, "value": r[column], "split": r["split"],
                 "dataset": r["dataset"]}
                for r in fits.to_dict("records")
                for metric, column in (("fit_alpha", "alpha"), ("fit_a", "a"), ("fit_s0", "s0"), ("fit_rmse", "rmse"))])


# --- eval ------------------------------------------------------------------------------------------------
def fits_of(table) -> dict:
    """{(dataset, split): (PowerLaw, S̄)} of a fits table."""
    from icml.methods.gradient_route.cr import PowerLaw

    return {(r.dataset, r.split): (PowerLaw(r.log_a, r.alpha, r.s0, r.rmse, int(r.n_points)), r.s_bar)
            for r in table.itertuples()}


def read_fits(run) -> dict:
    return fits_of(run.table("fits"))


def _cr(fits: dict, dataset: str, split: str, loss: float) -> float:
    from icml.methods.gradient_route.cr import compute_ratio

    law, s_bar = fits[(dataset, split)]
    return float(compute_ratio(law, s_bar, loss))


def _role(dataset: str, keep: list[str], aux: list[str]) -> str:
    return "retain" if dataset in keep else "forget" if dataset in aux else "core"


def deployed_model(cfg, corpus, folder: Path, variant: str, profile: str, seed: int, device: str):
    """The model that serves a profile: GRAM with the other modules deleted; the profile's own filtered or
    MaxEnt model; the dense baseline as it is."""
    from icml.methods.gradient_route.model import deploy

    if variant in GRAM_VARIANTS:
        return deploy(load_model(checkpoint_path(folder, variant, None, seed), cfg, corpus, device),
                      retained(profile, corpus))
    if variant == "ft_lora":
        import torch

        from icml.methods.gradient_route.model import merge_lora

        model = load_model(checkpoint_path(folder, variant, None, seed), cfg, corpus, device)
        paths = [checkpoint_path(folder, variant, f"core+{d}", seed) for d in retained(profile, corpus)]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise IcmlError(f"LoRA checkpoint(s) {', '.join(missing)} missing",
                            "re-train with this profile: icml gradient-route train --set profiles=…")
        return merge_lora(model, [load_checkpoint(p, map_location="cpu")["lora"] for p in paths])
    if variant in FILTER_VARIANTS or variant == "maxent":
        return load_model(checkpoint_path(folder, variant, profile, seed), cfg, corpus, device)
    return load_model(checkpoint_path(folder, "baseline", None, seed), cfg, corpus, device)


def eval_job(cfg, corpus_seed: int, seed: int, variant: str, profile: str, folder: Path, fits: dict,
             device: str) -> dict:
    """Losses and CRs of one deployed profile, the attack on each forget dataset; for GRAM's `all`
    job, the all-on profile and the titration curve."""
    from icml.cli.threads import single_thread
    from icml.methods.gradient_route.model import deploy
    from icml.methods.gradient_route.training import elicit, mean_loss

    started = time.perf_counter()
    corpus = corpus_for(cfg, corpus_seed)
    tags = {"variant": variant, "profile": profile, "seed": seed}
    rows, elicit_rows = [], []
    with single_thread():
        model = deployed_model(cfg, corpus, folder, variant, profile, seed, device)
        keep = retained(profile, corpus)
        forget = [d for d in corpus.aux if d not in keep]
        losses = dataset_losses(model, corpus, corpus.pad_id)
        crs = {}
        for (dataset, split), loss in losses.items():
            role = _role(dataset, keep, corpus.aux)
            crs[(dataset, split)] = cr = _cr(fits, dataset, split, loss)
            rows += [{**tags, "metric": "val_loss", "value": loss, "split": split, "dataset": dataset, "role": role},
                     {**tags, "metric": "cr", "value": cr, "split": split, "dataset": dataset, "role": role}]
        rows.append({**tags, "metric": "core_cr", "value": crs[("core", "val")], "split": "val"})
        if keep:
            rows.append({**tags, "metric": "retain_cr", "value": _mean(crs[(d, "val")] for d in keep), "split": "val"})
        if forget:
            for split in ("val", "val_heldout"):
                rows.append({**tags, "metric": "forget_cr", "value": _mean(crs[(d, split)] for d in forget),
                             "split": split})
        if forget and variant != "baseline" and variant in cfg.elicit.variants:
            elicited = []
            for dataset in forget:
                best = float("inf")
                for divisor in dict.fromkeys([cfg.elicit.lr_divisor, *cfg.elicit.extra_lr_divisors]):
                    curve = elicit(model, corpus.attack[dataset].to(device), corpus.val_heldout[dataset].to(device),
                                   cfg, corpus.pad_id, divisor)
                    elicit_rows += [{"variant": variant, "profile": profile, "dataset": dataset, "round": r,
                                     "split": "val_heldout", "loss": loss, "seed": seed, "lr_divisor": divisor}
                                    for r, loss in enumerate(curve)]
                    best = min(best, min(curve[1:]))  # the minimum over lrs and rounds 1..R, not the last
                elicited.append(_cr(fits, dataset, "val_heldout", best))
                rows.append({**tags, "metric": "elicited_loss", "value": best, "split": "val_heldout",
                             "dataset": dataset, "role": "forget"})
            rows += [{**tags, "metric": "elicited_cr", "value": _mean(elicited), "split": "val_heldout"},
                     {**tags, "metric": "elicit_gain_cr",
                      "value": _mean(elicited) - _mean(crs[(d, "val_heldout")] for d in forget), "split": "val_heldout"}]
        if variant == "gram" and profile == "all" and cfg.titration.module in corpus.aux:
            module = cfg.titration.module
            served = deploy(model, [module])
            for weight in cfg.titration.weights:
                for dataset in (module, "core"):
                    loss = mean_loss(served, corpus.val[dataset].to(device), corpus.pad_id, route={module: weight})
                    rows.append({**tags, "profile": f"core+{module}", "metric": "titration_cr", "split": "val",
                                 "value": _cr(fits, dataset, "val", loss), "dataset": dataset, "weight": weight})
    rows.append({**tags, "metric": "wall_s", "value": time.perf_counter() - started, "split": "eval"})
    return {"rows": rows, "elicit": elicit_rows}


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")


def evaluate(ctx: RunContext) -> None:
    import pandas as pd

    cfg = ctx.config
    corpus = corpus_for(cfg, ctx.seed)
    profiles = expand_profiles(cfg, corpus)
    seeds = [ctx.seed + k for k in range(cfg.seeds)]
    try:
        fits = read_fits(ctx.run)
    except IcmlError:
        raise IcmlError(f"fits.parquet of {ctx.run.path} is missing",
                        f"re-train: icml gradient-route train --resume {ctx.run.path}") from None
    jobs = []
    for seed in seeds:
        for variant in cfg.variants:
            extra = ["all"] if variant in GRAM_VARIANTS else []
            for profile in profiles + extra:
                jobs.append(((variant, profile, seed), eval_job,
                             (cfg, ctx.seed, seed, variant, profile, ctx.checkpoints, fits, ctx.device)))
    rows, elicit_rows = [], []

    def done(key, result) -> None:
        rows.extend(result["rows"])
        elicit_rows.extend(result["elicit"])

    with ctx.progress("deployed profiles (losses, CR, attacks)", len(jobs)) as advance:
        run_in_workers(cfg.workers, jobs, lambda key, result: (done(key, result), advance(1)))
    rows += profile_means(rows)
    ctx.record(rows)
    frame = pd.DataFrame(elicit_rows, columns=["variant", "profile", "dataset", "round", "split", "loss", "seed",
                                               "lr_divisor"])
    ctx.write_table("elicit", frame.assign(run_id=ctx.run.path.name))


def profile_means(rows: list[dict]) -> list[dict]:
    """profile=mean: each CR summary averaged over the profiles of a (variant, seed, split); the all-on
    profile is reported on its own."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    picked = frame[frame["metric"].isin(PROFILE_MEAN_METRICS) & (frame["profile"] != "all")]
    means = picked.groupby(["variant", "seed", "split", "metric"])["value"].mean().reset_index()
    return [{**r, "profile": "mean"} for r in means.to_dict("records")]
