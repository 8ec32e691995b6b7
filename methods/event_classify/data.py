"""Samples → event clouds: canonical order, windows, subsampling, normalisation, offline augmentation.

A cloud is (N, 4) float32 with columns (t, x, y, p): t min-max scaled to [0, 1] per window, x/W and
y/H (or / `norm_size`), p ∈ {0, 1} or {−1, +1}. Its rows are in time order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from icml.data.events import EventDataset, detect_columns, load_labelled, simulate_dataset


@dataclass
class Clouds:
    x: np.ndarray  # (M, N, 4) float32
    y: np.ndarray  # (M,) class
    mark: np.ndarray  # (M,) sample id: windows of one sample share it

    def __len__(self):
        return len(self.y)


def canonical_order(events: np.ndarray) -> np.ndarray:
    """Sort by (t, x, y, p): a stream's order no longer depends on how its file listed ties."""
    return events[np.lexsort((events["p"], events["y"], events["x"], events["t"]))]


def windows_of(events: np.ndarray, windows: int) -> list[np.ndarray]:
    """`windows` half-overlapping windows of 2/(windows+1) of the duration (300 ms, 3 → 150 ms every
    75 ms); 1: the whole sample."""
    if windows == 1:
        return [events]
    t0, t1 = events["t"][0], events["t"][-1]
    length = (t1 - t0) * 2 / (windows + 1)
    out = []
    for i in range(windows):
        lo = t0 + i * length / 2
        part = events[(events["t"] >= lo) & (events["t"] <= lo + length)]
        out.append(part if len(part) else events)
    return out


def to_cloud(events: np.ndarray, n: int, size: tuple[float, float], polarity: str,
             rng: np.random.Generator) -> np.ndarray:
    """Subsample n events (without replacement if there are enough, else with), keep their order
    (indices sorted) and normalise."""
    index = np.sort(rng.choice(len(events), n, replace=len(events) < n))
    ev = events[index]
    t = ev["t"].astype(np.float64)
    span = t.max() - t.min()
    p = ev["p"].astype(np.float32)
    cloud = np.stack([(t - t.min()) / span if span > 0 else np.zeros_like(t), ev["x"] / size[0], ev["y"] / size[1],
                      2 * p - 1 if polarity == "pm1" else p], axis=1)
    return cloud.astype(np.float32)


def event_cloud(events: np.ndarray, n: int, size, polarity: str, seed) -> np.ndarray:
    """The cloud of one window as preprocessing makes it: independent of the input's row order."""
    return to_cloud(canonical_order(events), n, size, polarity, np.random.default_rng(seed))


# offline augmentation -----------------------------------------------------------------------------
def random_crop(events: np.ndarray, sensor: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Exactly one of two crops, each with probability ½, as the official code does:
    - spatial: a window of 0.7–(W−1)/W of each side at a random offset, then translated by a random
      shift that keeps it inside the sensor (the window is half-open, so the shifted events stay in
      0…W−1; the official bounds are inclusive and can reach x = W);
    - temporal: a window of 0.6–(T−1)/T of the duration T at a random start.
    A crop left with fewer than 16 events returns the sample unchanged."""
    if rng.random() < 0.5:
        keep, shift = np.ones(len(events), bool), {}
        for axis, size in (("x", sensor[0]), ("y", sensor[1])):
            width = int(rng.uniform(0.7, (size - 1) / size) * size)
            lo = int(rng.integers(0, size - width))
            keep &= (events[axis] >= lo) & (events[axis] < lo + width)
            shift[axis] = int(rng.integers(-lo, size - lo - width + 1))
        out = events[keep].copy()
        for axis, offset in shift.items():
            out[axis] = (out[axis].astype(np.int64) + offset).astype(out.dtype[axis])
    elif len(events) > 1 and events["t"][-1] > events["t"][0] + 1:
        t0, t1 = int(events["t"][0]), int(events["t"][-1])
        length = int(rng.uniform(0.6, (t1 - t0 - 1) / (t1 - t0)) * (t1 - t0))
        lo = int(rng.integers(t0, t1 - length))
        out = events[(events["t"] >= lo) & (events["t"] <= lo + length)]
    else:
        out = events
    return out if len(out) >= 16 else events


def time_reverse(events: np.ndarray, resort: bool, flip_p: float, rng: np.random.Generator) -> np.ndarray:
    """t' = t_max + t_min − t. `resort`: rows re-sorted by t' (else the official code's index order is
    kept); with probability `flip_p` polarity is flipped too."""
    out = events.copy()
    out["t"] = events["t"].max() + events["t"].min() - events["t"]
    if resort:
        out = out[::-1]
    if rng.random() < flip_p:
        out["p"] = 1 - out["p"]
    return out


# datasets ---------------------------------------------------------------------------------------
def load_dataset(name: str, cfg, seed: int) -> EventDataset:
    """A simulated set, or the labelled files of `cfg.data`."""
    if name == "file":
        sensor = tuple(cfg.sensor_size) if cfg.sensor_size else None
        return load_labelled(cfg.data, cfg.format, sensor=sensor, profile=cfg.aedat2_profile, columns=cfg.columns,
                             max_per_class=cfg.max_per_class)
    n = cfg.samples if cfg.samples is not None else (None if name == "saccade-digits" else 800)
    return simulate_dataset(name, n, seed)


def split_indices(dataset: EventDataset, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The file layout's Train/Test split where it has one, else a seeded 80/20 split of samples."""
    n = len(dataset.labels) if dataset.clouds is None else len(np.unique(dataset.marks))
    if dataset.split is not None:
        return np.flatnonzero(dataset.split == "train"), np.flatnonzero(dataset.split == "test")
    order = np.random.default_rng([seed, 7]).permutation(n)
    n_test = max(1, int(round(n * test_fraction)))
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def split_validation(train_idx: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded share of the training samples held out for the validation curve, so that nothing
    computed during training looks at the test split; at least one sample stays in training."""
    n_val = min(int(round(len(train_idx) * val_fraction)), len(train_idx) - 1)
    if n_val <= 0:
        return train_idx, train_idx[:0]
    order = np.random.default_rng([seed, 11]).permutation(len(train_idx))
    return np.sort(train_idx[order[n_val:]]), np.sort(train_idx[order[:n_val]])


def window_columns(dataset: EventDataset, cfg) -> str:
    """The column order of preprocessed windows: `cfg.columns`, or detected (the official files
    store t, x, y, p; a column that rises within every window is t)."""
    return detect_columns(dataset.clouds) if cfg.columns == "auto" else cfg.columns


def make_clouds(dataset: EventDataset, index: np.ndarray, cfg, arch_n: int, seed: int, augment: bool) -> Clouds:
    """Windows → clouds of the samples in `index`; with `augment`, the offline copies are added."""
    if len(index) == 0:  # e.g. no validation samples (val_fraction = 0)
        return Clouds(np.zeros((0, arch_n, 4), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64))
    if dataset.clouds is not None:  # preprocessed windows: `index` selects sample ids (marks)
        ids = np.unique(dataset.marks)[index]
        rows = np.flatnonzero(np.isin(dataset.marks, ids))
        names = [c.strip() for c in window_columns(dataset, cfg).split(",")]
        data = dataset.clouds[rows][..., [names.index(c) for c in ("t", "x", "y", "p")]]
        rng = np.random.default_rng(seed)
        pick = np.stack([np.sort(rng.choice(data.shape[1], arch_n, replace=data.shape[1] < arch_n))
                         for _ in range(len(rows))])
        return Clouds(np.take_along_axis(data, pick[..., None], 1).astype(np.float32), dataset.labels[rows],
                      dataset.marks[rows])
    size = (cfg.norm_size, cfg.norm_size) if cfg.norm_size else dataset.sensor
    reverse = cfg.aug.reverse and dataset.name != "direction"
    xs, ys, marks = [], [], []
    for i in index:
        base = canonical_order(dataset.events[i])
        rng = np.random.default_rng([seed, int(i)])
        copies = [base]
        if augment and cfg.aug.crop:
            copies.append(random_crop(base, dataset.sensor, rng))
        if augment and reverse:
            copies.append(time_reverse(base, cfg.aug.reverse_resort, cfg.aug.reverse_flip_p, rng))
        for copy in copies:
            for window in windows_of(copy, cfg.windows):
                xs.append(to_cloud(window, arch_n, size, cfg.polarity, rng))
                ys.append(dataset.labels[i])
                marks.append(i)
    return Clouds(np.stack(xs), np.array(ys, np.int64), np.array(marks, np.int64))


def strip_input(x: np.ndarray, variant: str, seed: int) -> np.ndarray:
    """What the input-side ablations see: `secnet_no_polarity` p = 0; `secnet_no_pt` also permutes t
    across the events of each window (rows then re-sorted by the permuted t)."""
    if variant not in ("secnet_no_polarity", "secnet_no_pt"):
        return x
    out = x.copy()
    out[..., 3] = 0.0
    if variant == "secnet_no_pt":
        rng = np.random.default_rng([seed, 11])
        for cloud in out:
            cloud[:, 0] = cloud[rng.permutation(len(cloud)), 0]
            cloud[:] = cloud[np.argsort(cloud[:, 0], kind="stable")]
    return out
