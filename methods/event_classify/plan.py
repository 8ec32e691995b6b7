"""`icml event-classify plan`: one training step of every network the preset trains (SECNet, then the baselines
and ablations `eval` trains) and one test batch of SECNet, at the preset's sizes, on the meta device
(cli/plan.py). Every training is an independent job: one process, one GPU, the whole batch.

The data are DVS Gesture's shape, the largest of the paper's sets: a 128 × 128 sensor (the frame baselines
rasterise it to 64 × 64) and 11 classes. Ablations whose network is SECNet's at the same sizes are not planned
again (`SAME_AS_SECNET`: fixed w, FPS centroids, coordinate KNN and the two input ablations change no tensor's
shape beyond the KNN's 3 coordinates for its feature width). The plan costs ~25 s of one core: the
farthest-point sampling loops over every centroid, op by op on the meta device. `fit`'s loss and accuracy bookkeeping (float, int) is left out."""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.event_classify.config import CNN_VARIANTS, POINT_VARIANTS
from icml.methods.event_classify.model import Arch, build_model
from icml.methods.event_classify.training import Budget, train_step

LAYOUT = "one process and one GPU per training (variant × dataset), the whole batch"
OVERSIZE = ["batch_size=20000"]
SENSOR = (128, 128)  # DVS Gesture
CLASSES = 11
PREDICT_BATCH = 64  # training.predict's
SAME_AS_SECNET = ("secnet_coord_knn", "secnet_fixed_w", "secnet_fps_centroid", "secnet_no_polarity", "secnet_no_pt")


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _jobs(cfg) -> list[tuple[str, Budget]]:
    """(variant, budget) of every distinct network: train's SECNet, eval's CNNs (main budget) and point models
    (compare budget), as pipeline.evaluate lists them."""
    dataset = cfg.datasets[0]
    jobs = [("secnet", Budget.of(cfg, "main", dataset))]
    jobs += [(v, Budget.of(cfg, "main", dataset)) for v in cfg.variants if v in CNN_VARIANTS]
    if cfg.compare.datasets:
        jobs += [(v, Budget.of(cfg, "compare", dataset)) for v in POINT_VARIANTS
                 if v in cfg.variants or v == "secnet"]
    seen, out = set(), []
    for variant, budget in jobs:
        key = ("secnet" if variant in SAME_AS_SECNET else variant, budget.n_points, budget.groups, budget.k, budget.d0)
        if key not in seen:
            seen.add(key)
            out.append((variant, budget))
    return out


def _model(variant: str, budget: Budget, tracker):
    arch = Arch(budget.n_points, budget.groups, budget.k, budget.d0, CLASSES)
    with torch.device(tracker.device):
        model = build_model(variant, arch, SENSOR, 0)
    return model


def _cloud(n: int, points: int, tracker) -> torch.Tensor:
    return torch.rand(n, points, 4, device=tracker.device)


def _train(cfg, variant: str, budget: Budget):
    def run(tracker):
        model = _model(variant, budget, tracker).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
        tracker.watch(model, optimizer)
        inputs = _cloud(cfg.batch_size, budget.n_points, tracker)
        target = torch.randint(CLASSES, (cfg.batch_size,), device=tracker.device)
        for _ in range(2):  # the second step holds AdamW's state from its start
            train_step(model, optimizer, schedule, inputs, target, cfg.label_smoothing)
    return run


def _eval(cfg, budget: Budget):
    def run(tracker):
        model = _model("secnet", budget, tracker).eval()
        tracker.watch(model)
        with torch.no_grad():  # predict's forward of one batch (its .cpu() is left out)
            model(_cloud(PREDICT_BATCH, budget.n_points, tracker))
    return run


def steps(cfg, processes: int) -> list[Step]:
    out = []
    for variant, budget in _jobs(cfg):
        out.append(Step("train", f"{variant} ({budget.name}: N = {budget.n_points}, S = {list(budget.groups)}, "
                                 f"k = {budget.k}, D0 = {budget.d0}): an AdamW step on {cfg.batch_size} clouds",
                        _train(cfg, variant, budget), repeats=2))
    main = Budget.of(cfg, "main", cfg.datasets[0])
    out.append(Step("eval", f"secnet: a test batch of {PREDICT_BATCH} clouds of {main.n_points} events", _eval(cfg, main)))
    return out
