"""Training and evaluation of one (variant, dataset, budget) job, in this process or a worker.

AdamW + per-step cosine schedule, cross-entropy with label smoothing; per epoch: loss, train_acc,
val_window_acc and (SECNet family) each stage's learned axis scale w. Evaluation: window accuracy and
sample accuracy by majority vote over a sample's windows (ties broken by summed logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AXES = ("t", "x", "y", "p")


@dataclass(frozen=True)
class Budget:
    """What one training job gets: the arch, epochs and (optionally) a subset of training samples."""

    name: str  # main | compare
    n_points: int
    groups: tuple[int, ...]
    k: int
    d0: int
    epochs: int
    train_samples: int | None

    @classmethod
    def of(cls, cfg, name: str, dataset: str) -> "Budget":
        if name == "compare":
            arch = cfg.compare.arch
            return cls(name, arch.n_points, tuple(arch.groups), arch.k, arch.d0, cfg.compare.epochs,
                       cfg.compare.train_samples)
        epochs = cfg.direction_epochs if dataset == "direction" and cfg.direction_epochs else cfg.epochs
        return cls(name, cfg.arch.n_points, tuple(cfg.arch.groups), cfg.arch.k, cfg.arch.d0, epochs, None)

    def tags(self, dataset: str, windows: int) -> dict:
        return {"dataset": dataset, "n_points": self.n_points, "s1": self.groups[0], "k": self.k, "d0": self.d0,
                "windows": windows, "sweep": "none", "budget": self.name}


def majority_vote(logits: np.ndarray, marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, predicted class) by majority over each sample's windows; a tie goes to the tied
    class with the largest summed logit."""
    ids = np.unique(marks)
    preds = np.empty(len(ids), np.int64)
    for i, sample in enumerate(ids):
        rows = logits[marks == sample]
        votes = np.bincount(rows.argmax(1), minlength=rows.shape[1])
        tied = np.flatnonzero(votes == votes.max())
        preds[i] = tied[np.argmax(rows.sum(0)[tied])]
    return ids, preds


def predict(model, x: np.ndarray, batch: int = 64, device: str = "cpu") -> np.ndarray:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for lo in range(0, len(x), batch):
            out.append(model(torch.from_numpy(x[lo:lo + batch]).to(device)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 1), np.float32)


def learned_w(model) -> list[tuple[int, str, float]]:
    stages = getattr(model, "stages", [])
    return [(i + 1, axis, float(v)) for i, stage in enumerate(stages) if hasattr(stage, "w")
            for axis, v in zip(AXES, stage.w.detach().tolist())]


def train_step(model, optimizer, schedule, inputs, target, label_smoothing: float):
    """One AdamW step on a batch with label-smoothed cross-entropy; returns (loss detached, logits)."""
    import torch.nn.functional as F

    logits = model(inputs)
    loss = F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    schedule.step()
    return loss.detach(), logits


def fit(model, x: np.ndarray, y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray, *, epochs: int, batch: int,
        lr: float, weight_decay: float, label_smoothing: float, seed: int, tags: dict, variant: str,
        device: str = "cpu") -> list[dict]:
    """Train in place; return the per-epoch rows (split train / val)."""
    import torch

    steps_per_epoch = max(1, len(x) // batch)  # drop the last partial batch: BN needs > 1 sample
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    rng = np.random.default_rng([seed, 3])
    rows = []
    for epoch in range(1, epochs + 1):
        model.train()
        order = rng.permutation(len(x))
        total_loss = correct = seen = 0
        for step in range(steps_per_epoch):
            pick = order[step * batch:(step + 1) * batch]
            inputs, target = torch.from_numpy(x[pick]).to(device), torch.from_numpy(y[pick]).to(device)
            loss, logits = train_step(model, optimizer, schedule, inputs, target, label_smoothing)
            total_loss += float(loss) * len(pick)
            correct += int((logits.argmax(1) == target).sum())
            seen += len(pick)
        base = {**tags, "variant": variant, "step": epoch}
        rows += [{**base, "metric": "loss", "value": total_loss / seen, "split": "train"},
                 {**base, "metric": "train_acc", "value": correct / seen, "split": "train"}]
        if len(val_x):  # held-out training samples (val_fraction), never the test split
            val_acc = float((predict(model, val_x, device=device).argmax(1) == val_y).mean())
            rows.append({**base, "metric": "val_window_acc", "value": val_acc, "split": "val"})
        rows += [{**base, "metric": "learned_w", "value": v, "stage": s, "axis": a, "split": "train"}
                 for s, a, v in learned_w(model)]
    return rows


def accuracy_rows(logits: np.ndarray, y: np.ndarray, marks: np.ndarray, classes: list[str], tags: dict,
                  variant: str, step: int, confusion: bool) -> list[dict]:
    """window_acc, sample_acc and (optionally) the sample-level confusion counts."""
    ids, preds = majority_vote(logits, marks)
    truth = np.array([y[marks == i][0] for i in ids])
    base = {**tags, "variant": variant, "step": step, "split": "test"}
    rows = [{**base, "metric": "window_acc", "value": float((logits.argmax(1) == y).mean())},
            {**base, "metric": "sample_acc", "value": float((preds == truth).mean())}]
    if confusion:
        counts = np.zeros((len(classes), len(classes)), np.int64)
        np.add.at(counts, (truth, preds), 1)
        rows += [{**base, "metric": "confusion", "value": float(counts[a, b]), "true_class": classes[a],
                  "pred_class": classes[b]} for a in range(len(classes)) for b in range(len(classes))]
    return rows


def run_job(cfg, seed: int, variant: str, dataset: str, budget: Budget, data_file: str, device: str = "cpu",
            state: dict | None = None) -> tuple[list[dict], dict]:
    """Train `variant` on a prepared dataset (or load `state`), evaluate it on the test split.
    Returns (rows, state_dict)."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.event_classify.data import strip_input
    from icml.methods.event_classify.model import Arch, build_model

    data = np.load(data_file)
    classes, sensor = [str(c) for c in data["classes"]], tuple(int(v) for v in data["sensor"])
    x, y, marks = data["train_x"], data["train_y"], data["train_mark"]
    if budget.train_samples is not None:
        keep = np.isin(marks, np.unique(marks)[:budget.train_samples])
        x, y = x[keep], y[keep]
    test_x, test_y, test_mark = data["test_x"], data["test_y"], data["test_mark"]
    # data prepared before the validation split existed has none: no validation curve then
    val_x, val_y = (data["val_x"], data["val_y"]) if "val_x" in data else (x[:0], y[:0])
    x, val_x = strip_input(x, variant, seed), strip_input(val_x, variant, seed + 2)
    test_x = strip_input(test_x, variant, seed + 1)
    tags = budget.tags(dataset, cfg.windows)
    torch.manual_seed(seed)
    arch = Arch(budget.n_points, budget.groups, budget.k, budget.d0, len(classes))
    model = build_model(variant, arch, sensor, seed).to(device)
    rows = []
    with single_thread():
        if state is None:
            batch = cfg.direction_batch_size if dataset == "direction" else cfg.batch_size
            rows += fit(model, x, y, val_x, val_y, epochs=budget.epochs, batch=min(batch, len(x)), lr=cfg.lr,
                        weight_decay=cfg.weight_decay, label_smoothing=cfg.label_smoothing, seed=seed, tags=tags,
                        variant=variant, device=device)
        else:
            model.load_state_dict(state)
        rows += accuracy_rows(predict(model, test_x, device=device), test_y, test_mark, classes, tags, variant, budget.epochs,
                              confusion=dataset == "direction" or len(classes) <= 12)
    return rows, {k: v.cpu() for k, v in model.state_dict().items()}
