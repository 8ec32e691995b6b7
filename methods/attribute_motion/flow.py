"""Optical flow for generated and user videos, and the motion mask built from any flow.

Estimators (frames (N, T, H, W, 3) in [−1, 1] → flow (N, T, 2, H, W), pixel displacement to
the next frame, the last frame repeated so its flow is 0):
- `lk`: pyramidal Lucas–Kanade with iterative warping (default);
- `hs`: Horn–Schunck (global smoothness), a few warping rounds;
- `farneback`: OpenCV's, only where `cv2` imports.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from icml.cli.errors import IcmlError


def gray(frames: torch.Tensor) -> torch.Tensor:
    """(…, H, W, 3) in [−1, 1] → (…, H, W) luminance in [0, 1]."""
    rgb = (frames + 1) / 2
    return rgb @ torch.tensor([0.299, 0.587, 0.114])


def warp(image: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Sample image (N, H, W) at x + flow(x) (bilinear, border clamp)."""
    n, h, w = image.shape
    ys, xs = torch.meshgrid(torch.arange(h, dtype=image.dtype), torch.arange(w, dtype=image.dtype), indexing="ij")
    gx = (xs + flow[:, 0]) / max(w - 1, 1) * 2 - 1
    gy = (ys + flow[:, 1]) / max(h - 1, 1) * 2 - 1
    grid = torch.stack([gx, gy], -1)
    return F.grid_sample(image[:, None], grid, mode="bilinear", padding_mode="border", align_corners=True)[:, 0]


def _gradients(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    padded = F.pad(image[:, None], (1, 1, 1, 1), mode="replicate")[:, 0]
    ix = (padded[:, 1:-1, 2:] - padded[:, 1:-1, :-2]) / 2
    iy = (padded[:, 2:, 1:-1] - padded[:, :-2, 1:-1]) / 2
    return ix, iy


def _box(x: torch.Tensor, window: int) -> torch.Tensor:
    return F.avg_pool2d(F.pad(x[:, None], [window // 2] * 4, mode="replicate"), window, stride=1)[:, 0]


def _pyramid(image: torch.Tensor, levels: int) -> list[torch.Tensor]:
    out = [image]
    for _ in range(levels - 1):
        if min(out[-1].shape[-2:]) < 8:
            break
        out.append(F.avg_pool2d(out[-1][:, None], 2)[:, 0])
    return out[::-1]  # coarse → fine


def lucas_kanade(a: torch.Tensor, b: torch.Tensor, levels: int = 2, iters: int = 4, window: int = 5) -> torch.Tensor:
    """Flow (N, 2, H, W) from gray a to gray b (N, H, W)."""
    flow = None
    for pa, pb in zip(_pyramid(a, levels), _pyramid(b, levels)):
        if flow is None:
            flow = torch.zeros(len(pa), 2, *pa.shape[-2:])
        else:
            flow = F.interpolate(flow, size=pa.shape[-2:], mode="bilinear", align_corners=False) * 2
        for _ in range(iters):
            warped = warp(pb, flow)
            ix, iy = _gradients((pa + warped) / 2)
            it = warped - pa
            sxx, sxy, syy = _box(ix * ix, window), _box(ix * iy, window), _box(iy * iy, window)
            sxt, syt = _box(ix * it, window), _box(iy * it, window)
            det = sxx * syy - sxy ** 2
            ok = det > 1e-6  # textureless windows (aperture problem): no update
            du = torch.where(ok, -(syy * sxt - sxy * syt) / det.clamp_min(1e-6), torch.zeros_like(det))
            dv = torch.where(ok, -(sxx * syt - sxy * sxt) / det.clamp_min(1e-6), torch.zeros_like(det))
            flow = flow + torch.stack([du, dv], 1).clamp(-2, 2)
    return flow


def horn_schunck(a: torch.Tensor, b: torch.Tensor, alpha: float = 0.05, iters: int = 60, rounds: int = 3) -> torch.Tensor:
    flow = torch.zeros(len(a), 2, *a.shape[-2:])
    kernel = torch.tensor([[1, 2, 1], [2, 0, 2], [1, 2, 1]], dtype=a.dtype)[None, None] / 12
    for _ in range(rounds):
        warped = warp(b, flow)
        ix, iy = _gradients((a + warped) / 2)
        it = warped - a
        du = torch.zeros_like(a)
        dv = torch.zeros_like(a)
        for _ in range(iters):
            u_bar = F.conv2d(F.pad(du[:, None], (1, 1, 1, 1), mode="replicate"), kernel)[:, 0]
            v_bar = F.conv2d(F.pad(dv[:, None], (1, 1, 1, 1), mode="replicate"), kernel)[:, 0]
            common = (ix * u_bar + iy * v_bar + it) / (alpha ** 2 + ix ** 2 + iy ** 2)
            du, dv = u_bar - ix * common, v_bar - iy * common
        flow = flow + torch.stack([du, dv], 1)
    return flow


def farneback(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        import cv2
    except ImportError:
        raise IcmlError("flow=farneback needs OpenCV (cv2), which is not installed", "use flow=lk or flow=hs") from None
    out = []
    for x, y in zip((a * 255).byte().numpy(), (b * 255).byte().numpy()):
        out.append(torch.from_numpy(cv2.calcOpticalFlowFarneback(x, y, None, 0.5, 2, 5, 3, 5, 1.1, 0)).permute(2, 0, 1))
    return torch.stack(out).float()


ESTIMATORS = {"lk": lucas_kanade, "hs": horn_schunck, "farneback": farneback}


def pair_flow(a: torch.Tensor, b: torch.Tensor, method: str = "lk") -> torch.Tensor:
    """Flow between two batches of frames (N, H, W, 3) → (N, 2, H, W)."""
    return ESTIMATORS[method](gray(a), gray(b))


def estimate_flow(videos: torch.Tensor, method: str = "lk") -> torch.Tensor:
    """(N, T, H, W, 3) → (N, T, 2, H, W); frame T−1 is repeated, so its flow is 0."""
    n, t = videos.shape[:2]
    flow = pair_flow(videos[:, :-1].reshape(-1, *videos.shape[2:]), videos[:, 1:].reshape(-1, *videos.shape[2:]), method)
    flow = flow.reshape(n, t - 1, 2, *videos.shape[2:4])
    return torch.cat([flow, torch.zeros(n, 1, 2, *videos.shape[2:4])], 1)


def patch_magnitude(flow: torch.Tensor, valid: torch.Tensor, patch: int) -> torch.Tensor:
    """Mean displacement magnitude per p×p patch, (N, T, H/p, W/p), zero on padded frames."""
    magnitude = flow.norm(dim=2)
    return F.avg_pool2d(magnitude, patch) * valid.float()[..., None, None]


def motion_mask(flow: torch.Tensor, valid: torch.Tensor, patch: int) -> torch.Tensor:
    """The Motive mask M ∈ [0, 1]^{N×T×H×W}: patch magnitudes normalised by each clip's maximum
    (an all-zero clip stays zero), times frame validity, upsampled back to full resolution."""
    pooled = patch_magnitude(flow, valid, patch)
    peak = pooled.amax(dim=(1, 2, 3), keepdim=True)
    normed = torch.where(peak > 0, pooled / peak.clamp_min(1e-12), torch.zeros_like(pooled))
    return normed.repeat_interleave(patch, -2).repeat_interleave(patch, -1)
