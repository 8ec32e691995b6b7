"""Random projections of per-clip gradients to D dimensions, shared by pool and queries.

- `fwht_columns` / `fwht`: the unnormalised fast Walsh–Hadamard transform (Sylvester order), by
  Kronecker factors, of columns / along the last axis.
- `Fastfood` (Le, Sarlós & Smola 2013): P·g = (1/√D)·[S·H·G·Π·H·B·pad(g)]_rows, with B random
  signs, Π a permutation, G a diagonal Gaussian, S the chi-based row scaling, and a fixed random
  subset of D rows. S_ii = s_i / (‖G‖_F·√n′), s_i ~ χ(n′): each row of S·H·G·Π·H·B then has the
  norm of an n′-dim standard Gaussian vector, like a dense Gaussian matrix, so E‖Pg‖² = ‖g‖².
- `DenseGaussian`: the reference arm, R ∈ ℝ^{D×n} with N(0, 1/D) entries generated from the seed
  in column blocks (block b from its own generator), never held whole.
Everything derives from one seed, so the same seed gives the same projector in every process.
"""
from __future__ import annotations

import numpy as np
import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def sylvester_hadamard(n: int) -> torch.Tensor:
    """H_n = [[H, H], [H, −H]] (n a power of two), unnormalised."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht_columns(x: torch.Tensor, radix_bits: int = 7) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform of every column of x (n, B), n a power of two.

    H_{2^(p+q)} = H_{2^p} ⊗ H_{2^q} in Sylvester order, so the column is viewed as a tensor with
    axes of ≤ 2^radix_bits entries and a small Hadamard matrix multiplies each axis in turn: a few
    matmul passes instead of log₂ n memory-bound butterfly passes (3–5× faster at n = 2^21 on CPU).
    With the transform along the leading axis every pass is a plain (batched) matmul on contiguous
    memory: no transposed copies, 1.5× faster than along the last axis."""
    n = x.shape[0]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    bits = n.bit_length() - 1
    sizes = [1 << radix_bits] * (bits // radix_bits) + ([1 << (bits % radix_bits)] if bits % radix_bits else [])
    width = x.numel() // n
    y, before = x, 1
    for size in sizes:
        y = sylvester_hadamard(size).to(x.dtype) @ y.reshape(before, size, (n // (before * size)) * width)
        before *= size
    return y.reshape(x.shape)


def fwht(x: torch.Tensor, radix_bits: int = 7) -> torch.Tensor:
    """The transform along the last axis of (…, n)."""
    n = x.shape[-1]
    return fwht_columns(x.reshape(-1, n).T.contiguous(), radix_bits).T.reshape(x.shape)


class Fastfood:
    BATCH = 8  # vectors transformed together (columns of one block)

    def __init__(self, n: int, dim: int, seed: int):
        self.n, self.dim, self.n_pad = n, dim, next_pow2(n)
        if dim > self.n_pad:
            raise ValueError(f"projection dim {dim} exceeds the padded gradient length {self.n_pad}")
        rng = np.random.default_rng(seed)
        m = self.n_pad
        # ±1 held as int8 and the permutation as int32 (both exact): 2 + 4 bytes per padded entry instead of 4 + 8
        self.signs = torch.from_numpy(rng.choice(np.array([-1, 1], dtype=np.int8), m))
        self.perm = torch.from_numpy(rng.permutation(m).astype(np.int32))
        gauss = rng.standard_normal(m)
        self.gauss = torch.from_numpy(gauss.astype(np.float32))
        chi = np.sqrt(rng.chisquare(m, m))
        self.scale = torch.from_numpy((chi / (np.linalg.norm(gauss) * np.sqrt(m))).astype(np.float32))
        self.rows = torch.from_numpy(np.sort(rng.choice(m, dim, replace=False)))
        self.row_scale = self.scale[self.rows]  # S only on the D rows kept: all a projection needs

    @classmethod
    def on(cls, n: int, dim: int, device) -> "Fastfood":
        """A projector of `n` → `dim` whose tensors are uninitialised on `device` (for `icml … plan`: the meta
        device, where its shapes and dtypes are what `to` would put on a GPU)."""
        ff = cls.__new__(cls)
        ff.n, ff.dim, ff.n_pad = n, dim, next_pow2(n)
        ff.signs = torch.empty(ff.n_pad, dtype=torch.int8, device=device)
        ff.perm = torch.zeros(ff.n_pad, dtype=torch.int32, device=device)  # a valid index: a CPU run reads it
        ff.gauss = torch.empty(ff.n_pad, device=device)
        ff.scale, ff.rows = None, torch.zeros(dim, dtype=torch.long, device=device)
        ff.row_scale = torch.empty(dim, device=device)
        return ff

    def to(self, device) -> "Fastfood":
        """The projector with B, Π, G and the kept rows of S on `device` (the full S stays behind: `columns` and
        `full` then need the host copy)."""
        device = torch.device(device)
        if device == self.signs.device:
            return self
        ff = Fastfood.__new__(Fastfood)
        ff.n, ff.dim, ff.n_pad, ff.scale = self.n, self.dim, self.n_pad, None
        for name in ("signs", "perm", "gauss", "rows", "row_scale"):
            setattr(ff, name, getattr(self, name).to(device))
        return ff

    def columns(self, g: torch.Tensor) -> torch.Tensor:
        """S·H·G·Π·H·B·pad(g) for a batch (B, n) → (n′, B), all rows, one column per vector."""
        x = torch.zeros(self.n_pad, len(g))
        x[: self.n] = g.T.float() * self.signs[: self.n, None]
        x = torch.index_select(fwht_columns(x), 0, self.perm) * self.gauss[:, None]  # gathers whole rows
        return fwht_columns(x) * self.scale[:, None]

    def full(self, g: torch.Tensor) -> torch.Tensor:
        return self.columns(g).T

    def __call__(self, g: torch.Tensor, batch: int = BATCH) -> torch.Tensor:
        out = []
        for i in range(0, len(g), batch):
            block = self.block(min(batch, len(g) - i), g.device)
            block.put_flat(g[i:i + batch])
            out.append(block.finish())
        return torch.cat(out)

    def block(self, width: int, device=None) -> "FastfoodBlock":
        return FastfoodBlock(self, width, device if device is not None else self.gauss.device)

    def dense_matrix(self) -> torch.Tensor:
        """The explicit D×n matrix: S·H·G·Π·H·B built factor by factor (small n only; for tests)."""
        m = self.n_pad
        hadamard = sylvester_hadamard(m)
        perm = torch.zeros(m, m)
        perm[torch.arange(m), self.perm] = 1.0  # (Π x)_i = x_perm[i]
        full = (torch.diag(self.scale) @ hadamard @ torch.diag(self.gauss) @ perm @ hadamard
                @ torch.diag(self.signs.float()))
        return full[self.rows, : self.n] / np.sqrt(self.dim)


class DenseGaussian:
    def __init__(self, n: int, dim: int, seed: int, block: int = 65536):
        self.n, self.dim, self.seed, self.block = n, dim, seed, block

    def block_matrix(self, b: int) -> torch.Tensor:
        start = b * self.block
        width = min(self.block, self.n - start)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
        return torch.randn((self.dim, width), generator=gen) / np.sqrt(self.dim)

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(g), self.dim)
        for b in range((self.n + self.block - 1) // self.block):
            start = b * self.block
            out += g[:, start:start + self.block].float() @ self.block_matrix(b).T
        return out


class FastfoodBlock:
    """The projection of up to `width` vectors, streamed in: each vector is written into its column of the padded
    input B·pad(g) piece by piece (`put`: a per-clip gradient parameter by parameter, so no flat copy of it is
    ever made), then `finish` applies S·H·G·Π·H to the block and keeps the D rows. The input is the only
    n′ × width tensor held until `finish`, which drops it as soon as the first transform has read it: the peak
    is two n′ × width tensors. Bit for bit `Fastfood.__call__` of the same vectors (the same elementwise
    products in the same order)."""

    def __init__(self, ff: Fastfood, width: int, device):
        self.ff, self.width, self.device = ff, width, device
        self.x = None
        self.filled = 0

    def _input(self) -> torch.Tensor:
        if self.x is None:  # allocated on the first write: a gradient being computed does not share the peak with it
            self.x = torch.zeros(self.ff.n_pad, self.width, device=self.device)
        return self.x

    def put(self, pieces) -> None:
        """The next column from the pieces of one vector in order (e.g. the gradients of the parameters)."""
        x, offset, column = self._input(), 0, self.filled
        for piece in pieces:
            flat = piece.reshape(-1)
            x[offset:offset + len(flat), column] = flat.float() * self.ff.signs[offset:offset + len(flat)]
            offset += len(flat)
        if offset != self.ff.n:
            raise ValueError(f"a vector of {offset} entries, not the projector's {self.ff.n}")
        self.filled += 1

    def put_flat(self, g: torch.Tensor) -> None:
        """Vectors (B, n) at once into the next B columns."""
        x, n = self._input(), self.ff.n
        x[:n, self.filled:self.filled + len(g)] = g.T.float() * self.ff.signs[:n, None]
        self.filled += len(g)

    def finish(self) -> torch.Tensor:
        """(filled, D) projections."""
        ff = self.ff
        y, self.x = fwht_columns(self.x), None
        y = torch.index_select(y, 0, ff.perm)  # gathers whole rows
        y.mul_(ff.gauss[:, None])
        y = fwht_columns(y)[ff.rows] * ff.row_scale[:, None]
        return y[:, :self.filled].T / np.sqrt(ff.dim)
