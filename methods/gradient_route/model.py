"""The modular GPT-2 of GRAM: every block's MLP is h ↦ E₁(h) + Σᵢ mᵢ·Eᵢ(h).

E₁ is the block's own transformers `GPT2MLP` (the core); each Eᵢ is a small `GPT2MLP` (GELU-tanh,
biases) for one auxiliary domain. There is no router: which modules run, and with which output
weight mᵢ, is the `route` the trainer sets per micro-batch. Serving deletes modules (weights and
biases go with them); titration scales a module's whole output, bias included.
"""
from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

CORE = "core"


class RoutedMLP(nn.Module):
    """core(h) + Σ_{i in route} wᵢ·auxᵢ(h); route None runs every module present at weight 1."""

    def __init__(self, core: nn.Module, aux: nn.ModuleDict):
        super().__init__()
        self.core = core
        self.aux = aux
        self.route: dict[str, float] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.core(hidden)
        route = self.route if self.route is not None else {name: 1.0 for name in self.aux}
        for name, weight in route.items():
            module_out = self.aux[name](hidden)  # a deleted module is a KeyError, never a silent zero
            out = out + (module_out if weight == 1.0 else weight * module_out)
        return out


def gpt2_config(cfg, vocab_size: int, width: int) -> GPT2Config:
    return GPT2Config(vocab_size=vocab_size, n_positions=cfg.gpt.context, n_embd=cfg.gpt.n_embd,
                      n_layer=cfg.gpt.n_layer, n_head=cfg.gpt.n_head, n_inner=width, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, activation_function="gelu_new",
                      bos_token_id=None, eos_token_id=None)


def _aux_module(config: GPT2Config, width: int, generator: torch.Generator) -> GPT2MLP:
    """GPT-2's own init: N(0, 0.02) in, N(0, 0.02/√(2L)) out (the residual-path scaling), zero biases."""
    module = GPT2MLP(width, config)
    with torch.no_grad():
        module.c_fc.weight.normal_(0.0, config.initializer_range, generator=generator)
        module.c_proj.weight.normal_(0.0, config.initializer_range / math.sqrt(2 * config.n_layer),
                                     generator=generator)
        module.c_fc.bias.zero_()
        module.c_proj.bias.zero_()
    return module


def build_model(cfg, vocab_size: int, width: int, aux: Iterable[str], d_aux: int, seed: int) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel whose MLPs are RoutedMLPs (core width `width`, one d_aux module per name).

    With `cfg.model`, the checkpoint is loaded with from_pretrained and its MLPs become the cores.
    """
    torch.manual_seed(seed)
    if cfg.model is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # every training job loads the checkpoint: no bar per load on stderr
        try:
            # float32 whatever the checkpoint's dtype: the optimisers and every comparison here are float32
            model = GPT2LMHeadModel.from_pretrained(cfg.model, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model '{cfg.model}' is not a GPT-2 checkpoint ({str(exc).splitlines()[0]})") from None
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"model '{cfg.model}' has {model.config.vocab_size} tokens but the data need "
                             f"{vocab_size}; leave tokenizer unset (the model's own) or give the one it was "
                             "trained with")
        model.config.tie_word_embeddings = False
        if model.lm_head.weight is model.transformer.wte.weight:  # untie: the head is a core parameter of its own
            model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    else:
        model = GPT2LMHeadModel(gpt2_config(cfg, vocab_size, width))
    config = model.config
    aux = list(aux)
    for layer, block in enumerate(model.transformer.h):
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        modules = nn.ModuleDict({name: _aux_module(config, d_aux, generator) for name in aux})
        block.mlp = RoutedMLP(block.mlp, modules)
    return model.eval()  # no dropout anywhere: train/eval modes do not differ


def routed_mlps(model: nn.Module) -> list[RoutedMLP]:
    return [m for m in model.modules() if isinstance(m, RoutedMLP)]


def module_names(model: nn.Module) -> list[str]:
    mlps = routed_mlps(model)
    return list(mlps[0].aux.keys()) if mlps else []


def group_of(name: str) -> str:
    """Optimizer group of a parameter: its aux module's name, or core (embeddings, attention, norms,
    unembedding and the core MLPs)."""
    parts = name.split(".")
    if "aux" in parts:
        return parts[parts.index("aux") + 1]
    return CORE


def param_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    groups: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        groups.setdefault(group_of(name), []).append(param)
    return groups


def group_sizes(model: nn.Module) -> dict[str, int]:
    return {group: sum(p.numel() for p in params) for group, params in param_groups(model).items()}


@contextmanager
def routed(model: nn.Module, route: dict[str, float] | None) -> Iterator[None]:
    mlps = routed_mlps(model)
    for mlp in mlps:
        mlp.route = route
    try:
        yield
    finally:
        for mlp in mlps:
            mlp.route = None


def forward(model: nn.Module, inputs: torch.Tensor, route: dict[str, float] | None = None,
            frozen: Iterable[str] = ()) -> torch.Tensor:
    """Logits with the given route; parameters of `frozen` groups enter as detached views, so the
    activations still carry gradient through them (a layer-1 module learns through frozen layers above)."""
    frozen = set(frozen)
    with routed(model, route):
        if not frozen:
            return model(input_ids=inputs, use_cache=False).logits
        params = {name: (p.detach() if group_of(name) in frozen else p) for name, p in model.named_parameters()}
        return torch.func.functional_call(model, params, (), {"input_ids": inputs, "use_cache": False}).logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=pad_id)


def deploy(model: nn.Module, keep: Iterable[str]) -> nn.Module:
    """The served model of a profile: a copy with every other module deleted (weights and biases)."""
    keep = set(keep)
    served = copy.deepcopy(model)
    for mlp in routed_mlps(served):
        for name in [n for n in mlp.aux if n not in keep]:
            del mlp.aux[name]
    return served


class LoRAConv1D(nn.Module):
    """A frozen GPT-2 `Conv1D` (y = x W + b, W of shape in × out) plus a trainable low-rank update x A B.
    B starts at zero, so the wrapped layer starts as the base layer exactly; A ~ N(0, 1/in)."""

    def __init__(self, base: nn.Module, rank: int, generator: torch.Generator):
        super().__init__()
        n_in, n_out = base.weight.shape
        self.base = base
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = nn.Parameter(torch.randn(n_in, rank, generator=generator).to(**like) / math.sqrt(n_in))
        self.lora_b = nn.Parameter(torch.zeros(rank, n_out, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a) @ self.lora_b


def lora_rank(model: nn.Module, d_aux: int) -> int:
    """The rank whose LoRA on c_fc and c_proj of a block has one auxiliary module's parameter count
    (2·n·d_aux weights + d_aux + n biases against r·2·(n + d_mlp)): 13 at the default."""
    n_embd, d_mlp = routed_mlps(model)[0].core.c_fc.weight.shape
    return max(1, round((2 * n_embd * d_aux + d_aux + n_embd) / (2 * (n_embd + d_mlp))))


def add_lora(model: nn.Module, rank: int, seed: int) -> list[nn.Parameter]:
    """Freeze every parameter and wrap each core MLP's c_fc and c_proj in a LoRAConv1D (in place);
    returns the LoRA parameters, the only ones left trainable."""
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for mlp in routed_mlps(model):
        mlp.core.c_fc = LoRAConv1D(mlp.core.c_fc, rank, generator)
        mlp.core.c_proj = LoRAConv1D(mlp.core.c_proj, rank, generator)
    return [p for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))]


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{layer path: A B}: the weight update of every wrapped layer (what serving adds to the base)."""
    return {name: module.lora_a.detach() @ module.lora_b.detach() for name, module in model.named_modules()
            if isinstance(module, LoRAConv1D)}


@torch.no_grad()
def merge_lora(model: nn.Module, deltas: Iterable[dict[str, torch.Tensor]]) -> nn.Module:
    """The served FT-LoRA model of a profile: the base with every retained domain's update added in place."""
    modules = dict(model.named_modules())
    for delta in deltas:
        for name, update in delta.items():
            modules[name].weight += update.to(modules[name].weight)
    return model


def merged_gpt2(model: GPT2LMHeadModel, weights: dict[str, float] | None = None) -> GPT2LMHeadModel:
    """A plain GPT2LMHeadModel computing the same function: GELU acts per hidden unit, so core and
    modules concatenate into one MLP of width d_core + Σ d_aux (module i's c_proj rows and bias × wᵢ).
    It saves and loads with save_pretrained / from_pretrained."""
    mlps = routed_mlps(model)
    names = list(mlps[0].aux.keys())
    weights = {name: 1.0 for name in names} if weights is None else weights
    width = mlps[0].core.c_fc.weight.shape[1] + sum(mlps[0].aux[n].c_fc.weight.shape[1] for n in names)
    config = copy.deepcopy(model.config)
    config.n_inner = width
    merged = GPT2LMHeadModel(config)
    state = {k: v for k, v in model.state_dict().items() if ".mlp." not in k}
    for layer, mlp in enumerate(mlps):
        parts = [mlp.core] + [mlp.aux[n] for n in names]
        scale = [1.0] + [weights[n] for n in names]
        prefix = f"transformer.h.{layer}.mlp."
        state[prefix + "c_fc.weight"] = torch.cat([m.c_fc.weight for m in parts], dim=1)
        state[prefix + "c_fc.bias"] = torch.cat([m.c_fc.bias for m in parts])
        state[prefix + "c_proj.weight"] = torch.cat([w * m.c_proj.weight for m, w in zip(parts, scale)], dim=0)
        state[prefix + "c_proj.bias"] = sum(w * m.c_proj.bias for m, w in zip(parts, scale))
    merged.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return merged.eval()
