"""The two optimizer families of the paper, each one `torch.optim.Optimizer` with two param groups.

Every trainable parameter with ndim ≥ 2 is a "matrix" (including the tied token embedding/LM head
and the position embedding, as in the paper's code); the rest are "vectors".

- mSGD family: matrices follow M₁ = G₁, M_t = μM_{t−1} + G_t (buffer sum: no dampening, no
  Nesterov) and W ← W(1 − η_m λ) − η_m Ψ_p(M_t).
- Adam family: matrices follow R_t = m̂_t/(√v̂_t + ε) (bias-corrected Adam moments) and
  W ← W(1 − η_m λ) − η_m Ψ_p(R_t); with p = 1 this is AdamW.
- Vectors, in both families: W ← W − η_v R_t (AdamW with no weight decay).

Packed QKV weights are split into their Q, K and V blocks before Ψ_p, by the model's row layout
(contiguous for GPT-2's c_attn, per head for GPT-NeoX/Pythia and Bloom), and HF GPT-2 `Conv1D`
weights, stored (in, out), are transformed in their logical (out, in) orientation. Layouts come
from the model, so every matrix must be a parameter of `model=` (or of the model passed as
`params`): a bare tensor cannot tell whether it is a Conv1D weight or a fused QKV, and reading it
as (out, in) would silently halve or double GPT-2's MLP updates and leave c_attn unsplit.
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


def parameters_of(model: nn.Module | None) -> dict[int, tuple[str, str]]:
    """id(param) -> (qualified name, storage layout) of every parameter of `model` (tied: first name)."""
    if model is None:
        return {}
    layouts = param_layout(model)
    return {id(param): (name, layouts[name]) for name, param in model.named_parameters()}


def _matches(name: str | None, patterns: Iterable[str]) -> bool:
    return name is not None and any(pattern in name for pattern in patterns)


def _logical_shape(param: torch.Tensor, layout: str) -> tuple[int, int]:
    """(out, in) of a matrix parameter; trailing dims of >2-D weights count as inputs."""
    if layout == "conv1d":
        return param.shape[1], param.shape[0]
    return param.shape[0], math.prod(param.shape[1:])


# Fused QKV row layouts, by the HF `model_type` that uses them. "contiguous": the output rows are
# [Q | K | V] (GPT-2's c_attn); "per_head": [head 0: q k v | head 1: q k v | …], each part
# head_dim rows (GPT-NeoX/Pythia's and Bloom's query_key_value reshape to (heads, 3, head_dim)).
PER_HEAD_QKV_MODELS = ("gpt_neox", "bloom")
QKV_LAYOUTS = ("contiguous", "per_head")
QKV_BLOCKS = ("matrix", "head")


def model_qkv_layout(model: nn.Module | None) -> tuple[str | None, int | None]:
    """(layout, number of heads) of the model's fused QKV weights, read from its HF config.

    (None, heads) where the model type is unknown: a fused weight is then split contiguously only
    when its name is an unambiguous one (see `SpectralOptimizer`)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    model_type = getattr(config, "model_type", None)
    if model_type in PER_HEAD_QKV_MODELS:
        return "per_head", heads
    if model_type == "gpt2":
        return "contiguous", heads
    return None, heads


def qkv_row_blocks(layout: str, width: int, heads: int | None, blocks: str) -> list[torch.Tensor]:
    """Row indices of each block Ψ_p is applied to, for a fused (3·width, in) QKV direction.

    blocks="matrix": three blocks, all of Q's rows, then K's, then V's (in head order), as the paper
    splits GPT-2's c_attn; blocks="head": one block per (role, head), 3·heads blocks."""
    if layout == "contiguous" and blocks == "matrix":
        return [torch.arange(role * width, (role + 1) * width) for role in range(3)]
    if not heads or width % heads:
        raise ValueError(f"splitting a fused QKV {'per head' if layout == 'per_head' else 'into heads'} "
                         f"needs the number of heads (got {heads} for width {width}): pass model= or num_heads=")
    head_dim = width // heads
    rows = torch.arange(3 * width).reshape(3, heads, head_dim) if layout == "contiguous" else \
        torch.arange(3 * width).reshape(heads, 3, head_dim).transpose(0, 1)  # -> (role, head, head_dim)
    if blocks == "matrix":
        return [rows[role].reshape(-1) for role in range(3)]
    return [rows[role, head] for role in range(3) for head in range(heads)]


class SpectralOptimizer(torch.optim.Optimizer):
    """Adam/mSGD with Ψ_p on matrix updates; see the module docstring for the update rules.

    `params` takes what `torch.optim.AdamW` takes: the model itself, an iterable of tensors, of
    (name, tensor) pairs (`model.named_parameters()`, tied weights once), or of param-group dicts
    whose "params" is any of those, with per-group options (`lr`, `lr_matrix`, `lr_vector`,
    `weight_decay`, `betas`, `eps`, `momentum`). Each group given becomes two groups here, kind
    "matrix" then kind "vector" (possibly empty), so the plain case has [0] matrices and [1]
    vectors; a group's `lr` sets both kinds' LR unless `lr_matrix` / `lr_vector` say otherwise, and
    `torch.optim.lr_scheduler` schedulers act per group. `add_param_group` takes the same dicts.

    Every matrix (ndim ≥ 2) must be a parameter of the model: pass the model itself as `params`,
    or `model=` with tensors, pairs or groups; a matrix without it is refused (ValueError), since a
    bare tensor cannot say whether it is an HF Conv1D weight stored (in, out) or a fused QKV.
    Vectors need no model. The model gives each matrix's storage layout, looked up by tensor
    (Conv1D weights are (in, out), `param_layout`), and, from its HF config, the fused QKV row
    layout and head count (`model_qkv_layout`); `qkv_layout=` / `num_heads=` declare them for
    other models. Names drive two rules, the fused-QKV split and `embeddings_as_vectors`; a tensor
    given without a name takes its name from the model. `qkv_blocks`: "matrix" (Q, K and V each
    transformed whole, the paper's split of GPT-2) or "head" (each head's Q, K and V apart). An
    ablation variant (`AdamS_svd`, `mSGDZ_nosplit`, `mSGDZ_embvec`) forces its keyword over the one
    passed. `lr_matrix` / `lr_vector` default to the variant's peak LRs of the paper.
    """

    def __init__(self, params, variant: str, lr_matrix: float | None = None, lr_vector: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), momentum: float = 0.9, eps: float = 1e-8,
                 weight_decay: float = 0.0, ns_iters: int = 15, split_qkv: bool = True,
                 qkv_patterns: tuple[str, ...] = ("c_attn", "qkv", "query_key_value"),
                 qkv_layout: str | None = None, num_heads: int | None = None, qkv_blocks: str = "matrix",
                 embeddings_as_vectors: bool = False,
                 embedding_patterns: tuple[str, ...] = ("wte", "wpe", "embed", "lm_head"),
                 psi_method: str = "ns", model: nn.Module | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant '{variant}'; valid: {', '.join(VARIANTS)}")
        spec = VARIANTS[variant]
        lr_matrix = spec.lr_matrix if lr_matrix is None else lr_matrix
        lr_vector = spec.lr_vector if lr_vector is None else lr_vector
        forced = ABLATIONS.get(variant, (variant, {}))[1]
        split_qkv = forced.get("split_qkv", split_qkv)
        embeddings_as_vectors = forced.get("embeddings_as_vectors", embeddings_as_vectors)
        psi_method = forced.get("psi_method", psi_method)
        self._check_hyperparameters(lr_matrix, lr_vector, betas, momentum, eps, weight_decay,
                                    ns_iters, psi_method)
        if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"qkv_layout must be one of {', '.join(QKV_LAYOUTS)}, not '{qkv_layout}'")
        if qkv_blocks not in QKV_BLOCKS:
            raise ValueError(f"qkv_blocks must be one of {', '.join(QKV_BLOCKS)}, not '{qkv_blocks}'")

        self.variant = variant
        self.family = spec.family
        self.p = spec.p
        self.ns_iters = int(ns_iters)
        self.psi_method = psi_method
        self.split_qkv = bool(split_qkv)
        self.qkv_patterns = tuple(qkv_patterns)
        self.qkv_blocks = qkv_blocks
        self.embeddings_as_vectors = bool(embeddings_as_vectors)
        self.embedding_patterns = tuple(embedding_patterns)

        if isinstance(params, nn.Module):
            model = params if model is None else model
            params = params.named_parameters()
        # Kept, not a snapshot of its parameters: add_param_group may add a layer built later.
        self._model = model
        detected_layout, detected_heads = model_qkv_layout(model)
        self.qkv_layout = qkv_layout or detected_layout
        self.num_heads = num_heads or detected_heads
        self._lr_matrix, self._lr_vector, self._weight_decay = lr_matrix, lr_vector, weight_decay

        defaults = dict(lr=lr_matrix, betas=tuple(betas), eps=eps, momentum=momentum, weight_decay=0.0)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a user's group as a matrix group and a vector group (see the class docstring)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        entries = param_group["params"]
        if isinstance(entries, torch.Tensor):
            entries = [entries]
        elif isinstance(entries, set):
            raise TypeError("optimizer parameters need an ordered collection, not a set")
        options = {key: value for key, value in param_group.items()
                   if key not in ("params", "param_names", "lr_matrix", "lr_vector")}
        lr_matrix = param_group.get("lr_matrix", param_group.get("lr", self._lr_matrix))
        lr_vector = param_group.get("lr_vector", param_group.get("lr", self._lr_vector))
        given_names = list(param_group.get("param_names") or [])
        owned = parameters_of(self._model)

        matrices, matrix_names, matrix_layouts, qkv_layouts = [], [], [], []
        vectors, vector_names = [], []
        seen: set[int] = set()  # within this group; torch refuses a parameter in two groups
        for k, entry in enumerate(entries):
            name, param = entry if isinstance(entry, tuple) else (
                given_names[k] if k < len(given_names) else None, entry)
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {type(param)}")
            model_name, layout = owned.get(id(param), (None, None))
            name = name if name is not None else model_name
            # named_parameters() already lists a tied weight once; a hand-built list may not.
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if param.ndim >= 2 and layout is None:
                label = f"'{name}'" if name else f"of shape {tuple(param.shape)}"
                where = "is not a parameter of model=" if self._model is not None else "comes without model="
                raise ValueError(f"matrix {label} {where}, so its layout (HF Conv1D (in, out), fused QKV) is "
                                 "unknown: pass the model itself, SpectralOptimizer(model, ...), or model=model")
            if param.ndim < 2 or (self.embeddings_as_vectors and _matches(name, self.embedding_patterns)):
                vectors.append(param)
                vector_names.append(name or "")
                continue
            matrices.append(param)
            matrix_names.append(name or "")
            matrix_layouts.append(layout)
            qkv_layouts.append(self._qkv_layout_of(name, param, layout))

        # Names are set here rather than passed as (name, param) pairs: torch only records them for
        # non-empty groups, and then refuses a mix of named and unnamed groups.
        super().add_param_group(dict(options, params=matrices, param_names=matrix_names, kind="matrix",
                                     lr=lr_matrix, weight_decay=param_group.get("weight_decay", self._weight_decay),
                                     param_layouts=matrix_layouts, qkv_layouts=qkv_layouts,
                                     num_heads=self.num_heads, qkv_blocks=self.qkv_blocks))
        super().add_param_group(dict(options, params=vectors, param_names=vector_names, kind="vector",
                                     lr=lr_vector, weight_decay=0.0))  # vectors never decay

    def _qkv_layout_of(self, name: str | None, param: torch.Tensor, layout: str) -> str:
        """"none", "contiguous" or "per_head": how a matrix's fused QKV rows are laid out."""
        if not (self.split_qkv and _matches(name, self.qkv_patterns)):
            return "none"
        out_features, in_features = _logical_shape(param, layout)
        if in_features == 3 * out_features and layout == "other":
            warnings.warn(f"'{name}' looks like a fused QKV stored (in, out), but its module is neither "
                          "nn.Linear nor HF Conv1D, so it is not split", stacklevel=4)
            return "none"
        if out_features != 3 * in_features:  # grouped-query or multi-query fused weights: not three d×d
            return "none"
        if self.qkv_layout is not None:
            return self.qkv_layout
        # No config says how the rows are ordered: only GPT-2's own name is unambiguous.
        if "query_key_value" in name:
            warnings.warn(f"'{name}' is a fused QKV whose row layout is unknown (contiguous or per head), "
                          "so it is not split: pass model= (an HF model) or qkv_layout=", stacklevel=4)
            return "none"
        return "contiguous"

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

    def _spectral(self, directions: list[torch.Tensor], layouts: list[str], qkv_layouts: list[str],
                  group: dict) -> list[torch.Tensor]:
        """Ψ_p of every matrix update of a step, each in its logical (out, in) orientation with
        QKV blocks apart; all of them go through one `psi_many` call, which batches equal shapes
        (the layers share shapes, and so do the QKV blocks)."""
        if self.p == 1.0:
            return directions
        blocks, block_rows = [], []
        for direction, layout, qkv in zip(directions, layouts, qkv_layouts):
            logical = direction.mT if layout == "conv1d" else direction.reshape(direction.shape[0], -1)
            rows = None if qkv == "none" else qkv_row_blocks(qkv, logical.shape[0] // 3, group.get("num_heads"),
                                                             group.get("qkv_blocks", "matrix"))
            blocks.extend([logical] if rows is None else [logical[index] for index in rows])
            block_rows.append(rows)
        transformed = iter(psi_many(blocks, self.p, self.ns_iters, self.psi_method))
        updates = []
        for direction, layout, rows in zip(directions, layouts, block_rows):
            if rows is None:
                logical = next(transformed)
            else:
                logical = torch.empty_like(direction.mT if layout == "conv1d" else direction.reshape(direction.shape[0], -1))
                for index in rows:
                    logical[index] = next(transformed)
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
        params, directions, layouts, qkv_layouts = [], [], [], []
        for param, layout, qkv in zip(group["params"], group["param_layouts"], group["qkv_layouts"]):
            if param.grad is None:
                continue
            grad = self._dense_grad(param)
            if self.family == "adam":
                directions.append(self._rms_normalised(param, grad, group))
            else:
                directions.append(self._momentum(param, grad, group))
            params.append(param)
            layouts.append(layout)
            qkv_layouts.append(qkv)
        for param, update in zip(params, self._spectral(directions, layouts, qkv_layouts, group)):
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
