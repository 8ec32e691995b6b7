"""VBench-style video metrics, re-implemented as the spec defines them, and the two auxiliary
evaluators they need (trained in `train` on fresh synthetic clips).

- `MotionClassifier`: 7-way motion from stacked frame differences (and the first frame), trained
  with pixel-noise augmentation so that residual sampling noise does not read as motion.
- `AppearanceNet`: shape (3) and hue (6) from a single frame; its penultimate features feed
  subject consistency and the `appearance_match` baseline.
- dynamic_degree: per consecutive frame pair, the mean of the top 5% flow magnitudes; a video is
  dynamic if at least round(4·T/16) pairs exceed 6·min(H, W)/256 (VBench's rule, scaled).
  `top_flow_px` (ours) reports the thresholded quantity itself, averaged: it still moves when
  every video passes the 0.375-px threshold.
- motion_smoothness: keep the even frames, rebuild each odd frame between two kept ones by flow
  midpoint interpolation (or linear), score (255 − mean|I − Î|)/255.
- subject_consistency: mean over frames i ≥ 1 of [max(0, cos(f_i, f_{i−1})) + max(0, cos(f_i, f_0))]/2.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from icml.data.videos import MOTIONS, N_HUES, SHAPES
from icml.methods.attribute_motion.flow import estimate_flow, gray, pair_flow, warp


def to_grid(videos: torch.Tensor, frames: int, size: int) -> torch.Tensor:
    """Videos (N, T, H, W, 3) resampled (trilinear) to the evaluators' grid (N, frames, size, size, 3); unchanged
    when they are on it already."""
    if videos.shape[1:4] == (frames, size, size):
        return videos
    x = F.interpolate(videos.permute(0, 4, 1, 2, 3), size=(frames, size, size), mode="trilinear", align_corners=False)
    return x.permute(0, 2, 3, 4, 1).contiguous()


class MotionClassifier(nn.Module):
    def __init__(self, frames: int, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3 * frames, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, len(MOTIONS)))

    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        """videos (N, T, H, W, 3) → logits (N, 7), from frame 0 and the T−1 frame differences."""
        x = videos.permute(0, 1, 4, 2, 3)
        diffs = torch.cat([x[:, :1], x[:, 1:] - x[:, :-1]], 1)
        return self.net(diffs.flatten(1, 2))


class AppearanceNet(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 64), nn.ReLU())
        self.shape_head = nn.Linear(64, len(SHAPES))
        self.hue_head = nn.Linear(64, N_HUES)

    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, H, W, 3) → (N, 64) penultimate features."""
        return self.body(frames.permute(0, 3, 1, 2))

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(frames)
        return self.shape_head(h), self.hue_head(h)


def train_evaluators(videos: torch.Tensor, motions: torch.Tensor, shapes: torch.Tensor, hues: torch.Tensor,
                     valid: torch.Tensor, steps: int, seed: int, batch: int = 64,
                     max_noise: float = 0.6) -> tuple[MotionClassifier, AppearanceNet, dict]:
    """Both evaluators on the first 80% of the clips; held-out accuracies (clean clips) on the rest.

    The motion classifier sees Gaussian pixel noise of std ~ U(0, max_noise): a small generator's
    samples keep residual noise, and a classifier trained only on clean clips reads noisy frame
    differences as the fastest motion (it called every generated video "orbit")."""
    torch.manual_seed(seed)
    n_train = int(0.8 * len(videos))
    frames = videos.shape[1]
    motion_net, appearance_net = MotionClassifier(frames), AppearanceNet()
    opt = torch.optim.Adam(list(motion_net.parameters()) + list(appearance_net.parameters()), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(n_train, (batch,), generator=gen)
        frame_idx = (torch.rand(batch, generator=gen) * valid[idx].sum(1)).long()
        single = videos[idx, frame_idx]
        shape_logits, hue_logits = appearance_net(single)
        noise = torch.rand(batch, 1, 1, 1, 1, generator=gen) * max_noise
        noisy = videos[idx] + noise * torch.randn(videos[idx].shape, generator=gen)
        loss = (F.cross_entropy(motion_net(noisy), motions[idx]) + F.cross_entropy(shape_logits, shapes[idx])
                + F.cross_entropy(hue_logits, hues[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    motion_net.eval()
    appearance_net.eval()
    with torch.no_grad():
        held = slice(n_train, len(videos))
        motion_acc = (motion_net(videos[held]).argmax(1) == motions[held]).float().mean()
        shape_logits, hue_logits = appearance_net(videos[held, 0])
        shape_acc = (shape_logits.argmax(1) == shapes[held]).float().mean()
        hue_acc = (hue_logits.argmax(1) == hues[held]).float().mean()
    return motion_net, appearance_net, {"motion": float(motion_acc), "shape": float(shape_acc), "hue": float(hue_acc)}


def top_flow(videos: torch.Tensor, method: str = "hs", flow: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T−1): per consecutive frame pair, the mean of the top 5% flow magnitudes (pixels)."""
    n, t, h, w, _ = videos.shape
    if flow is None:
        flow = estimate_flow(videos, method)[:, :-1]
    k = max(1, int(np.ceil(0.05 * h * w)))
    return flow.norm(dim=2).flatten(2).topk(k, dim=2).values.mean(2)


def dynamic_degree(videos: torch.Tensor, method: str = "hs", flow: torch.Tensor | None = None) -> np.ndarray:
    """Per video 1.0 if dynamic else 0.0 (VBench's rule at this resolution)."""
    n, t, h, w, _ = videos.shape
    threshold = 6.0 * min(h, w) / 256.0
    needed = max(1, round(4 * t / 16))
    return ((top_flow(videos, method, flow) > threshold).sum(1) >= needed).float().numpy()


def motion_smoothness(videos: torch.Tensor, method: str = "hs", interp: str = "flow") -> np.ndarray:
    """Per video (255 − mean|I − Î|)/255 over the odd frames rebuilt from their even neighbours."""
    n, t = videos.shape[:2]
    odd = [i for i in range(1, t - 1, 2)]
    before, after = videos[:, [i - 1 for i in odd]], videos[:, [i + 1 for i in odd]]
    truth = gray(videos[:, odd]) * 255
    a = gray(before).flatten(0, 1)
    b = gray(after).flatten(0, 1)
    if interp == "linear":
        middle = (a + b) / 2
    else:
        flow = pair_flow(before.flatten(0, 1), after.flatten(0, 1), method)
        middle = (warp(a[:, None], -flow / 2) + warp(b[:, None], flow / 2))[:, 0] / 2  # both halves meet at the midpoint
    middle = middle.reshape(truth.shape) * 255
    return ((255 - (truth - middle).abs().mean((1, 2, 3))) / 255).numpy()


def subject_consistency(videos: torch.Tensor, appearance_net: AppearanceNet) -> np.ndarray:
    n, t = videos.shape[:2]
    with torch.no_grad():
        feats = F.normalize(appearance_net.features(videos.flatten(0, 1)), dim=1).reshape(n, t, -1)
    prev = (feats[:, 1:] * feats[:, :-1]).sum(-1).clamp_min(0)
    first = (feats[:, 1:] * feats[:, :1]).sum(-1).clamp_min(0)
    return ((prev + first) / 2).mean(1).numpy()


def motion_probabilities(videos: torch.Tensor, motion_net: MotionClassifier) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(motion_net(videos), 1).numpy()


def clip_appearance(videos: torch.Tensor, valid: torch.Tensor, appearance_net: AppearanceNet) -> np.ndarray:
    """Mean appearance feature over the valid frames, per clip (N, 64)."""
    n, t = videos.shape[:2]
    with torch.no_grad():
        feats = appearance_net.features(videos.flatten(0, 1)).reshape(n, t, -1)
    weights = valid.float()[..., None]
    return ((feats * weights).sum(1) / weights.sum(1)).numpy()


def win_rate(arm_probs: np.ndarray, base_probs: np.ndarray) -> float:
    """Share of shared-seed pairs where the arm's probability of the prompted motion beats base's (ties 0.5)."""
    return float(np.mean(np.where(arm_probs > base_probs, 1.0, np.where(arm_probs == base_probs, 0.5, 0.0))))
