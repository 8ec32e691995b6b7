"""The clip sets of a run: pretraining set, attribution pool, queries per target motion and
held-out clips, from the synthetic generator (data/videos.py) or a user folder (--data).

Pool composition (synthetic): 10% per target motion, 5% appearance twins (a query's shape,
colour and background with a non-target motion), 10% camera pans (static sprite), 10% jitter,
the rest random non-target motions (static ones count as decoys). The pool order is shuffled,
so a clip id says nothing about its category.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from icml.cli.errors import IcmlError
from icml.data.videos import (MOTIONS, NULL_PROMPT, SHAPES, VideoDataError, appearance_of, load_clip_folder,
                              make_clip, random_spec, stack)
from icml.methods.attribute_motion.model import seed_of

FACTOR_COLUMNS = ["motion", "shape", "hue", "hue_jitter", "background", "bg_seed", "size", "speed", "start_x",
                  "start_y", "direction", "valid_len", "pan", "pan_angle", "motion_seed", "decoy_type"]  # = ClipSpec


@dataclass
class ClipSets:
    videos: np.ndarray  # (N, T, H, W, 3)
    valid: np.ndarray  # (N, T)
    flow: np.ndarray  # (N, T, 2, H, W); zeros where unknown (user clips)
    labels: np.ndarray  # (N,) prompt ids
    table: pd.DataFrame  # clip_id, split, factors, twin_target, seed; row i ↔ array index i
    has_flow: bool

    def index(self, split: str, target: str | None = None) -> np.ndarray:
        rows = self.table["split"] == split
        if target is not None and split == "query":
            rows &= self.table["query_target"] == target
        return np.flatnonzero(rows.to_numpy())

    def save(self, path: Path) -> None:
        np.savez(path, videos=self.videos, valid=self.valid, flow=self.flow, labels=self.labels)

    @classmethod
    def load(cls, path: Path, table: pd.DataFrame, has_flow: bool) -> "ClipSets":
        with np.load(path) as data:
            return cls(data["videos"], data["valid"], data["flow"], data["labels"], table, has_flow)


def _non_targets(targets: list[str]) -> list[str]:
    return [m for m in MOTIONS if m not in targets]


def synthetic(cfg, seed: int) -> ClipSets:
    c = cfg.clips
    rng = np.random.default_rng(seed_of(seed, 101))
    others = _non_targets(c.targets)
    entries: list[tuple[str, object, str, str]] = []  # (split, spec, twin_target, query_target)

    def draw(motion, **kw):
        return random_spec(rng, motion, frames=c.frames, size=c.size, **kw)

    n_pretrain = 0 if cfg.backend == "wan" else c.n_pretrain  # a Wan pipeline is not pretrained here
    for _ in range(n_pretrain):
        u = rng.random()
        share = c.pretrain_target_share
        motion = c.targets[int(u / share)] if u < share * len(c.targets) else str(rng.choice(others))
        entries.append(("pretrain", draw(motion), "", ""))
    queries = {t: [draw(t) for _ in range(c.n_queries)] for t in c.targets}
    for target, specs in queries.items():
        entries += [("query", spec, "", target) for spec in specs]
    pool = []
    n_target = max(1, round(0.10 * c.n_pool))
    n_twin, n_pan, n_jitter = (max(1, round(share * c.n_pool)) for share in (0.05, 0.10, 0.10))
    for target in c.targets:
        pool += [(draw(target), "") for _ in range(n_target)]
    for i in range(n_twin):
        target = c.targets[i % len(c.targets)]
        source = queries[target][int(rng.integers(len(queries[target])))]
        motion = str(rng.choice([m for m in others if m != "static"]))
        pool.append((draw(motion, decoy_type="twin", appearance=appearance_of(source)), target))
    pool += [(draw("static", pan=True, decoy_type="pan"), "") for _ in range(n_pan)]
    pool += [(draw("jitter", decoy_type="jitter"), "") for _ in range(n_jitter)]
    while len(pool) < c.n_pool:
        motion = str(rng.choice(others))
        decoy = {"static": "static", "jitter": "jitter"}.get(motion, "none")
        pool.append((draw(motion, decoy_type=decoy), ""))
    pool = pool[:c.n_pool]
    for i in rng.permutation(len(pool)):
        entries.append(("pool", pool[i][0], pool[i][1], ""))
    for _ in range(c.n_heldout):
        entries.append(("heldout", draw(str(rng.choice(MOTIONS))), "", ""))

    clips = [make_clip(spec, c.frames, c.size) for _, spec, _, _ in entries]
    videos, valid, flow, labels = stack(clips)
    counters: dict[str, int] = {}
    rows = []
    for (split, spec, twin_target, query_target), clip in zip(entries, clips):
        number = counters[split] = counters.get(split, -1) + 1
        factors = clip.factors
        rows.append({"clip_id": f"{split}-{number:05d}", "split": split, "prompt_id": int(clip.prompt_id),
                     **{k: factors[k] for k in FACTOR_COLUMNS}, "twin_target": twin_target,
                     "query_target": query_target, "seed": seed})
    return ClipSets(videos, valid, flow, labels, pd.DataFrame(rows), True)


def from_folder(cfg, seed: int, staging: Path | None = None) -> ClipSets:
    """User clips: motion factors unknown except through the query prompt ids. Video files are decoded
    once into `staging` (uint8 .npy) and read with the other clips."""
    from icml.methods.attribute_motion.video_files import staged_folder

    c = cfg.clips
    try:
        folder = staged_folder(Path(cfg.data), c.frames, staging) if staging is not None else Path(cfg.data)
        splits = load_clip_folder(folder, c.frames, c.size)
    except VideoDataError as exc:
        raise IcmlError(str(exc), "see the attribute-motion README for the folder layout") from None
    clips, rows = [], []
    held = splits["pool"][: max(1, len(splits["pool"]) // 10)]  # held-out loss on a slice of the pool
    for split, items in (("pretrain", splits["pretrain"]), ("pool", splits["pool"]), ("query", splits["query"]),
                         ("heldout", held)):
        for clip_id, clip in items:
            pid = clip.prompt_id
            motion = MOTIONS[pid // len(SHAPES)] if pid < NULL_PROMPT else "unknown"
            clips.append(clip)
            rows.append({"clip_id": clip_id, "split": split, "prompt_id": int(pid), "motion": "unknown",
                         "shape": "unknown", "hue": -1, "background": "unknown", "valid_len": clip.valid_len,
                         "decoy_type": "none", "twin_target": "",
                         "query_target": (motion if motion in c.targets else cfg.primary_target) if split == "query" else "",
                         "seed": seed})
    videos, valid, flow, labels = stack(clips)
    return ClipSets(videos, valid, flow, labels, pd.DataFrame(rows), False)


def build(cfg, seed: int, staging: Path | None = None) -> ClipSets:
    return from_folder(cfg, seed, staging) if cfg.data else synthetic(cfg, seed)


def evaluator_grid(cfg) -> tuple[int, int]:
    """(frames, size) of the evaluators' clips: the run's clips unless eval.grid_frames / grid_size say otherwise
    (the paper preset: the synthetic world's 8 × 16 px, generated videos resampled to it)."""
    return cfg.eval.grid_frames or cfg.clips.frames, cfg.eval.grid_size or cfg.clips.size


def evaluator_clips(cfg, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fresh clips for the evaluators: (videos, valid, motion index, shape index, hue)."""
    frames, size = evaluator_grid(cfg)
    rng = np.random.default_rng(seed_of(seed, 202))
    specs = [random_spec(rng, MOTIONS[i % len(MOTIONS)], frames=frames, size=size)
             for i in range(cfg.eval.evaluator_clips)]
    clips = [make_clip(s, frames, size) for s in specs]
    videos, valid, _, _ = stack(clips)
    return (videos, valid, np.array([MOTIONS.index(s.motion) for s in specs]),
            np.array([SHAPES.index(s.shape) for s in specs]), np.array([s.hue for s in specs]))
