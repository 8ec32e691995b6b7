"""The two optimizer families of the paper, each one `torch.optim.Optimizer` with two param groups.

Every trainable parameter with ndim ≥ 2 is a "matrix" (including the tied token embedding/LM head
and the position embedding, as in the paper's code); the rest are "vectors".

- mSGD family: matrices follow M₁ = G₁, M_t = μM_{t−1} + G_t (buffer sum: no dampening, no
  Nesterov) and W ← W(1 − η_m λ) − η_m Ψ_p(M_t).
- Adam family: matrices follow R_t = m̂_t/(√v̂_t + ε) (bias-corrected Adam moments) and
  W ← W(1 − η_m λ) − η_m Ψ_p(R_t); with p = 1 this is AdamW.
- Vectors, in both families: W ← W − η_v R_t (AdamW with no weight decay).

Packed QKV weights are split into their three d×d blocks before Ψ_p, and HF GPT-2 `Conv1D`
weights, stored (in, out), are transformed in their logical (out, in) orientation. The layout of
each weight comes from its module: pass `model=` (or the model itself as `named_params`), or all
matrices are read as `nn.Linear`-style (out, in).
"""
from __future__ import annotations

import math
import sys
import warnings
from typing import Iterable, NamedTuple

import torch
from torch import nn

from icml.methods.spectral_optim.psi import psi_many


class VariantSpec(NamedTuple):
    """One row of the paper's configuration table (GPT-2 124M, OpenWebText)."""

    family: str  # "adam" | "msgd"
    p: float  # spectral exponent of Ψ_p
    lr_matrix: float  # peak LR of the matrix group
    lr_vector: float  # peak LR of the vector group
    min_lr: float  # cosine floor of both groups


PAPER_VARIANTS: dict[str, VariantSpec] = {
    "Adam": VariantSpec("adam", 1.0, 4e-3, 3e-4, 3e-6),
    "AdamS": VariantSpec("adam", 0.5, 1e-2, 3e-4, 3e-6),
    "AdamQ": VariantSpec("adam", 0.25, 2e-2, 6e-4, 3e-6),
    "AdamZ": VariantSpec("adam", 0.0, 7e-3, 3e-4, 3e-6),
    "mSGD": VariantSpec("msgd", 1.0, 5.0, 3e-4, 1e-6),
    "mSGDS": VariantSpec("msgd", 0.5, 0.2, 3e-4, 1e-6),
    "mSGDQ": VariantSpec("msgd", 0.25, 4e-2, 3e-4, 1e-6),
    "mSGDZ": VariantSpec("msgd", 0.0, 7e-3, 3e-4, 1e-6),  # Muon
}

# Ablations: (base variant, the optimizer keyword each one forces).
ABLATIONS: dict[str, tuple[str, dict]] = {
    "AdamS_svd": ("AdamS", {"psi_method": "svd"}),  # exact Ψ_½, isolates the approximation error
    "mSGDZ_nosplit": ("mSGDZ", {"split_qkv": False}),  # fused QKV transformed as one matrix
    "mSGDZ_embvec": ("mSGDZ", {"embeddings_as_vectors": True}),  # the common Muon convention
}

VARIANTS: dict[str, VariantSpec] = {
    **PAPER_VARIANTS,
    **{name: PAPER_VARIANTS[base] for name, (base, _) in ABLATIONS.items()},
}

LAYOUTS = ("linear", "conv1d", "other")


def param_layout(model: nn.Module) -> dict[str, str]:
    """Storage layout of every parameter of `model`, by qualified name.

    "conv1d": the weight of an HF `transformers.pytorch_utils.Conv1D`, stored (in, out);
    "linear": the weight of an `nn.Linear`, stored (out, in); "other": everything else, read as is.
    A tied weight appears under each of its names.
    """
    # A model that holds Conv1D modules has imported transformers already; looking it up instead of
    # importing keeps this module free of the (slow) transformers import.
    hf_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d_type = getattr(hf_utils, "Conv1D", None)
    layouts: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if param_name == "weight" and conv1d_type is not None and isinstance(module, conv1d_type):
                layouts[name] = "conv1d"
            elif param_name == "weight" and isinstance(module, nn.Linear):
                layouts[name] = "linear"
            else:
                layouts.setdefault(name, "other")
    return layouts


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(pattern in name for pattern in patterns)


def _logical_shape(param: torch.Tensor, layout: str) -> tuple[int, int]:
    """(out, in) of a matrix parameter; trailing dims of >2-D weights count as inputs."""
    if layout == "conv1d":
        return param.shape[1], param.shape[0]
    return param.shape[0], math.prod(param.shape[1:])


class SpectralOptimizer(torch.optim.Optimizer):
    """Adam/mSGD with Ψ_p on matrix updates; see the module docstring for the update rules.

    `named_params`: (name, parameter) pairs, as `model.named_parameters()` yields them (tied weights
    once), or the model itself. `model=`: the module the names belong to, used to find Conv1D
    weights (`param_layout`). An ablation variant (`AdamS_svd`, `mSGDZ_nosplit`, `mSGDZ_embvec`)
    forces its keyword over the one passed. Param groups: [0] kind="matrix", [1] kind="vector";
    each has its own `lr`, so `torch.optim.lr_scheduler` schedulers act per group.
    """

    def __init__(self, named_params, variant: str, lr_matrix: float, lr_vector: float,
                 betas: tuple[float, float] = (0.9, 0.95), momentum: float = 0.9, eps: float = 1e-8,
                 weight_decay: float = 0.0, ns_iters: int = 15, split_qkv: bool = True,
                 qkv_patterns: tuple[str, ...] = ("c_attn", "qkv", "query_key_value"),
                 embeddings_as_vectors: bool = False,
                 embedding_patterns: tuple[str, ...] = ("wte", "wpe", "embed", "lm_head"),
                 psi_method: str = "ns", model: nn.Module | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant '{variant}'; valid: {', '.join(VARIANTS)}")
        forced = ABLATIONS.get(variant, (variant, {}))[1]
        split_qkv = forced.get("split_qkv", split_qkv)
        embeddings_as_vectors = forced.get("embeddings_as_vectors", embeddings_as_vectors)
        psi_method = forced.get("psi_method", psi_method)
        self._check_hyperparameters(lr_matrix, lr_vector, betas, momentum, eps, weight_decay,
                                    ns_iters, psi_method)

        spec = VARIANTS[variant]
        self.variant = variant
        self.family = spec.family
        self.p = spec.p
        self.ns_iters = int(ns_iters)
        self.psi_method = psi_method
        self.split_qkv = bool(split_qkv)
        self.embeddings_as_vectors = bool(embeddings_as_vectors)

        if isinstance(named_params, nn.Module):
            model = named_params if model is None else model
            named_params = named_params.named_parameters()
        layouts = param_layout(model) if model is not None else {}

        matrices, matrix_names, matrix_layouts, packed_qkv = [], [], [], []
        vectors, vector_names = [], []
        seen: set[int] = set()
        for name, param in named_params:
            # named_parameters() already lists a tied weight once; a hand-built list may not.
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            as_vector = param.ndim < 2 or (embeddings_as_vectors and _matches(name, embedding_patterns))
            if as_vector:
                vectors.append(param)
                vector_names.append(name)
                continue
            layout = layouts.get(name, "linear")
            out_features, in_features = _logical_shape(param, layout)
            matrices.append(param)
            matrix_names.append(name)
            matrix_layouts.append(layout)
            # The role (name) identifies a fused QKV; the shape check guards the three-way split.
            is_qkv = self.split_qkv and _matches(name, qkv_patterns)
            packed_qkv.append(is_qkv and out_features == 3 * in_features)
            if is_qkv and in_features == 3 * out_features and layout != "conv1d":
                warnings.warn(f"'{name}' looks like a fused QKV stored (in, out) (a Conv1D?) but its "
                              "layout is unknown, so it is not split: pass model= to SpectralOptimizer",
                              stacklevel=2)

        defaults = dict(lr=lr_matrix, betas=tuple(betas), eps=eps, momentum=momentum, weight_decay=0.0)
        # Names are set here rather than passed as (name, param) pairs: torch only records them for
        # non-empty groups, and then refuses a mix of named and unnamed groups.
        groups = [
            dict(params=matrices, param_names=matrix_names, kind="matrix", lr=lr_matrix,
                 weight_decay=weight_decay, param_layouts=matrix_layouts, packed_qkv=packed_qkv),
            dict(params=vectors, param_names=vector_names, kind="vector", lr=lr_vector,
                 weight_decay=0.0),  # vectors never decay
        ]
        super().__init__(groups, defaults)

    @staticmethod
    def _check_hyperparameters(lr_matrix, lr_vector, betas, momentum, eps, weight_decay, ns_iters,
                               psi_method):
        if lr_matrix < 0 or lr_vector < 0:
            raise ValueError(f"learning rates must be >= 0, not {lr_matrix} / {lr_vector}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), not {betas}")
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, not {momentum}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, not {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, not {weight_decay}")
        if ns_iters < 1:
            raise ValueError(f"ns_iters must be >= 1, not {ns_iters}")
        if psi_method not in ("ns", "svd"):
            raise ValueError(f"psi_method must be 'ns' or 'svd', not '{psi_method}'")

    # ------------------------------------------------------------------------------------------
    # The two directions Ψ_p is applied to, and Ψ_p itself.
    # ------------------------------------------------------------------------------------------

    def _rms_normalised(self, param: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """R_t = m̂_t/(√v̂_t + ε), the AdamW update direction; advances the Adam moments."""
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"]
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        first_moment = state["exp_avg"] / (1.0 - beta1 ** step)
        second_moment_root = state["exp_avg_sq"].sqrt() / math.sqrt(1.0 - beta2 ** step)
        return first_moment / (second_moment_root + group["eps"])

    def _momentum(self, param: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """M_t = μM_{t−1} + G_t with M₁ = G₁: a plain buffer sum, not an EMA."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = grad.detach().clone()
        else:
            state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
        return state["momentum_buffer"]

    def _spectral(self, directions: list[torch.Tensor], layouts: list[str], packed_qkv: list[bool]
                  ) -> list[torch.Tensor]:
        """Ψ_p of every matrix update of a step, each in its logical (out, in) orientation with
        QKV blocks apart; all of them go through one `psi_many` call, which batches equal shapes
        (the layers share shapes, and so do the three QKV blocks)."""
        if self.p == 1.0:
            return directions
        blocks, block_counts = [], []
        for direction, layout, packed in zip(directions, layouts, packed_qkv):
            logical = direction.mT if layout == "conv1d" else direction.reshape(direction.shape[0], -1)
            # A packed (3d, d) QKV is three d×d row blocks, transformed separately.
            parts = logical.chunk(3, dim=0) if packed else (logical,)
            blocks.extend(parts)
            block_counts.append(len(parts))
        transformed = iter(psi_many(blocks, self.p, self.ns_iters, self.psi_method))
        updates = []
        for direction, layout, count in zip(directions, layouts, block_counts):
            parts = [next(transformed) for _ in range(count)]
            logical = torch.cat(parts, dim=0) if count > 1 else parts[0]
            updates.append(logical.mT if layout == "conv1d" else logical.reshape(direction.shape))
        return updates

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "matrix":
                self._step_matrices(group)
            else:
                self._step_vectors(group)
        return loss

    def _step_matrices(self, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        params, directions, layouts, packed_qkv = [], [], [], []
        for param, layout, packed in zip(group["params"], group["param_layouts"], group["packed_qkv"]):
            if param.grad is None:
                continue
            grad = self._dense_grad(param)
            if self.family == "adam":
                directions.append(self._rms_normalised(param, grad, group))
            else:
                directions.append(self._momentum(param, grad, group))
            params.append(param)
            layouts.append(layout)
            packed_qkv.append(packed)
        for param, update in zip(params, self._spectral(directions, layouts, packed_qkv)):
            if decay != 0.0:
                param.mul_(1.0 - lr * decay)
            param.add_(update, alpha=-lr)

    def _step_vectors(self, group: dict) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            param.add_(self._rms_normalised(param, self._dense_grad(param), group), alpha=-group["lr"])

    @staticmethod
    def _dense_grad(param: torch.Tensor) -> torch.Tensor:
        if param.grad.is_sparse:
            raise RuntimeError("SpectralOptimizer does not support sparse gradients")
        return param.grad


def lr_schedule(step: int, total_steps: int, peak: float, warmup_steps: int, min_lr: float) -> float:
    """Linear warmup peak·(step+1)/(warmup+1), then cosine from peak down to min_lr at total_steps."""
    if step < warmup_steps:
        return peak * (step + 1) / (warmup_steps + 1)
    if step >= total_steps:
        return min_lr
    decay_ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (peak - min_lr)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors of the optimizer's per-parameter state."""
    return sum(value.numel() * value.element_size()
               for state in opt.state.values() for value in state.values() if torch.is_tensor(value))
