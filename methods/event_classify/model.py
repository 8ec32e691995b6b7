"""SECNet (the official code's `FECNet`), its ablations and the baselines, in torch.

Shapes: an event cloud is (B, N, 4) with columns (t, x, y, p), time-sorted and normalised; features
are (B, N, D). Grouping (D-FPS, EF-KNN) works on indices without gradients; w ∈ ℝ⁴ gets its gradient
through the scaled coordinates that enter the group features and the CES centroids.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Arch:
    """Size of a point model: N events, groups per stage, k neighbours, embedding width D₀."""

    n_points: int
    groups: tuple[int, ...]
    k: int
    d0: int
    n_classes: int

    @property
    def widths(self) -> list[int]:
        """D₀ and every stage's output width D' = 2D + 4."""
        out = [self.d0]
        for _ in self.groups:
            out.append(2 * out[-1] + 4)
        return out


class PartTimer:
    """Wall time per model part (ms), accumulated while `model.timer` is set (profiling only)."""

    def __init__(self):
        self.ms: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        yield
        self.ms[name] = self.ms.get(name, 0.0) + 1e3 * (time.perf_counter() - start)


@contextmanager
def _timed(model, name: str):
    if getattr(model, "timer", None) is None:
        yield
    else:
        with model.timer.part(name):
            yield


# grouping ---------------------------------------------------------------------------------------
@torch.no_grad()
def farthest_point_sample(points: torch.Tensor, n_samples: int, start: torch.Tensor) -> torch.Tensor:
    """Farthest-point sampling on (B, N, 3), vectorised over the batch, looping over samples.
    Returns the chosen indices sorted ascending, so the centroids keep the cloud's time order."""
    b, n, _ = points.shape
    rows = torch.arange(b, device=points.device)
    chosen = torch.empty(b, n_samples, dtype=torch.long, device=points.device)
    nearest = torch.full((b, n), float("inf"), device=points.device, dtype=points.dtype)
    current = start
    for i in range(n_samples):
        chosen[:, i] = current
        step = ((points - points[rows, current][:, None]) ** 2).sum(-1)
        nearest = torch.minimum(nearest, step)
        current = nearest.argmax(-1)
    return chosen.sort(-1).values


@torch.no_grad()
def knn(queries: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, S, k) of the k nearest `points` (B, N, C) of each query (B, S, C), squared
    Euclidean distance, sorted ascending by index (neighbours keep the cloud's time order)."""
    dist = (queries ** 2).sum(-1, keepdim=True) - 2 * queries @ points.transpose(1, 2) \
        + (points ** 2).sum(-1)[:, None, :]
    return dist.topk(k, dim=-1, largest=False).indices.sort(-1).values


def gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (B, N, C) at index (B, ...) → (B, ..., C)."""
    b = values.shape[0]
    flat = index.reshape(b, -1)
    out = torch.gather(values, 1, flat[..., None].expand(-1, -1, values.shape[-1]))
    return out.reshape(*index.shape, values.shape[-1])


# Fourier aggregation ----------------------------------------------------------------------------
def _one_sided_weights(n: int, device) -> torch.Tensor:
    """How often each rFFT bin counts in the full spectrum: twice for the interior bins, once for
    DC and (n even) Nyquist."""
    weights = torch.full((n // 2 + 1,), 2.0, device=device)
    weights[0] = 1.0
    if n % 2 == 0:
        weights[-1] = 1.0
    return weights


class FourierFilter(torch.autograd.Function):
    """y = irfft(rfft(x) · V, n) along `dim` (ortho), V broadcast against the spectrum.

    The same values and gradients as autograd through the three ops (a test pins both), with a
    cheaper backward: the filter is a real circular convolution, so its adjoint is the filter with
    conj(V), one half-size rFFT and one irFFT. Autograd's rfft backward instead runs a full complex
    FFT of the gradient, ≈ 15 % of a SECNet training step on CPU."""

    @staticmethod
    def forward(ctx, x, spectrum_filter, dim):
        n = x.shape[dim]
        spectrum = torch.fft.rfft(x, dim=dim, norm="ortho")
        ctx.save_for_backward(spectrum, spectrum_filter)
        ctx.dim, ctx.n = dim, n
        return torch.fft.irfft(spectrum * spectrum_filter, n=n, dim=dim, norm="ortho")

    @staticmethod
    def backward(ctx, grad_out):
        spectrum, spectrum_filter = ctx.saved_tensors
        dim, n = ctx.dim, ctx.n
        grad_spectrum = torch.fft.rfft(grad_out, dim=dim, norm="ortho")
        grad_x = grad_filter = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.fft.irfft(grad_spectrum * spectrum_filter.conj(), n=n, dim=dim, norm="ortho")
        if ctx.needs_input_grad[1]:
            # ∂L/∂V = Σ over broadcast positions of w·R·conj(X): irfft counts interior bins twice.
            along = [1] * grad_spectrum.ndim
            along[dim] = -1
            full = grad_spectrum * spectrum.conj() * _one_sided_weights(n, grad_out.device).view(along)
            lead = full.ndim - spectrum_filter.ndim
            summed = list(range(lead)) + [lead + i for i, size in enumerate(spectrum_filter.shape)
                                          if size == 1 and full.shape[lead + i] != 1]
            grad_filter = full.sum(summed).reshape(spectrum_filter.shape) if summed else full
        return grad_x, grad_filter, None


class SpatialFA(nn.Module):
    """Per group X ∈ ℝ^{D'×k}: ortho rFFT along channels, × V_s ∈ ℂ^{(D'/2+1)×k}, inverse rFFT."""

    def __init__(self, channels: int, k: int):
        super().__init__()
        self.channels = channels
        weight = torch.zeros(k, channels // 2 + 1, 2)
        weight[..., 0] = 1.0  # 1 + 0j: the identity at initialisation
        self.weight = nn.Parameter(weight)

    def filter(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, S, k, D') → the filtered signal before the GELU."""
        return FourierFilter.apply(x, torch.view_as_complex(self.weight), -1)

    def forward(self, x):
        return F.gelu(self.filter(x))


class TemporalFA(nn.Module):
    """Tokens G ∈ ℝ^{S×D'} in time order: ortho rFFT along tokens, × V_t ∈ ℂ^{(S/2+1)×D'}, inverse
    rFFT with n=S — a per-channel circular convolution over tokens."""

    def __init__(self, tokens: int, channels: int):
        super().__init__()
        self.tokens = tokens
        weight = torch.zeros(tokens // 2 + 1, channels, 2)
        weight[..., 0] = 1.0
        self.weight = nn.Parameter(weight)

    def filter(self, g: torch.Tensor) -> torch.Tensor:
        return FourierFilter.apply(g, torch.view_as_complex(self.weight), 1)

    def forward(self, g):
        return F.gelu(self.filter(g))


class TokenSelfAttention(nn.Module):
    """`secnet_attn`: single-head self-attention over tokens in place of Temporal-FA (residual, so it
    also starts near the identity)."""

    def __init__(self, channels: int):
        super().__init__()
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)

    def forward(self, g):
        q, k, v = self.qkv(g).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(g.shape[-1]), dim=-1)
        return F.gelu(g + self.out(attn @ v))


class PointwiseMLP(nn.Module):
    """`secnet_nofft`: a shared Linear + GELU per position instead of a Fourier filter."""

    def __init__(self, channels: int):
        super().__init__()
        self.linear = nn.Linear(channels, channels)

    def forward(self, x):
        return F.gelu(self.linear(x))


class AttentionPool(nn.Module):
    """a_j = softmax_j(wᵀx_j + b), g = Σ_j a_j x_j over the k neighbours."""

    def __init__(self, channels: int):
        super().__init__()
        self.score = nn.Linear(channels, 1)

    def forward(self, x):  # (B, S, k, D') → (B, S, D')
        return (torch.softmax(self.score(x), dim=2) * x).sum(2)


class ResidualBottleneck(nn.Module):
    """Conv1d D'→D'/2 (BN, GELU) → D' (BN), add the input, GELU; on (B, S, D')."""

    def __init__(self, channels: int):
        super().__init__()
        self.down = nn.Sequential(nn.Conv1d(channels, channels // 2, 1, bias=False), nn.BatchNorm1d(channels // 2),
                                  nn.GELU())
        self.up = nn.Sequential(nn.Conv1d(channels // 2, channels, 1, bias=False), nn.BatchNorm1d(channels))

    def forward(self, g):
        x = g.transpose(1, 2)
        return F.gelu(x + self.up(self.down(x))).transpose(1, 2)


# SECNet ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageOptions:
    """What an ablation changes in a stage; the defaults are SECNet."""

    knn_space: str = "feature"  # feature (EF-KNN) | coord
    learn_w: bool = True
    centroid: str = "ces"  # ces (neighbour mean) | fps
    spatial: str = "fft"  # fft | mlp
    pool: str = "attn"  # attn | max
    temporal: str = "fft"  # fft | attn | mlp


ABLATION_OPTIONS = {
    "secnet": StageOptions(),
    "secnet_nofft": StageOptions(spatial="mlp", pool="max", temporal="mlp"),
    "secnet_attn": StageOptions(temporal="attn"),
    "secnet_coord_knn": StageOptions(knn_space="coord"),
    "secnet_fixed_w": StageOptions(learn_w=False),
    "secnet_fps_centroid": StageOptions(centroid="fps"),
    "secnet_no_polarity": StageOptions(),  # the input is changed, not the network
    "secnet_no_pt": StageOptions(),
}


class SECNetStage(nn.Module):
    def __init__(self, d_in: int, groups: int, k: int, options: StageOptions):
        super().__init__()
        self.groups, self.k, self.options = groups, k, options
        d_out = 2 * d_in + 4
        self.w = nn.Parameter(torch.ones(4), requires_grad=options.learn_w)
        self.spatial = SpatialFA(d_out, k) if options.spatial == "fft" else PointwiseMLP(d_out)
        self.pool = AttentionPool(d_out) if options.pool == "attn" else None
        self.temporal = {"fft": lambda: TemporalFA(groups, d_out), "attn": lambda: TokenSelfAttention(d_out),
                         "mlp": lambda: PointwiseMLP(d_out)}[options.temporal]()
        self.residual = ResidualBottleneck(d_out)
        self.timer = None

    def group(self, coords, feats, start):
        """D-FPS, EF-KNN, CES and group normalisation → (grouped (B,S,k,D'), new coords, fps idx, nbrs)."""
        scaled = coords * self.w
        with _timed(self, "grouping"):
            fps = farthest_point_sample(scaled[..., :3].detach(), self.groups, start)
            space = feats if self.options.knn_space == "feature" else scaled[..., :3]
            space = space.detach()
            neighbours = knn(gather(space, fps), space, self.k)
        nb_xyz = gather(scaled, neighbours)  # (B, S, k, 4)
        centres = nb_xyz.mean(2) if self.options.centroid == "ces" else gather(scaled, fps)
        grouped = torch.cat([gather(feats, neighbours), nb_xyz], dim=-1)
        centred = grouped - grouped.mean(2, keepdim=True)
        # The sample's std over all groups: the centred values have mean 0, so it is the norm over
        # √(n−1) (torch's std costs ≈ 25x as much here, up to ≈ 10 % of a training step).
        flat = centred.flatten(1)
        std = (torch.linalg.vector_norm(flat, dim=-1) / math.sqrt(flat.shape[1] - 1))[:, None, None, None]
        anchor = gather(feats, fps)[:, :, None].expand(-1, -1, self.k, -1)
        return torch.cat([centred / (std + 1e-5), anchor], dim=-1), centres, fps, neighbours

    def forward(self, coords, feats, start):
        grouped, centres, _, _ = self.group(coords, feats, start)
        with _timed(self, "spatial_fa"):
            x = self.spatial(grouped)
        with _timed(self, "pool"):
            g = self.pool(x) if self.pool is not None else x.max(2).values
        with _timed(self, "temporal_fa"):
            g = self.temporal(g)
        with _timed(self, "residual"):
            g = self.residual(g)
        return centres, g


class Head(nn.Module):
    """mean-pool ‖ max-pool over tokens → Dropout 0.1 → Linear(2D,256) → BN → GELU → Dropout 0.5 → Linear."""

    def __init__(self, channels: int, n_classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Dropout(0.1), nn.Linear(2 * channels, 256), nn.BatchNorm1d(256), nn.GELU(),
                                 nn.Dropout(0.5), nn.Linear(256, n_classes))

    def forward(self, g):  # (B, S, D)
        return self.net(torch.cat([g.mean(1), g.max(1).values], dim=-1))


class SECNet(nn.Module):
    def __init__(self, arch: Arch, options: StageOptions = StageOptions(), seed: int = 0):
        super().__init__()
        self.arch = arch
        widths = arch.widths
        self.embed = nn.Sequential(nn.Conv1d(4, arch.d0, 1, bias=False), nn.BatchNorm1d(arch.d0), nn.GELU())
        self.stages = nn.ModuleList(SECNetStage(widths[i], s, arch.k, options) for i, s in enumerate(arch.groups))
        self.head = Head(widths[-1], arch.n_classes)
        self.fps_generator = torch.Generator().manual_seed(seed)  # seeded random FPS start in training
        self.timer = None

    def set_timer(self, timer: PartTimer | None):
        self.timer = timer
        for stage in self.stages:
            stage.timer = timer

    def fps_start(self, batch: int, n: int, device) -> torch.Tensor:
        if self.training:
            return torch.randint(n, (batch,), generator=self.fps_generator).to(device)
        return torch.zeros(batch, dtype=torch.long, device=device)

    def forward(self, cloud: torch.Tensor) -> torch.Tensor:
        with _timed(self, "embed"):
            feats = self.embed(cloud.transpose(1, 2)).transpose(1, 2)
        coords = cloud
        for stage in self.stages:
            coords, feats = stage(coords, feats, self.fps_start(cloud.shape[0], coords.shape[1], cloud.device))
        with _timed(self, "head"):
            return self.head(feats)


# baselines --------------------------------------------------------------------------------------
class SetAbstraction(nn.Module):
    """PointNet++ SSG: FPS on (t, x, y), kNN on coordinates, shared MLP on [relative xyz ‖ feature],
    max over neighbours. Polarity never enters the grouping."""

    def __init__(self, d_in: int, groups: int, k: int):
        super().__init__()
        self.groups, self.k = groups, k
        d_out = 2 * d_in + 4
        self.mlp = nn.Sequential(nn.Conv2d(d_in + 3, d_out, 1, bias=False), nn.BatchNorm2d(d_out), nn.ReLU(),
                                 nn.Conv2d(d_out, d_out, 1, bias=False), nn.BatchNorm2d(d_out), nn.ReLU())

    def forward(self, xyz, feats, start):
        fps = farthest_point_sample(xyz, self.groups, start)
        centres = gather(xyz, fps)
        neighbours = knn(centres, xyz, self.k)
        grouped = torch.cat([gather(xyz, neighbours) - centres[:, :, None], gather(feats, neighbours)], -1)
        return centres, self.mlp(grouped.permute(0, 3, 1, 2)).max(-1).values.transpose(1, 2)


class PointNet2(nn.Module):
    def __init__(self, arch: Arch, seed: int = 0):
        super().__init__()
        widths = arch.widths
        self.embed = nn.Sequential(nn.Conv1d(4, arch.d0, 1, bias=False), nn.BatchNorm1d(arch.d0), nn.ReLU())
        self.stages = nn.ModuleList(SetAbstraction(widths[i], s, arch.k) for i, s in enumerate(arch.groups))
        self.head = Head(widths[-1], arch.n_classes)
        self.fps_generator = torch.Generator().manual_seed(seed)

    def forward(self, cloud):
        feats = self.embed(cloud.transpose(1, 2)).transpose(1, 2)
        xyz = cloud[..., :3]
        for stage in self.stages:
            start = (torch.randint(xyz.shape[1], (xyz.shape[0],), generator=self.fps_generator) if self.training
                     else torch.zeros(xyz.shape[0], dtype=torch.long)).to(xyz.device)
            xyz, feats = stage(xyz, feats, start)
        return self.head(feats)


def event_frames(cloud: torch.Tensor, kind: str, size: tuple[int, int], bins: int = 5) -> torch.Tensor:
    """Rasterise a normalised cloud (B, N, 4) to frames (B, C, H, W):
    frame: 2 channels of per-polarity counts; count: 1 polarity-blind channel; voxel: `bins` time bins,
    bilinear in time, each event adding its polarity ±1."""
    b, n, _ = cloud.shape
    w, h = size
    t, x, y, p = cloud.unbind(-1)
    col = (x * w).long().clamp(0, w - 1)
    row = (y * h).long().clamp(0, h - 1)
    pixel = row * w + col
    positive = (p > 0).float()
    if kind == "count":
        index, weight, channels = pixel, torch.ones_like(t), 1
    elif kind == "frame":
        index, weight, channels = pixel + positive.long() * h * w, torch.ones_like(t), 2
    else:
        pos = t.clamp(0, 1) * (bins - 1)
        low = pos.floor().clamp(max=bins - 2)
        frac = pos - low
        sign = 2 * positive - 1
        index = torch.cat([pixel + low.long() * h * w, pixel + (low.long() + 1) * h * w], 1)
        weight = torch.cat([sign * (1 - frac), sign * frac], 1)
        channels = bins
    frames = torch.zeros(b, channels * h * w, device=cloud.device)
    frames.scatter_add_(1, index, weight)
    frames = frames.view(b, channels, h, w)
    return torch.log1p(frames) if kind != "voxel" else frames


class FrameCNN(nn.Module):
    """3 blocks of conv3×3-BN-ReLU-maxpool (32, 64, 128), global average pool, linear."""

    def __init__(self, kind: str, size: tuple[int, int], n_classes: int, bins: int = 5):
        super().__init__()
        self.kind, self.size, self.bins = kind, size, bins
        channels = {"frame": 2, "count": 1, "voxel": bins}[kind]
        layers = []
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.MaxPool2d(2)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(128, n_classes)

    def forward(self, cloud):
        x = self.features(event_frames(cloud, self.kind, self.size, self.bins))
        return self.classifier(x.mean((2, 3)))


def frame_size(sensor: tuple[int, int], limit: int = 64) -> tuple[int, int]:
    """Raster size for the frame baselines: the sensor, scaled down to at most `limit` per side."""
    scale = min(1.0, limit / max(sensor))
    return max(8, round(sensor[0] * scale)), max(8, round(sensor[1] * scale))


def build_model(variant: str, arch: Arch, sensor: tuple[int, int], seed: int = 0) -> nn.Module:
    if variant in ABLATION_OPTIONS:
        return SECNet(arch, ABLATION_OPTIONS[variant], seed)
    if variant == "pointnet2":
        return PointNet2(arch, seed)
    kind = {"frame_cnn": "frame", "frame_cnn_count": "count", "voxel_cnn": "voxel"}.get(variant)
    if kind is None:
        raise ValueError(f"unknown variant '{variant}'")
    return FrameCNN(kind, frame_size(sensor), arch.n_classes)
