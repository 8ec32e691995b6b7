"""Optical flow for generated and user videos, and the motion mask built from any flow.

Estimators (frames (N, T, H, W, 3) in [−1, 1] → flow (N, T, 2, H, W), pixel displacement to
the next frame, the last frame repeated so its flow is 0). Both torch estimators use all three
colour channels (their data terms are summed over channels): on luminance alone a sprite whose
hue differs from the background but whose brightness does not is invisible.
- `lk`: pyramidal Lucas–Kanade with iterative warping (the attribution default for user clips);
- `hs`: Horn–Schunck (global smoothness) after a Gaussian pre-filter, a few warping rounds. It is
  the evaluation default: generated videos keep residual sampling noise, and at VBench's 0.375-px
  threshold local estimators read that noise as motion (README, Deviations: "Evaluation flow");
- `farneback`: OpenCV's, only where `cv2` imports.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from icml.cli.errors import IcmlError

HS_ALPHA = 0.5  # smoothness weight (intensities in [0, 1]); see README for the calibration
HS_SIGMA = 1.0  # Gaussian pre-filter, pixels


def gray(frames: torch.Tensor) -> torch.Tensor:
    """(…, H, W, 3) in [−1, 1] → (…, H, W) luminance in [0, 1]."""
    rgb = (frames + 1) / 2
    return rgb @ torch.tensor([0.299, 0.587, 0.114])


def channels(frames: torch.Tensor) -> torch.Tensor:
    """(N, H, W, 3) in [−1, 1] → (N, 3, H, W) in [0, 1]."""
    return ((frames + 1) / 2).permute(0, 3, 1, 2)


def warp(image: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Sample image (N, C, H, W) at x + flow(x) (bilinear, border clamp)."""
    n, _, h, w = image.shape
    ys, xs = torch.meshgrid(torch.arange(h, dtype=image.dtype), torch.arange(w, dtype=image.dtype), indexing="ij")
    gx = (xs + flow[:, 0]) / max(w - 1, 1) * 2 - 1
    gy = (ys + flow[:, 1]) / max(h - 1, 1) * 2 - 1
    grid = torch.stack([gx, gy], -1)
    return F.grid_sample(image, grid, mode="bilinear", padding_mode="border", align_corners=True)


def gaussian_blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian (radius ⌈2σ⌉, replicate border) of (N, C, H, W)."""
    if sigma <= 0:
        return image
    radius = max(1, math.ceil(2 * sigma))
    taps = torch.exp(-torch.arange(-radius, radius + 1, dtype=image.dtype) ** 2 / (2 * sigma ** 2))
    taps = taps / taps.sum()
    n, c, h, w = image.shape
    x = F.pad(image.reshape(n * c, 1, h, w), [radius] * 4, mode="replicate")
    x = F.conv2d(F.conv2d(x, taps.view(1, 1, 1, -1)), taps.view(1, 1, -1, 1))
    return x.reshape(n, c, h, w)


def _gradients(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Central differences of (N, C, H, W), replicate border."""
    padded = F.pad(image, (1, 1, 1, 1), mode="replicate")
    ix = (padded[..., 1:-1, 2:] - padded[..., 1:-1, :-2]) / 2
    iy = (padded[..., 2:, 1:-1] - padded[..., :-2, 1:-1]) / 2
    return ix, iy


def _data_terms(a: torch.Tensor, b: torch.Tensor, flow: torch.Tensor):
    """The linearised brightness-constancy terms at the current flow, summed over channels:
    J = Σ_c ∇I_c ∇I_cᵀ as (jxx, jxy, jyy) and Σ_c ∇I_c·I_t,c as (bx, by)."""
    warped = warp(b, flow)
    ix, iy = _gradients((a + warped) / 2)
    it = warped - a
    return (ix * ix).sum(1), (ix * iy).sum(1), (iy * iy).sum(1), (ix * it).sum(1), (iy * it).sum(1)


def _box(x: torch.Tensor, window: int) -> torch.Tensor:
    return F.avg_pool2d(F.pad(x[:, None], [window // 2] * 4, mode="replicate"), window, stride=1)[:, 0]


def _pyramid(image: torch.Tensor, levels: int) -> list[torch.Tensor]:
    out = [image]
    for _ in range(levels - 1):
        if min(out[-1].shape[-2:]) < 8:
            break
        out.append(F.avg_pool2d(out[-1], 2))
    return out[::-1]  # coarse → fine


def lucas_kanade(a: torch.Tensor, b: torch.Tensor, levels: int = 2, iters: int = 4, window: int = 5) -> torch.Tensor:
    """Flow (N, 2, H, W) from image a to image b (N, C, H, W), structure tensor summed over channels."""
    flow = None
    for pa, pb in zip(_pyramid(a, levels), _pyramid(b, levels)):
        if flow is None:
            flow = torch.zeros(len(pa), 2, *pa.shape[-2:], dtype=pa.dtype)
        else:
            flow = F.interpolate(flow, size=pa.shape[-2:], mode="bilinear", align_corners=False) * 2
        for _ in range(iters):
            sxx, sxy, syy, sxt, syt = (_box(term, window) for term in _data_terms(pa, pb, flow))
            det = sxx * syy - sxy ** 2
            ok = det > 1e-6  # textureless windows (aperture problem): no update
            du = torch.where(ok, -(syy * sxt - sxy * syt) / det.clamp_min(1e-6), torch.zeros_like(det))
            dv = torch.where(ok, -(sxx * syt - sxy * sxt) / det.clamp_min(1e-6), torch.zeros_like(det))
            flow = flow + torch.stack([du, dv], 1).clamp(-2, 2)
    return flow


def horn_schunck(a: torch.Tensor, b: torch.Tensor, alpha: float = HS_ALPHA, sigma: float = HS_SIGMA,
                 iters: int = 60, rounds: int = 3) -> torch.Tensor:
    """Flow (N, 2, H, W) from image a to image b (N, C, H, W).

    Each Jacobi step solves, per pixel, (α²I + J)·(u, v) = α²·(ū, v̄) − (bx, by), with ū, v̄ the
    neighbourhood means; for one channel this is Horn & Schunck's u = ū − I_x(I_x ū + I_y v̄ + I_t)/(α² + |∇I|²)."""
    a, b = gaussian_blur(a, sigma), gaussian_blur(b, sigma)
    n, _, h, w = a.shape
    flow = torch.zeros(n, 2, h, w, dtype=a.dtype)
    a2 = alpha ** 2
    for _ in range(rounds):
        jxx, jxy, jyy, bx, by = _data_terms(a, b, flow)
        det = (a2 + jxx) * (a2 + jyy) - jxy ** 2
        delta = torch.zeros_like(flow)
        for _ in range(iters):
            rx, ry = (a2 * _neighbour_mean(delta) - torch.stack([bx, by], 1)).unbind(1)
            delta = torch.stack([(a2 + jyy) * rx - jxy * ry, (a2 + jxx) * ry - jxy * rx], 1) / det[:, None]
        flow = flow + delta
    return flow


def _neighbour_mean(x: torch.Tensor) -> torch.Tensor:
    """Horn & Schunck's weighted 8-neighbour mean [[1, 2, 1], [2, 0, 2], [1, 2, 1]]/12, replicate border
    (shifted sums: a one-channel conv2d is several times slower on these small maps)."""
    p = F.pad(x, (1, 1, 1, 1), mode="replicate")
    edges = p[..., :-2, 1:-1] + p[..., 2:, 1:-1] + p[..., 1:-1, :-2] + p[..., 1:-1, 2:]
    corners = p[..., :-2, :-2] + p[..., :-2, 2:] + p[..., 2:, :-2] + p[..., 2:, 2:]
    return (2 * edges + corners) / 12


def farneback(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        import cv2
    except ImportError:
        raise IcmlError("flow=farneback needs OpenCV (cv2), which is not installed", "use flow=lk or flow=hs") from None
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=a.dtype)
    out = []
    for x, y in zip((torch.einsum("nchw,c->nhw", a, weights) * 255).byte().numpy(),
                    (torch.einsum("nchw,c->nhw", b, weights) * 255).byte().numpy()):
        out.append(torch.from_numpy(cv2.calcOpticalFlowFarneback(x, y, None, 0.5, 2, 5, 3, 5, 1.1, 0)).permute(2, 0, 1))
    return torch.stack(out).float()


ESTIMATORS = {"lk": lucas_kanade, "hs": horn_schunck, "farneback": farneback}


def pair_flow(a: torch.Tensor, b: torch.Tensor, method: str = "lk") -> torch.Tensor:
    """Flow between two batches of frames (N, H, W, 3) → (N, 2, H, W)."""
    return ESTIMATORS[method](channels(a), channels(b))


def estimate_flow(videos: torch.Tensor, method: str = "lk") -> torch.Tensor:
    """(N, T, H, W, 3) → (N, T, 2, H, W); frame T−1 is repeated, so its flow is 0."""
    n, t = videos.shape[:2]
    flow = pair_flow(videos[:, :-1].reshape(-1, *videos.shape[2:]), videos[:, 1:].reshape(-1, *videos.shape[2:]), method)
    flow = flow.reshape(n, t - 1, 2, *videos.shape[2:4])
    return torch.cat([flow, torch.zeros(n, 1, 2, *videos.shape[2:4])], 1)


def camera_compensated(flow: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Flow (N, T, 2, H, W) relative to the camera: each valid frame minus its median flow vector
    (per component, over the frame's pixels). A pan or a global translation moves most pixels by the
    same vector, so the median is that vector and a static scene under a moving camera is left still;
    an object moving over a still background (the background is most pixels) keeps its flow."""
    n, t, _, h, w = flow.shape
    median = flow.reshape(n, t, 2, h * w).median(dim=-1).values[..., None, None]
    return (flow - median) * valid.float()[:, :, None, None, None]


def patch_magnitude(flow: torch.Tensor, valid: torch.Tensor, patch: int) -> torch.Tensor:
    """Mean displacement magnitude per p×p patch, (N, T, H/p, W/p), zero on padded frames."""
    magnitude = flow.norm(dim=2)
    return F.avg_pool2d(magnitude, patch) * valid.float()[..., None, None]


def motion_mask(flow: torch.Tensor, valid: torch.Tensor, patch: int, camera: str = "median",
                floor: float = 0.0) -> torch.Tensor:
    """The Motive mask M ∈ [0, 1]^{N×T×H×W}: camera-compensated displacement magnitudes (`camera=median`;
    `none` keeps the raw flow), zeroed below `floor` px (estimated flow leaves sub-pixel residue that the
    max-normalisation would otherwise blow up to 1), p×p patch means normalised by each clip's maximum (an
    all-zero clip stays zero), times frame validity, upsampled back to full resolution."""
    if camera == "median":
        flow = camera_compensated(flow, valid)
    magnitude = flow.norm(dim=2)
    magnitude = torch.where(magnitude > floor, magnitude, torch.zeros_like(magnitude))
    pooled = F.avg_pool2d(magnitude, patch) * valid.float()[..., None, None]
    peak = pooled.amax(dim=(1, 2, 3), keepdim=True)
    normed = torch.where(peak > 0, pooled / peak.clamp_min(1e-12), torch.zeros_like(pooled))
    return normed.repeat_interleave(patch, -2).repeat_interleave(patch, -1)


def latent_grid_mask(mask: torch.Tensor, temporal: int, spatial: int) -> torch.Tensor:
    """A pixel mask (N, T, H, W) on the latent grid of a causal video VAE (Wan: 4× in time, 8× in space),
    (N, 1 + (T − 1)/temporal, H/spatial, W/spatial): latent frame 0 encodes pixel frame 0 alone and latent
    frame j ≥ 1 pixel frames temporal·(j − 1) + 1 … temporal·j, so each latent cell is the mean of the pixel
    mask over the frames and the spatial×spatial patch it encodes; then normalised by the clip's maximum
    (an all-zero clip stays zero), as the pixel mask is."""
    n, t, h, w = mask.shape
    if (t - 1) % temporal or h % spatial or w % spatial:
        raise IcmlError(f"a {t}-frame {h}×{w} clip is not on the VAE's grid (frames = 1 + {temporal}k, sides a "
                        f"multiple of {spatial})", "set clips.frames and clips.size to fit it")
    pooled = F.avg_pool2d(mask, spatial)  # (N, T, h, w)
    first, rest = pooled[:, :1], pooled[:, 1:]
    rest = rest.reshape(n, (t - 1) // temporal, temporal, *pooled.shape[-2:]).mean(2)
    grid = torch.cat([first, rest], 1)
    peak = grid.amax(dim=(1, 2, 3), keepdim=True)
    return torch.where(peak > 0, grid / peak.clamp_min(1e-12), torch.zeros_like(grid))
