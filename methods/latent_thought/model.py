"""PonderLM-2 as a wrapper around transformers' Llama: thought slots, the Jacobi-parallel solve, the
exact cached sequential solve, decoding, the baselines of the spec, the init and the FLOPs model.

The wrapper never copies Llama's modelling code: it builds `inputs_embeds`, `position_ids` and an
explicit 4-D causal mask over *slot order*, then calls the inner `LlamaModel` and `lm_head`. The mask
is explicit because transformers reads non-consecutive position ids without a mask as packed
sequences, and because masking by position id would let slot (t,0) see (t,1) (spec pitfall).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no "Loading weights" bar on stderr: the CLI reports its own progress
THOUGHT_KEY = "latent_thought"  # the arm's settings inside the checkpoint's config.json


@dataclass(frozen=True)
class ArmSpec:
    """What an arm name means: kind vanilla | ponderlm2 | pause | loop | ponderlm1."""

    name: str
    kind: str
    K: int = 0  # latent thoughts per token (ponderlm2)
    depth: int = 1  # layer multiplier (vanilla_2x)
    scaled: bool = True  # embeddings × √(2.5 d)
    detach: bool = False  # thoughts detached before feedback (ablation)
    extra: int = 0  # baseline_k extra steps (pause / loop / ponderlm1)


def arm_spec(name: str, K: int = 1, baseline_k: int = 1, scale: bool = True) -> ArmSpec:
    if name in ("vanilla_1x", "vanilla_2x"):
        return ArmSpec(name, "vanilla", depth=2 if name == "vanilla_2x" else 1, scaled=scale)
    if name in ("pause_k1", "loop_k1", "ponderlm1_k1"):
        return ArmSpec(name, name.split("_")[0], scaled=scale, extra=baseline_k)
    match = re.fullmatch(r"ponderlm2(?:_k(\d+))?(_noscale|_detach)?", name)
    if not match:
        raise ValueError(f"unknown arm '{name}'")
    return ArmSpec(name, "ponderlm2", K=int(match.group(1) or K), scaled=scale and match.group(2) != "_noscale",
                   detach=match.group(2) == "_detach")


def tiny_llama_config(tiny, layers: int, vocab: int = 256, max_positions: int = 4096) -> LlamaConfig:
    return LlamaConfig(hidden_size=tiny.hidden, num_hidden_layers=layers, num_attention_heads=tiny.heads,
                       num_key_value_heads=tiny.heads, intermediate_size=tiny.intermediate, vocab_size=vocab,
                       tie_word_embeddings=False, rms_norm_eps=tiny.rms_norm_eps,
                       max_position_embeddings=max_positions, attn_implementation="eager")


def init_weights(lm: LlamaForCausalLM) -> None:
    """Spec 8: every Linear and Embedding ~ N(0, σ²) truncated at ±3σ, σ = √(2/(5d)), so √(2.5d)·E rows have
    unit RMS like the normalised thoughts; o_proj and down_proj further ÷ √(2·n_layers)."""
    d, layers = lm.config.hidden_size, lm.config.num_hidden_layers
    sigma = math.sqrt(2.0 / (5.0 * d))
    with torch.no_grad():
        for name, module in lm.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = sigma / math.sqrt(2 * layers) if name.endswith(("o_proj", "down_proj")) else sigma
                nn.init.trunc_normal_(module.weight, 0.0, std, -3 * std, 3 * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def slot_positions(T: int, slots: int, offset: int = 0, device=None) -> torch.Tensor:
    """(1, T·slots): every slot of token t carries position id offset + t."""
    return (torch.arange(T, device=device) + offset).repeat_interleave(slots).unsqueeze(0)


def slot_causal_mask(n: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, n, past+n) additive mask: query slot i sees key slots ≤ past+i (slot order, not position id)."""
    query = torch.arange(n, device=device).unsqueeze(1) + past
    key = torch.arange(past + n, device=device).unsqueeze(0)
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    return mask.masked_fill(key > query, torch.finfo(dtype).min)[None, None]


def interleave(tokens: torch.Tensor, thoughts: list[torch.Tensor]) -> torch.Tensor:
    """[z_1⁽⁰⁾, z_1⁽¹⁾…z_1⁽ᵏ⁾, z_2⁽⁰⁾, …]: (B, T, d) and k × (B, T, d) → (B, T(k+1), d)."""
    B, T, d = tokens.shape
    return torch.stack([tokens, *thoughts], dim=2).reshape(B, T * (len(thoughts) + 1), d)


@dataclass
class Solve:
    """A Jacobi solve: logits after each number of iterations, and the thought iterates."""

    logits: list[torch.Tensor]  # logits[j]: (B, T, V) after j iterations (the final pass's)
    thoughts: list[torch.Tensor]  # thoughts[j]: (B, T, K, d), the thoughts read by pass j


class ThoughtLM(nn.Module):
    """A causal LM of config.SUPPORTED_FAMILIES (Llama-style decoder) with the spec's arm kinds on top."""

    def __init__(self, lm, spec: ArmSpec, thought_scale: float = 1.0):
        super().__init__()
        self.lm, self.spec, self.thought_scale = lm, spec, thought_scale
        d = lm.config.hidden_size
        self.scale = math.sqrt(2.5 * d) if spec.scaled else 1.0
        if spec.kind == "pause":
            sigma = math.sqrt(2.0 / (5.0 * d))
            self.pause = nn.Parameter(nn.init.trunc_normal_(torch.empty(spec.extra, d), 0, sigma, -3 * sigma, 3 * sigma))

    @property
    def K(self) -> int:
        return self.spec.K

    # --- the pieces -------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.scale * self.lm.model.embed_tokens(ids)

    def decode(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """One decoder pass over slots, causal in slot order after the cached ones → final-norm states."""
        past = cache.get_seq_length() if cache is not None else 0
        mask = slot_causal_mask(embeds.shape[1], past, embeds.dtype, embeds.device)
        out = self.lm.model(inputs_embeds=embeds, attention_mask=mask,
                            position_ids=position_ids.expand(embeds.shape[0], -1), cache=cache,
                            use_cache=cache is not None)
        return out.last_hidden_state

    def feed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The raw final-norm state as the next thought (no projection); × thought_scale."""
        return self.thought_scale * (hidden.detach() if self.spec.detach else hidden)

    # --- PonderLM-2 ------------------------------------------------------------------------------
    def jacobi(self, ids: torch.Tensor, J: int, cache=None, all_iterations: bool = False) -> Solve:
        """Spec 5: K initialisation passes over growing interleavings, J Jacobi iterations, a final pass.

        The pass after j iterations both gives the logits "at J = j" and the (j+1)-th iterate, so
        `all_iterations` returns every J ≤ J at the cost of the largest. `cache` fills in the final
        pass (prefill). Gradients flow through every pass.
        """
        e = self.embed(ids)
        B, T, d = e.shape
        K = self.K
        thoughts: list[torch.Tensor] = []
        for k in range(1, K + 1):  # pass k re-reads stages 1..k-1 and appends stage k
            h = self.decode(interleave(e, thoughts), slot_positions(T, k, device=e.device)).view(B, T, k, d)
            thoughts = [self.feed(h[:, :, j]) for j in range(k)]
        solve = Solve([], [])
        positions = slot_positions(T, K + 1, device=e.device)
        J = J if K else 0
        for j in range(J + 1):
            final = j == J
            keep = all_iterations or final
            if keep and K:
                solve.thoughts.append(torch.stack(thoughts, dim=2))
            h = self.decode(interleave(e, thoughts), positions, cache if final else None).view(B, T, K + 1, d)
            if keep:
                solve.logits.append(self.lm.lm_head(h[:, :, K]))
            thoughts = [self.feed(h[:, :, k]) for k in range(K)]
        return solve

    def step(self, ids: torch.Tensor, position: int, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Spec 7 decoding of one token: e_t at position id `position`, then K fed-back states at the
        same position id: K+1 decoder calls → (logits (B, V), thoughts (B, K, d))."""
        x = self.embed(ids.view(-1, 1))
        pos = torch.full((1, 1), position, dtype=torch.long, device=ids.device)
        thoughts = []
        for k in range(self.K + 1):
            h = self.decode(x, pos, cache)
            if k < self.K:
                x = self.feed(h)
                thoughts.append(x[:, 0])
        return self.lm.lm_head(h[:, 0]), (torch.stack(thoughts, dim=1) if thoughts else None)

    def sequential(self, ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The exact solve: token by token with a KV cache → logits (B, T, V), thoughts (B, T, K, d)."""
        cache = cache if cache is not None else self.new_cache()
        start = self.cached_tokens(cache)
        logits, thoughts = [], []
        for t in range(ids.shape[1]):
            step_logits, step_thoughts = self.step(ids[:, t], start + t, cache)
            logits.append(step_logits)
            thoughts.append(step_thoughts)
        return torch.stack(logits, 1), (torch.stack(thoughts, 1) if self.K else None)

    def new_cache(self):
        return DynamicCache(config=self.lm.config)

    def cached_tokens(self, cache) -> int:
        """Tokens in a cache: its slots (cache position) ÷ (K+1); position ids count tokens."""
        return cache.get_seq_length() // (self.K + 1)

    # --- every arm -------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, J: int = 3) -> torch.Tensor:
        """Next-token logits (B, T, V) of the arm (J only matters for PonderLM-2)."""
        kind = self.spec.kind
        if kind in ("vanilla", "ponderlm2"):
            return self.jacobi(ids, J).logits[-1]
        e = self.embed(ids)
        B, T, d = e.shape
        if kind == "pause":  # k learned pause slots after each token, its position id; logits at the last
            n = self.spec.extra
            pauses = [(math.sqrt(d) * self.pause[i]).expand(B, T, d) for i in range(n)]
            h = self.decode(interleave(e, pauses), slot_positions(T, n + 1, device=e.device)).view(B, T, n + 1, d)
            return self.lm.lm_head(h[:, :, n])
        if kind == "loop":
            return self.lm.lm_head(self.looped(e))
        if kind == "ponderlm1":  # k+1 passes over T; between passes e_t + softmax(W_out h_t)·(sE)
            positions = slot_positions(T, 1, device=e.device)
            x = e
            for _ in range(self.spec.extra):
                probs = torch.softmax(self.lm.lm_head(self.decode(x, positions)), dim=-1)
                x = e + probs @ (self.scale * self.lm.model.embed_tokens.weight)
            return self.lm.lm_head(self.decode(x, positions))
        raise ValueError(f"unknown arm kind {kind}")

    def looped(self, e: torch.Tensor) -> torch.Tensor:
        """The weight-shared layer stack applied k+1 times, the final norm once."""
        inner = self.lm.model
        T = e.shape[1]
        positions = slot_positions(T, 1, device=e.device).expand(e.shape[0], -1)
        mask = slot_causal_mask(T, 0, e.dtype, e.device)
        rotary = inner.rotary_emb(e, position_ids=positions)
        h = e
        for _ in range(self.spec.extra + 1):
            for layer in inner.layers:
                h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return inner.norm(h)

    @property
    def cached_decoding(self) -> bool:
        return self.spec.kind in ("vanilla", "ponderlm2")

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new: int, temperature: float = 0.0, prefill: str = "jacobi",
                 J: int = 3, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        """Prefill (Jacobi J, keeping its final pass's cache, or exact), then exact cached decoding."""
        if not self.cached_decoding:
            raise ValueError(f"{self.spec.name} has no cached decoding; generate with vanilla or ponderlm2 arms")
        cache = self.new_cache()
        if prefill == "jacobi":
            logits = self.jacobi(ids, J, cache=cache).logits[-1][:, -1]
        else:
            logits = self.sequential(ids, cache)[0][:, -1]
        calls_before, out = _decoder_calls(cache), []
        for i in range(max_new):
            if temperature > 0:
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
            else:
                token = logits.argmax(-1)
            out.append(token)
            if i + 1 < max_new:
                logits = self.step(token, ids.shape[1] + i, cache)[0]
        new = torch.stack(out, 1) if out else ids[:, :0]
        steps = max(max_new - 1, 1)
        return new, {"decoder_calls_per_token": (_decoder_calls(cache) - calls_before) / steps if max_new > 1
                     else float(self.K + 1), "cache_length": cache.get_seq_length()}


def _decoder_calls(cache) -> int:
    """Single-slot decoder calls so far = cached slots (each call appends one slot)."""
    return cache.get_seq_length()


# --- building, saving, loading ---------------------------------------------------------------------
def build_arm(spec: ArmSpec, tiny, seed: int, thought_scale: float = 1.0, model_path: str | None = None,
              vocab: int = 256) -> ThoughtLM:
    """Same seed for every arm: the init draws in the same order (the 2x arm has more layers to draw)."""
    torch.manual_seed(seed)
    if model_path is not None:
        from icml.cli import checkpoints

        lm, _ = checkpoints.load_causal_lm(model_path, with_tokenizer=False, attn_implementation="eager")
    else:
        lm = LlamaForCausalLM(tiny_llama_config(tiny, tiny.layers * spec.depth, vocab))
        init_weights(lm)
    return ThoughtLM(lm, spec, thought_scale)


def save_arm(model: ThoughtLM, directory: Path, train_J: list[int]) -> None:
    spec = model.spec
    setattr(model.lm.config, THOUGHT_KEY, {"arm": spec.name, "kind": spec.kind, "K": spec.K, "depth": spec.depth,
                                           "scaled": spec.scaled, "scale": model.scale, "detach": spec.detach,
                                           "extra": spec.extra, "train_J": list(train_J),
                                           "thought_scale": model.thought_scale})
    model.lm.save_pretrained(directory)
    if spec.kind == "pause":
        torch.save(model.pause.detach().cpu(), directory / "pause.pt")


def load_arm(directory: Path, device: str = "cpu") -> ThoughtLM:
    config = json.loads((directory / "config.json").read_text())
    if THOUGHT_KEY not in config:
        raise ValueError(f"'{directory}' has no {THOUGHT_KEY} settings in config.json: not a latent-thought arm")
    s = config[THOUGHT_KEY]
    spec = ArmSpec(s["arm"], s["kind"], s["K"], s["depth"], s["scaled"], s["detach"], s["extra"])
    lm = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager")
    model = ThoughtLM(lm, spec, s["thought_scale"])
    if spec.kind == "pause":
        model.pause.data.copy_(torch.load(directory / "pause.pt", weights_only=True))
    return model.to(device).eval()


# --- FLOPs ----------------------------------------------------------------------------------------
def layer_params(model: ThoughtLM) -> int:
    return sum(p.numel() for p in model.lm.model.layers.parameters())


def pass_flops(P: int, L: int, d: int, n: int) -> float:
    """F(n) = 2·P·n + 2·L·d·n(n+1): one causal pass over n slots (weights + attention scores/values)."""
    return 2.0 * P * n + 2.0 * L * d * n * (n + 1)


def flops_per_token(model: ThoughtLM, T: int, train_J: list[int]) -> dict:
    """train: 3·Σ_passes F(n_p)/T + 6dV (E[J] Jacobi passes); inference: the passes of one forward/T + 2dV."""
    cfg = model.lm.config
    P, L, d, V = layer_params(model), cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    spec = model.spec
    head = 2.0 * d * V
    if spec.kind == "ponderlm2":
        mean_J = sum(train_J) / len(train_J)
        init = sum(pass_flops(P, L, d, k * T) for k in range(1, spec.K + 1))
        train = init + (mean_J + 1) * pass_flops(P, L, d, (spec.K + 1) * T)
        infer = pass_flops(P, L, d, (spec.K + 1) * T)
    elif spec.kind == "pause":
        train = infer = pass_flops(P, L, d, (spec.extra + 1) * T)
    elif spec.kind == "loop":
        train = infer = pass_flops((spec.extra + 1) * P, (spec.extra + 1) * L, d, T)
    elif spec.kind == "ponderlm1":  # plus the soft-embedding products between passes (2·V·d per token each)
        train = infer = (spec.extra + 1) * pass_flops(P, L, d, T) + spec.extra * (head + 2.0 * V * d) * T
    else:
        train = infer = pass_flops(P, L, d, T)
    return {"train_flops_per_token": 3.0 * train / T + 3.0 * head, "infer_flops_per_token": infer / T + head,
            "params_nonembed": float(P + d)}
