"""The effective-transformation mode of DAVE: patch a transformers ViT so that its forward values are
unchanged (bit for bit) while its backward pass is the Jacobian of the effective map L(X)·X.

Every sublayer is written F(X) = L(X)·X + b and the operator variation (D_X L[·])·X is dropped:
- attention: out = sg(softmax(QKᵀ·s)) @ V, so no gradient flows through Q or K;
- GELU: act(x) = x·sg(Φ(x)) for the exact erf GELU (never divides by x); x·sg(act(x)/x) otherwise, guarded at 0;
- LayerNorm (every one, the final included): y = γ ⊙ (Cx)·sg(1/√(var(x)+eps)) + β, C = I − 11ᵀ/n.
Linear layers and the patch-embedding conv are untouched.

The forward value is kept exactly with `value.detach() + (lin − lin.detach())`: the bracket is an exact
zero in the forward pass and carries d lin/dx in the backward pass. `effective_mode` restores every
patched module on exit, exceptions included.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATION_ATTRIBUTES = ("activation_fn", "intermediate_act_fn")  # ViTMLP (transformers 5) / ViTIntermediate (4.x)
RATIO_GUARD = 1e-6


def _with_backward(value: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """`value` in the forward pass, the gradient of `linear` in the backward pass."""
    return value.detach() + (linear - linear.detach())


def _is_exact_gelu(act: nn.Module) -> bool:
    if isinstance(act, nn.GELU):
        return act.approximate == "none"
    # transformers' GELUActivation wraps F.gelu or its python erf form: both exact (patched by attribute, not type)
    return type(act).__name__ == "GELUActivation"


class EffectiveActivation(nn.Module):
    """act(x) forward; backward as x·sg(act(x)/x), with act(x)/x = Φ(x) for the exact GELU."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act
        self.exact_gelu = _is_exact_gelu(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = self.act(x)
        if self.exact_gelu:
            gate = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # Φ(x) = GELU(x)/x
        else:
            safe = torch.where(x.abs() < RATIO_GUARD, torch.full_like(x, RATIO_GUARD), x)
            gate = torch.where(x.abs() < RATIO_GUARD, torch.full_like(x, 0.5), value / safe)
        return _with_backward(value, x * gate.detach())


def _layer_norm_forward(module: nn.LayerNorm):
    def forward(x: torch.Tensor) -> torch.Tensor:
        value = F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
        dims = tuple(range(-len(module.normalized_shape), 0))
        centred = x - x.mean(dim=dims, keepdim=True)  # C x
        inv_sd = torch.rsqrt(x.var(dim=dims, unbiased=False, keepdim=True) + module.eps)
        linear = centred * inv_sd.detach()
        if module.weight is not None:
            linear = linear * module.weight
        if module.bias is not None:
            linear = linear + module.bias
        return _with_backward(value, linear)

    return forward


def _attention_forward(module: nn.Module):
    """transformers 5 ViTAttention with the eager computation and detached probabilities."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * module.scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs.detach(), value).transpose(1, 2).contiguous()
        out = module.o_proj(out.reshape(*input_shape, -1).contiguous())
        return out, probs

    return forward


def attention_modules(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if type(m).__name__ in ("ViTAttention", "DeiTAttention")]
    for m in found:
        if not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            raise ValueError(f"{type(m).__name__} has an unknown layout (transformers {_version()}); "
                             "explain-vit supports the transformers>=5 ViT attention (q/k/v/o_proj)")
    return found


def _version() -> str:
    import transformers

    return transformers.__version__


def check_eager(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl != "eager":
        raise ValueError(f"the model uses attn_implementation='{impl}'; load it with attn_implementation='eager'")


@contextmanager
def effective_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model's input gradient is W_eff(x); every module is restored afterwards."""
    check_eager(model)
    patched_forward: list[nn.Module] = []
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for module in attention_modules(model):
            module.forward = _attention_forward(module)
            patched_forward.append(module)
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.forward = _layer_norm_forward(module)
                patched_forward.append(module)
        for module in list(model.modules()):
            for name in ACTIVATION_ATTRIBUTES:
                act = getattr(module, name, None)
                if isinstance(act, nn.Module) and not isinstance(act, EffectiveActivation):
                    setattr(module, name, EffectiveActivation(act))
                    swapped.append((module, name, act))
        yield model
    finally:
        for module in patched_forward:
            module.__dict__.pop("forward", None)  # back to the class's forward
        for module, name, act in swapped:
            setattr(module, name, act)


def is_patched(model: nn.Module) -> bool:
    return any("forward" in m.__dict__ or isinstance(m, EffectiveActivation) for m in model.modules())


def zero_biases(model: nn.Module) -> nn.Module:
    """A copy with every bias zeroed: linear/conv biases, LayerNorm β, CLS token and position embeddings.
    Then the effective network is linear in x for its frozen factors, so Σ W_eff ⊙ x = z_y."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in twin.named_parameters():
            if name.endswith("bias") or name.endswith("cls_token") or name.endswith("position_embeddings"):
                parameter.zero_()
    return twin
