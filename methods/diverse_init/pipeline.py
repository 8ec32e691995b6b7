"""The diverse-init lifecycle.

train: per tier (gmm, digits) × parameterisation (eps, flow) a class-conditional denoiser with label
       dropout, saved with save_pretrained (scheduler config beside it); the digits feature classifier.
eval:  per tier × param: calibrate τ*, then every arm of the grid from the same per-sample seeds →
       metrics.parquet (spec names), gmm_samples.parquet, z_norms.parquet, digits sample grids.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext

TIER_ID = {"gmm": 0, "digits": 1}
DIVIN_ARMS = {"divin": (True, True), "divin_no_noise": (True, False), "divin_no_prior": (False, True),
              "divin_cads": (True, True), "divin_ig": (True, True), "divin_pg": (True, True),
              "divin_exact": (True, True)}
ORACLE = "divin_exact"  # GMM eps control: DivIn on the exact potential of the true mixture, then the learned sampler
GRID_PER_CLASS = 4  # digits images kept per class and arm for the report's sample grids


def checkpoint_dir(run_path: Path, tier: str, param: str) -> Path:
    return Path(run_path) / "checkpoints" / f"{tier}_{param}"


# train ---------------------------------------------------------------------------------------------
def train(ctx: RunContext) -> None:
    """Independent jobs (tier × param denoisers, the classifier) in `workers` processes; the parent records.
    A job whose checkpoint is complete is skipped, so --resume continues an interrupted run."""
    from icml.cli.workers import run_in_workers

    cfg = ctx.config
    if cfg.paper.enabled:
        raise IcmlError("the paper preset is documented, not run by this workbench (it needs a GPU, a local "
                        "Stable Diffusion pipeline and user-supplied DINOv2/Inception features)",
                        "see methods/diverse_init/README.md; call icml.methods.diverse_init.paper.divin_latents "
                        "from your own script")
    if cfg.model and "digits" in cfg.tiers:
        _check_user_model(cfg)
    path = str(ctx.run.path)
    jobs = [((tier, param), train_denoiser_job, (path, cfg, tier, param, ctx.seed))
            for tier in sorted(cfg.tiers, key=lambda t: t != "digits") for param in cfg.params  # longest first
            if not (tier == "digits" and cfg.model)
            and not (checkpoint_dir(path, tier, param) / "scheduler_config.json").is_file()]
    if "digits" in cfg.tiers and not (ctx.checkpoints / "classifier.pt").is_file():
        jobs.append((("digits", "classifier"), train_classifier_job, (path, cfg, ctx.seed)))
    results = {}
    with ctx.progress(f"train ({len(jobs)} jobs, {cfg.workers} workers)", len(jobs)) as advance:
        def done(key, result):
            results[key] = result
            ctx.record(result["rows"], split=result["split"])  # at once: an interrupted run keeps them
            ctx.log(result["message"])
            advance(1)

        run_in_workers(cfg.workers, jobs, done)


def train_denoiser_job(run_path: str, cfg, tier: str, param: str, run_seed: int) -> dict:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.diverse_init import data, model

    sched = model.make_scheduler(param, cfg.beta_schedule, cfg.train_timesteps)
    seed = run_seed * 100 + 10 * TIER_ID[tier] + (param == "flow")
    with single_thread():  # small tensors: a second thread only waits at barriers (cli/threads.py)
        if tier == "gmm":
            points, labels, _ = data.gmm_sample(cfg.gmm.n_train // data.GMM_CLASSES, cfg.gmm.sigma, seed)
            x, y = torch.tensor(points, dtype=torch.float32), torch.as_tensor(labels)
            net, section, null = model.build_gmm(cfg.gmm.hidden, seed), cfg.gmm, data.GMM_CLASSES
        else:
            x, y = data.digits_tier(run_seed, cfg.data)["train"]
            net, section = model.build_unet(cfg.digits.block_out_channels, seed), cfg.digits
            null = model.DIGIT_CLASSES
        rows, every = [], max(1, section.steps // 20)

        def on_step(step, loss):
            if step % every == 0 or step == section.steps - 1:
                rows.append({"metric": "loss", "value": loss, "variant": "denoiser", "step": step + 1,
                             "tier": tier, "param": param})

        started = time.perf_counter()
        model.train_denoiser(net, sched, param, x, y, null=null, steps=section.steps, batch_size=section.batch_size,
                             lr=section.lr, label_dropout=cfg.label_dropout, seed=seed + 1, on_step=on_step)
        model.save_checkpoint(net, sched, checkpoint_dir(run_path, tier, param))
    return {"rows": rows, "split": "train",
            "message": f"{tier} {param}: loss {rows[-1]['value']:.4f} after {section.steps} steps "
                       f"({time.perf_counter() - started:.0f} s)"}


def train_classifier_job(run_path: str, cfg, run_seed: int) -> dict:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.diverse_init import data, model

    with single_thread():
        split = data.digits_tier(run_seed, cfg.data)
        clf = model.train_classifier(*split["train"], steps=cfg.digits.clf_steps, seed=run_seed + 7)
        with torch.no_grad():
            images, labels = split["ref"]
            acc = float((clf(images).argmax(1) == labels).float().mean())
        torch.save(clf.state_dict(), Path(run_path) / "checkpoints" / "classifier.pt")
    return {"rows": [{"metric": "clf_acc", "value": acc, "variant": "classifier", "tier": "digits",
                      "feature_space": "clf"}], "split": "heldout",
            "message": f"feature classifier held-out accuracy {acc:.3f}"}


def _check_user_model(cfg) -> None:
    """What the run cannot use is refused (`check_inputs`); an unconditional model runs, with a warning."""
    from icml.methods.diverse_init.config import check_checkpoint, check_inputs

    check_inputs(cfg)  # again: --resume skips the lifecycle's check, and the directory may have changed since
    if check_checkpoint(cfg.model, cfg.null_class).null is None:
        from icml.cli import console

        console.say(f"warning: model '{cfg.model}' is unconditional (no num_class_embeds): U ≡ 0, DivIn = prior "
                    "Langevin only", style="bold yellow")


# eval ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arm:
    variant: str
    cfg_scale: float
    tau: float = math.nan
    k_steps: int = 0
    eta: float = math.nan
    tau_frac: float = math.nan  # τ/τ* (τ* of the potential the arm uses)

    @property
    def traj(self) -> str:
        for name in ("cads", "ig", "pg"):
            if self.variant.endswith(name):
                return name
        return "none"


def load_tier(run_path: Path, cfg, tier: str, param: str):
    """(Denoiser, diffusers scheduler, param) of a trained tier — or of --model for the digits tier."""
    from icml.methods.diverse_init.divin import Denoiser
    from icml.methods.diverse_init.model import load_checkpoint

    path = cfg.model if tier == "digits" and cfg.model else checkpoint_dir(run_path, tier, param)
    if not cfg.model or tier == "gmm":
        if not (Path(path) / "config.json").is_file():
            raise IcmlError(f"checkpoint {path} is missing", "re-train: icml diverse-init train")
    net, scheduler, found, null, conditional = load_checkpoint(path, cfg.null_class)
    return Denoiser(net, null, conditional), scheduler, found


def default_tau(cfg, tau_star: float) -> float:
    """The divin arm's τ: `divin.tau` if set, else `divin.tau_frac`·τ*."""
    return cfg.divin.tau if cfg.divin.tau is not None else cfg.divin.tau_frac * tau_star


def tau_sweep(cfg, tau_star: float) -> list[float]:
    """The τ sweep: `divin.tau_grid` if set, else τ*·`divin.tau_fracs` (by default up to 8τ*: the one
    Langevin step's pull ητ∇U is only √(η/2) ≈ 16 % of its noise √(2η)ξ at τ*, so τ* alone cannot show
    where the pull starts to matter)."""
    return list(cfg.divin.tau_grid) if cfg.divin.tau_grid is not None else [f * tau_star for f in cfg.divin.tau_fracs]


def arms_for(cfg, tier: str, tau_star: float, exact_tau_star: float | None = None) -> list[Arm]:
    """The grid of one tier × param. `exact_tau_star` (GMM eps): τ* of the exact potential, which adds the
    oracle control `divin_exact` over the same τ/τ* sweep at `main_cfg`."""
    section = getattr(cfg, tier)
    eta, k = cfg.divin.eta, cfg.divin.k_steps
    tau = default_tau(cfg, tau_star)

    def frac(t, star=tau_star):
        return t / star if star > 0 else math.nan

    def arm(variant, w, tau_=tau, k_=k):
        if variant in DIVIN_ARMS:
            return Arm(variant, w, tau_, k_, eta, frac(tau_))
        return Arm(variant, w)

    arms = []
    for w in section.cfg_scales:
        every = tier == "gmm" or w == cfg.main_cfg
        arms += [arm(v, w) for v in cfg.variants if every or v in ("base", "divin")]
    if "divin" in cfg.variants and (tier == "gmm" or cfg.digits.tau_sweep):
        arms += [arm("divin", cfg.main_cfg, t) for t in tau_sweep(cfg, tau_star) if not math.isclose(t, tau)]
    for k_extra in section.k_steps:
        if k_extra != k:
            arms += [arm(v, cfg.main_cfg, k_=k_extra) for v in ("divin", "divin_no_prior") if v in cfg.variants]
    if exact_tau_star:  # the same multiples of its own τ*; τ = 0 is divin's τ = 0 arm
        fracs = sorted({cfg.divin.tau_frac, *cfg.divin.tau_fracs} - {0.0})
        arms += [Arm(ORACLE, cfg.main_cfg, f * exact_tau_star, k, eta, f) for f in fracs]
    return arms


def trajectory(cfg, names) -> "divin.Trajectory":
    from icml.methods.diverse_init import divin

    return divin.Trajectory(cads="cads" in names, ig="ig" in names, pg="pg" in names, cads_tau1=cfg.cads.tau1,
                            cads_tau2=cfg.cads.tau2, cads_s=cfg.cads.s, ig_lo=cfg.ig.lo, ig_hi=cfg.ig.hi,
                            pg_coeff=cfg.pg.coeff, pg_ref_dim=cfg.pg.ref_dim, pg_particles=cfg.pg.particles,
                            pg_sigma_max=cfg.pg.sigma_max)


def initialise(den, sched, arm: Arm, z, labels, seeds, cfg, exact=None):
    """The arm's initial noise: DivIn or an ablation (Langevin; `divin_exact` on the `exact` denoiser's
    potential), SAIL (Adam with restarts), or z itself."""
    import torch

    from icml.methods.diverse_init import divin

    if arm.variant in DIVIN_ARMS:
        prior, noise = DIVIN_ARMS[arm.variant]
        potential_den = exact if arm.variant == ORACLE else den
        return divin.divin_init(potential_den, sched, z, labels, seeds, tau=arm.tau, eta=arm.eta,
                                k_steps=arm.k_steps, prior=prior, noise=noise, kind=cfg.divin.potential)
    if arm.variant == "sail":
        s = cfg.sail
        return divin.sail_init(den, sched, z, labels, seeds, lr=s.lr, steps=s.steps, restarts=s.restarts,
                               threshold=s.threshold, rise=s.rise, z_weight=s.z_weight)
    return divin.Init(z, nfe=torch.zeros(len(z)))


def run_arm(den, sched, arm: Arm, z, labels, seeds, cfg, exact=None) -> dict:
    """One arm: initialisation → the untouched sampler, timed together; then the diagnostics (U of the
    learned model for every arm, the oracle's included)."""
    import torch

    from icml.methods.diverse_init import divin

    started = time.perf_counter()
    init = initialise(den, sched, arm, z, labels, seeds, cfg, exact)
    x = divin.sample(den, sched, init.z, labels, arm.cfg_scale, trajectory(cfg, [arm.traj]), seeds)
    wall = time.perf_counter() - started
    with torch.no_grad():  # diagnostics, outside the timing
        u_after = divin.potential(den, sched, init.z, labels, cfg.divin.potential)
        learned_before = init.u_before is not None and arm.variant != ORACLE  # the oracle's own is the exact U
        u_before = init.u_before if learned_before else divin.potential(den, sched, z, labels, cfg.divin.potential)
    d = z[0].numel()
    return {"x": x.detach().double().numpy(), "u_before": float(u_before.mean()), "u_after": float(u_after.mean()),
            "force_ratio": float(init.force_ratio.mean()) if init.force_ratio is not None else math.nan,
            "pull_noise_ratio": float(init.pull_noise.mean()) if init.pull_noise is not None else math.nan,
            "z_norm": (init.z.flatten(1).norm(dim=1) / math.sqrt(d)).double().numpy(),
            "nfe": float(init.nfe.mean()) + sched.steps, "wall_s": wall / len(z)}


@dataclass
class TierEval:
    """What a tier needs to score one arm's samples: reference features, feature map, kernel."""

    tier: str
    real: np.ndarray
    featurize: callable = None
    classify: callable = None
    real_radii: np.ndarray | None = None


def score(tier_eval: TierEval, x: np.ndarray, labels: np.ndarray, cfg) -> list[tuple[str, str, float]]:
    """(metric, feature_space, value) for one arm's samples."""
    from icml.methods.diverse_init import metrics as M

    rows = []
    if tier_eval.tier == "gmm":
        feats, space = x, "coord"
        rows += [(m, space, v) for m, v in M.gmm_metrics(x, labels, cfg.gmm.sigma).items()]
        rows.append(("vendi", space, M.per_class(feats, labels, lambda f: M.vendi(f, "rbf", 0.1))))
    else:
        feats, space = tier_eval.featurize(x), "clf"
        rows.append(("cond_acc", space, float((tier_eval.classify(x) == labels).mean())))
        rows.append(("vendi", space, M.per_class(feats, labels, M.vendi)))
        pixels = x.reshape(len(x), -1)
        rows.append(("vendi", "pixel", M.per_class(pixels, labels, M.vendi)))
        rows.append(("inbatch_sim", "pixel", M.per_class(pixels, labels, M.inbatch_sim)))
    rows.append(("inbatch_sim", space, M.per_class(feats, labels, M.inbatch_sim)))
    if tier_eval.real_radii is None:
        tier_eval.real_radii = M.knn_radii(tier_eval.real, 5)  # once per reference set
    rows += [(m, space, v) for m, v in M.prdc(tier_eval.real, feats, k=5, real_radii=tier_eval.real_radii).items()]
    rows.append(("fid", space, M.fid(tier_eval.real, feats)))
    return rows


def _digits_eval(run_path: Path, cfg, seed: int) -> TierEval:
    import torch

    from icml.methods.diverse_init import data
    from icml.methods.diverse_init.model import FeatureCNN

    path = Path(run_path) / "checkpoints" / "classifier.pt"
    if not path.is_file():
        raise IcmlError(f"{path} is missing", "re-train: icml diverse-init train")
    clf = FeatureCNN()
    clf.load_state_dict(torch.load(path, weights_only=True))
    clf.eval().requires_grad_(False)

    def as_images(x):
        return torch.tensor(np.clip(x, -1, 1), dtype=torch.float32)

    def featurize(x):
        with torch.no_grad():
            return clf.features(as_images(x)).double().numpy()

    def classify(x):
        with torch.no_grad():
            return clf(as_images(x)).argmax(1).numpy()

    images, _ = data.digits_tier(seed, cfg.data)["ref"]
    return TierEval("digits", featurize(images.numpy()), featurize, classify)


def evaluate(ctx: RunContext) -> None:
    """One job per tier × param (in `workers` processes); rows are recorded in job order, so the metrics
    do not depend on which worker finished first."""
    from icml.cli.workers import run_in_workers

    cfg = ctx.config
    keys = [(tier, param) for tier in sorted(cfg.tiers, key=lambda t: t != "digits") for param in cfg.params
            if not (tier == "digits" and cfg.model and param != cfg.params[0])]  # one user model, one param
    jobs = [(key, eval_job, (str(ctx.run.path), cfg, *key, ctx.seed)) for key in keys]
    results = {}
    with ctx.progress(f"eval ({len(jobs)} jobs, {cfg.workers} workers)", len(jobs)) as advance:
        def done(key, result):
            results[key] = result
            ctx.log(result["message"])
            advance(1)

        run_in_workers(cfg.workers, jobs, done)
    gmm, znorm, grids = [], [], {}
    for key in keys:
        result = results[key]
        ctx.record(result["rows"])
        gmm += result["gmm"]
        znorm += result["znorm"]
        grids.update(result["grids"])
    if gmm:
        ctx.write_table("gmm_samples", pd.concat(gmm, ignore_index=True))
    if znorm:
        ctx.write_table("z_norms", pd.DataFrame(znorm))
    if grids:
        np.savez_compressed(ctx.checkpoints / "digits_samples.npz", **grids)


def eval_job(run_path: str, cfg, tier: str, param: str, run_seed: int) -> dict:
    """Every arm of one tier × param from shared per-sample seeds: metric rows and the per-sample tables."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.diverse_init import data, divin

    from threadpoolctl import threadpool_limits

    section = getattr(cfg, tier)
    out = {"rows": [], "gmm": [], "znorm": [], "grids": {}}
    with single_thread(), threadpool_limits(1):  # one BLAS thread too: the jobs run in parallel
        if tier == "gmm":
            ref, _, _ = data.gmm_sample(cfg.gmm.n_ref // data.GMM_CLASSES, cfg.gmm.sigma, run_seed * 100 + 99)
            tier_eval, n_classes, shape, n_seeds = TierEval("gmm", ref), data.GMM_CLASSES, (2,), cfg.gmm.seeds
        else:
            tier_eval, n_classes, shape, n_seeds = _digits_eval(run_path, cfg, run_seed), 10, (1, 16, 16), 1
        labels_np = np.repeat(np.arange(n_classes), section.n_per_class)
        labels = torch.as_tensor(labels_np)
        den, scheduler, found = load_tier(run_path, cfg, tier, param)
        sched = divin.Schedule(scheduler, found, section.sample_steps)
        calib = [divin.sample_seed(run_seed, 9_999, TIER_ID[tier], i) for i in range(cfg.divin.calib_noises)]
        calib_z, calib_labels = divin.initial_noise(calib, shape), torch.arange(cfg.divin.calib_noises) % n_classes
        tau_star = divin.calibrate_tau(den, sched, calib_z, calib_labels, cfg.divin.potential)
        tau = default_tau(cfg, tau_star)
        exact = exact_gmm(cfg, sched) if tier == "gmm" and found == "eps" and cfg.gmm.oracle else None
        exact_tau_star = exact and divin.calibrate_tau(exact, sched, calib_z, calib_labels, cfg.divin.potential)
        arms = arms_for(cfg, tier, tau_star, exact_tau_star)
        tags = {"tier": tier, "param": found, "n_per_class": section.n_per_class}
        out["rows"].append({"metric": "tau_star", "value": tau_star, "variant": "divin", "tau": tau,
                            "tau_frac": tau / tau_star if tau_star > 0 else math.nan, **tags})
        if exact:
            out["rows"].append({"metric": "tau_star", "value": exact_tau_star, "variant": ORACLE, **tags,
                                "tau": cfg.divin.tau_frac * exact_tau_star, "tau_frac": cfg.divin.tau_frac})
        started = time.perf_counter()
        for s in range(n_seeds):
            seeds = [divin.sample_seed(run_seed, s, TIER_ID[tier], int(c), i % section.n_per_class)
                     for i, c in enumerate(labels_np)]
            z = divin.initial_noise(seeds, shape)
            if exact:
                cos = gradient_agreement(den, exact, sched, z, labels, cfg)
                out["rows"].append({"metric": "grad_cos_exact", "value": cos, "feature_space": "init",
                                    "variant": "divin", "seed": run_seed + s, **tags})
            for arm in arms:
                result = run_arm(den, sched, arm, z, labels, seeds, cfg, exact)
                row_tags = {**tags, "variant": arm.variant, "cfg_scale": arm.cfg_scale, "tau": arm.tau,
                            "tau_frac": arm.tau_frac, "eta": arm.eta, "k_steps": arm.k_steps, "traj": arm.traj,
                            "seed": run_seed + s}
                out["rows"] += [{"metric": m, "value": v, "feature_space": fs, **row_tags}
                                for m, fs, v in score(tier_eval, result["x"], labels_np, cfg)]
                out["rows"] += [{"metric": m, "value": result[m], "feature_space": "init", **row_tags}
                                for m in ("u_before", "u_after", "force_ratio", "pull_noise_ratio", "nfe", "wall_s")]
                out["rows"].append({"metric": "z_norm_ratio", "value": float(result["z_norm"].mean()),
                                    "feature_space": "init", **row_tags})
                if s == 0:
                    _keep(arm, tau, tier, found, result, labels_np, cfg, Path(run_path).name, run_seed, out)
    out["message"] = (f"{tier} {found}: τ* = {tau_star:.4g} (divin τ = {tau:.4g}), {len(arms)} arms × {n_seeds} "
                      f"seeds × {len(labels)} samples, first timestep {float(sched.timesteps[0]):g}, "
                      f"{time.perf_counter() - started:.0f} s")
    return out


def exact_gmm(cfg, sched):
    """The exact denoiser of the spec's GMM on the sampler's schedule (float64), as a `Denoiser`."""
    from icml.methods.diverse_init import data, divin
    from icml.methods.diverse_init.model import ExactGmmDenoiser

    return divin.Denoiser(ExactGmmDenoiser(sched.scheduler, sched.param, cfg.gmm.sigma), null=data.GMM_CLASSES)


def gradient_agreement(den, exact, sched, z, labels, cfg) -> float:
    """Mean cosine between the learned model's ∇U and the exact mixture's ∇U at the same noises: does the
    learned potential push z where the true one does?"""
    import torch

    from icml.methods.diverse_init import divin

    _, learned = divin.potential_grad(den, sched, z, labels, cfg.divin.potential)
    _, true = divin.potential_grad(exact, sched, z, labels, cfg.divin.potential)
    return float(torch.nn.functional.cosine_similarity(learned.flatten(1).double(), true.flatten(1), dim=1).mean())


def _keep(arm: Arm, tau: float, tier, param, out, labels, cfg, run_id: str, seed: int, tables: dict) -> None:
    """The per-sample tables of the first sampling seed: GMM points, ‖z‖/√d, digits sample grids."""
    from icml.methods.diverse_init import data

    if tier == "gmm":
        component, dist = data.nearest_component(out["x"])
        tables["gmm"].append(pd.DataFrame({
            "run_id": run_id, "variant": arm.variant, "param": param, "cfg_scale": arm.cfg_scale,
            "tau": arm.tau, "k_steps": arm.k_steps, "seed": seed, "class_id": labels,
            "x": out["x"][:, 0], "y": out["x"][:, 1], "component": component,
            "in_3sigma": dist <= 3 * cfg.gmm.sigma}))
    main = arm.cfg_scale == cfg.main_cfg
    at_default_tau = math.isnan(arm.tau) or arm.tau == tau  # not a τ-sweep point
    if main and arm.variant in ("base", "divin", "divin_no_prior") and at_default_tau:
        tables["znorm"] += [{"tier": tier, "param": param, "variant": arm.variant, "k_steps": arm.k_steps, "z_norm": float(v)}
                       for v in out["z_norm"]]
    if tier == "digits" and main and arm.k_steps in (0, cfg.divin.k_steps) and at_default_tau:
        keep = np.concatenate([np.flatnonzero(labels == c)[:GRID_PER_CLASS] for c in np.unique(labels)])
        tables["grids"][f"{param}/{arm.variant}"] = out["x"][keep].astype(np.float32)


# the generate verb ------------------------------------------------------------------------------------
def generate(run_path: Path | None, cfg, *, class_id: int, n: int, variant: str, tau: float | None,
             cfg_scale: float, traj: list[str], param: str, steps: int, seed: int, out: Path) -> dict:
    """n samples of one class → an image grid (PNG) and the raw samples (.npy beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from icml.methods.diverse_init import divin

    den, scheduler, found = load_tier(run_path, cfg, "digits", param)
    n_classes = (den.model.config.num_class_embeds - 1) if den.conditional else 1
    if den.conditional and not 0 <= class_id < n_classes:
        raise IcmlError(f"--class {class_id} is outside the model's classes 0–{n_classes - 1}", "pick a valid class")
    shape = (den.model.config.in_channels, den.model.config.sample_size, den.model.config.sample_size)
    sched = divin.Schedule(scheduler, found, steps)
    seeds = [divin.sample_seed(seed, 7_777, class_id, i) for i in range(n)]
    z = divin.initial_noise(seeds, shape)
    labels = torch.full((n,), class_id, dtype=torch.long)
    if tau is None:
        tau = cfg.divin.tau_frac * divin.calibrate_tau(den, sched, z, labels, cfg.divin.potential)
    arm = Arm(variant, cfg_scale, tau, cfg.divin.k_steps, cfg.divin.eta) if variant in DIVIN_ARMS else Arm(variant, cfg_scale)
    init = initialise(den, sched, arm, z, labels, seeds, cfg)
    result = divin.sample(den, sched, init.z, labels, cfg_scale, trajectory(cfg, traj), seeds)
    x = result.clamp(-1, 1).numpy()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    npy = out.with_suffix(".npy")
    np.save(npy, x)
    cols = int(math.ceil(math.sqrt(n)))
    rows_ = int(math.ceil(n / cols))
    canvas = np.ones((rows_ * shape[1], cols * shape[2], shape[0]))
    for i, img in enumerate((x + 1) / 2):
        r, c = divmod(i, cols)
        canvas[r * shape[1]:(r + 1) * shape[1], c * shape[2]:(c + 1) * shape[2]] = img.transpose(1, 2, 0)
    plt.imsave(out, canvas[..., 0] if shape[0] == 1 else canvas[..., :3], cmap="gray" if shape[0] == 1 else None)
    return {"png": str(out), "npy": str(npy), "n": n, "class": class_id, "variant": variant, "traj": traj,
            "tau": float(tau), "cfg_scale": cfg_scale, "param": found}
