"""The tiny VLM agent, its turn grammar and the GLANCE head.

A turn is `<obs> 6 slots </obs> <pred> 6 slots </pred> <ans> action </ans>` after 4 visual tokens
from the CNN vision encoder f_v. Decoding is grammar-constrained: the structural tokens are forced,
each slot samples only among its own values. The language model is a 2-layer GPT-2 fed through
`inputs_embeds`, decoded with its KV cache.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2Model

from icml.methods.curious_agent.env import ACTION_NAMES, SLOTS

STRUCT = ["<obs>", "</obs>", "<pred>", "</pred>", "<ans>", "</ans>"]
SLOT_VALUES = [[f"{name}={v}" for v in values] for name, values in SLOTS]
VOCAB = STRUCT + sorted({tok for values in SLOT_VALUES for tok in values}) + [f"act={a}" for a in ACTION_NAMES]
TOKEN = {t: i for i, t in enumerate(VOCAB)}
# the turn template: a token name (forced) or ("slot", k) / ("act",) (sampled)
TEMPLATE = (["<obs>"] + [("slot", k) for k in range(len(SLOTS))] + ["</obs>", "<pred>"]
            + [("slot", k) for k in range(len(SLOTS))] + ["</pred>", "<ans>", ("act",), "</ans>"])
SAMPLED = [p for p, t in enumerate(TEMPLATE) if not isinstance(t, str)]  # 13 positions
OBS_POS, PRED_POS, ACT_POS = SAMPLED[:6], SAMPLED[6:12], SAMPLED[12]
CLOSE_PRED = TEMPLATE.index("</pred>")


def slot_token_ids(k: int) -> list[int]:
    return [TOKEN[t] for t in SLOT_VALUES[k]]


def action_token_ids(n_actions: int) -> list[int]:
    return [TOKEN[f"act={a}"] for a in ACTION_NAMES[:n_actions]] if n_actions == 7 else \
        [TOKEN[f"act={ACTION_NAMES[a]}"] for a in (0, 1, 2, 3, 5)]


class VisionEncoder(nn.Module):
    """f_v: 3-layer CNN (16-32-64) on the 28x28 view -> n visual tokens of width d."""

    def __init__(self, d: int = 64, n_tokens: int = 4):
        super().__init__()
        side = int(round(n_tokens ** 0.5))
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                 nn.Conv2d(32, d, 3, 2, 1), nn.AdaptiveAvgPool2d(side))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [B,3,28,28] -> [B,n,d]
        return self.net(frames).flatten(2).transpose(1, 2)


class VLMVision(nn.Module):
    """f_v of a LLaVA-style HF VLM: the image processor's resize and normalisation of the [0, 1]
    frames, the vision tower's hidden states at `vision_feature_layer` (CLS dropped under the
    "default" strategy), the multimodal projector into the LM's width, and the patch sequence
    average-pooled to n visual tokens (the tiny agent's count; a CPU-scale choice)."""

    def __init__(self, tower: nn.Module, projector: nn.Module, config, processor, n_tokens: int):
        super().__init__()
        self.tower, self.projector = tower, projector
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.processor, self.n_tokens = processor, n_tokens

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [B,3,28,28] in [0,1] -> [B,n,d_lm]
        pixels = self.processor(images=list(frames), do_rescale=False, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(next(self.tower.parameters()).device, frames.dtype)  # the processor works on CPU
        states = self.tower(pixels, output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        features = torch.cat([states[k][:, 1:] if self.strategy == "default" else states[k] for k in layers], -1)
        tokens = self.projector(features)
        return F.adaptive_avg_pool1d(tokens.transpose(1, 2), self.n_tokens).transpose(1, 2)


class QwenVision(nn.Module):
    """f_v of Qwen2.5-VL: the image processor turns the [0, 1] frames into flattened patches
    (`pixel_values`, each frame repeated over `temporal_patch_size`) and `image_grid_thw` (after its
    smart resize: 28x28 frames become 56x56, 4x4 patches of 14); the `visual` tower (window attention,
    then the merger of 2x2 patches into the LM's width) returns each frame's merged patches in raster
    order, average-pooled over that 2-D grid to side x side visual tokens (2x2 merged patches for
    28x28 frames: pooling is then the identity)."""

    def __init__(self, tower: nn.Module, processor, n_tokens: int):
        super().__init__()
        self.tower, self.processor = tower, processor
        self.side = int(round(n_tokens ** 0.5))

    def patches(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The image processor's (CPU) output: pixel_values [B·patches, 3·2·14·14], image_grid_thw [B, 3] (1, h, w
        patches per frame, the same for every frame), and the tower's precomputed inputs (none here; the plan,
        methods/curious_agent/plan.py, passes the grid's position ids and window indices, which the meta device
        cannot compute)."""
        inputs = self.processor(images=list(frames), do_rescale=False, return_tensors="pt")
        return inputs["pixel_values"], inputs["image_grid_thw"], {}

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] in [0,1] -> [B,side²,d_lm]
        pixels, grid, precomputed = self.patches(frames)
        device = next(self.tower.parameters()).device
        merged = self.tower(pixels.to(device, frames.dtype), grid_thw=grid.to(device), **precomputed).pooler_output
        merge = self.tower.spatial_merge_size
        h, w = int(grid[0, 1]) // merge, int(grid[0, 2]) // merge
        tokens = merged.view(len(frames), h, w, -1).permute(0, 3, 1, 2)
        return F.adaptive_avg_pool2d(tokens, self.side).flatten(2).transpose(1, 2)


class QwenLanguageModel(nn.Module):
    """Λ_ℓ of Qwen2.5-VL on `inputs_embeds` with its multimodal RoPE, placed as `get_rope_index` places
    an image followed by text: the side x side visual tokens that open every sequence get (t, h, w) =
    (0, i, j), the turn's tokens after them side, side + 1, ... in all three sections. Positions continue
    from the KV cache's length, so cached decoding sees the positions of the teacher-forced pass."""

    def __init__(self, text_model: nn.Module, side: int):
        super().__init__()
        self.text, self.side = text_model, side

    def positions(self, start: int, length: int, batch: int) -> torch.Tensor:  # -> [3, batch, length]
        index = torch.arange(start, start + length)
        visual = index < self.side ** 2
        text = index - self.side ** 2 + self.side
        rows = torch.stack([torch.where(visual, 0, text), torch.where(visual, index // self.side, text),
                            torch.where(visual, index % self.side, text)])
        return rows[:, None].expand(3, batch, length)

    def forward(self, inputs_embeds: torch.Tensor, cache=None, use_cache: bool | None = None):
        start = cache.get_seq_length() if cache is not None else 0
        position_ids = self.positions(start, inputs_embeds.shape[1], inputs_embeds.shape[0]).to(inputs_embeds.device)
        return self.text(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, use_cache=use_cache)


class Projector(nn.Module):
    """g_psi: MLP d -> 2d -> d, initialised (and re-initialised) from its own generator."""

    def __init__(self, d: int, generator: torch.Generator, d_in: int | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # nn.Linear's default init would draw from torch's RNG
            self.net = nn.Sequential(nn.Linear(d_in or d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.generator = generator
        self.reinitialise()

    @torch.no_grad()
    def reinitialise(self) -> None:
        """Kaiming-uniform weights as nn.Linear's default, drawn from the projector's generator
        only: the policy's RNG stream never moves (β = 0 ≡ vagen_lite)."""
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                bound = 1.0 / layer.in_features ** 0.5
                for weight in (layer.weight, layer.bias):  # drawn on the CPU generator, copied to the device
                    weight.copy_(torch.empty(weight.shape).uniform_(-bound, bound, generator=self.generator))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


def explore_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """L_explore = || ŷ/||ŷ|| − y/||y|| ||² per row (= 2 − 2 cos), in [0, 4]; y is a stop-gradient target."""
    return (F.normalize(prediction, dim=-1) - F.normalize(target.detach(), dim=-1)).pow(2).sum(-1)


class CoTAgent(nn.Module):
    """Vision encoder f_v, GPT-2 language decoder Λ_ℓ with its own vocabulary, value head."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, visual_tokens: int = 4, n_actions: int = 5,
                 vision: nn.Module | None = None, lm: nn.Module | None = None):
        """The tiny agent by default; `vision` and `lm` replace f_v and Λ_ℓ (a local HF VLM's parts,
        see `from_pretrained`): d is then the LM's hidden size, and the rest of the agent is the same."""
        super().__init__()
        self.vision = vision if vision is not None else VisionEncoder(d, visual_tokens)
        self.embed = nn.Embedding(len(VOCAB), d)
        if lm is None:
            config = GPT2Config(vocab_size=1, n_positions=64, n_embd=d, n_layer=layers, n_head=heads,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=None, eos_token_id=None)
            lm = GPT2Model(config)
        self.lm = lm
        self.lm_head = nn.Linear(d, len(VOCAB), bias=False)
        self.value = nn.Linear(d, 1)
        self.n_visual = visual_tokens
        masks = torch.full((len(TEMPLATE), len(VOCAB)), float("-inf"))
        for p, t in enumerate(TEMPLATE):
            allowed = [TOKEN[t]] if isinstance(t, str) else \
                slot_token_ids(t[1]) if t[0] == "slot" else action_token_ids(n_actions)
            masks[p, allowed] = 0.0
        self.register_buffer("masks", masks, persistent=False)  # constrained decoding, per template position
        self.action_ids = action_token_ids(n_actions)
        self.host = torch.device("cpu")  # where the methods return their tensors (the plan keeps them on meta)

    @classmethod
    def from_pretrained(cls, path: str, visual_tokens: int = 4, n_actions: int = 5) -> "CoTAgent":
        """The agent on a local HF VLM: `AutoModelForImageTextToText.from_pretrained(path,
        local_files_only=True)` and its `AutoImageProcessor`; by config.json's `model_type`, f_v = the
        LLaVA vision tower + multimodal projector (`VLMVision`) or the Qwen2.5-VL `visual` tower with its
        merger (`QwenVision`), Λ_ℓ = its language model on `inputs_embeds` (for Qwen2.5-VL with its
        multimodal RoPE, `QwenLanguageModel`). The turn vocabulary keeps its own embedding and output
        rows (new tokens of the LM's width); the VLM's own token embeddings and LM head are not used."""
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        from icml.cli.errors import UsageError
        from icml.methods.curious_agent.config import vlm_type

        try:
            model_type = vlm_type(path)
        except ValueError as exc:
            raise UsageError(str(exc)) from None  # validate() says the same before a run starts
        try:
            vlm = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"--model '{path}' cannot be loaded as an image-text-to-text model with its image "
                             f"processor ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
                             "pass a folder written by a VLM's and its image processor's save_pretrained") from None
        base = vlm.model
        lm = base.language_model
        if model_type == "qwen2_5_vl":
            vision = QwenVision(base.visual, processor, visual_tokens)
            return cls(lm.config.hidden_size, visual_tokens=visual_tokens, n_actions=n_actions, vision=vision,
                       lm=QwenLanguageModel(lm, vision.side))
        return cls(lm.config.hidden_size, visual_tokens=visual_tokens, n_actions=n_actions,
                   vision=VLMVision(base.vision_tower, base.multi_modal_projector, vlm.config, processor, visual_tokens),
                   lm=lm)

    @property
    def device(self) -> torch.device:
        """Where the agent's weights are (the CPU for the tiny agent; `--device` for a `--model` VLM).
        Its methods take and return CPU tensors (`host`): the environments, sampling and PPO's losses stay on the
        CPU."""
        return self.masks.device

    def language_parameters(self) -> list[nn.Parameter]:
        return [*self.embed.parameters(), *self.lm.parameters(), *self.lm_head.parameters()]

    def forward_turn(self, frames: torch.Tensor, tokens: torch.Tensor):
        """Teacher-forced pass over whole turns: frames [B,3,H,W], tokens [B,len(TEMPLATE)] ->
        logits [B,13,V] (masked) of the sampled positions, values [B,13], hidden [B,len(TEMPLATE),d]."""
        embeds = torch.cat([self.vision(frames), self.embed(tokens.to(self.device))], 1)
        hidden = self.lm(inputs_embeds=embeds).last_hidden_state
        before = hidden[:, [self.n_visual + p - 1 for p in SAMPLED]]  # the state that chooses token p
        logits = self.lm_head(before) + self.masks[SAMPLED]
        host = self.host
        return logits.to(host), self.value(before).squeeze(-1).to(host), hidden[:, self.n_visual:].to(host)

    @torch.no_grad()
    def generate(self, frames: torch.Tensor, greedy: bool = False, generator: torch.Generator | None = None):
        """KV-cached constrained decoding of one turn per frame -> tokens [B,19], logprobs [B,13],
        values [B,13], hidden at every template position [B,19,d]."""
        batch = frames.shape[0]
        tokens = torch.zeros(batch, len(TEMPLATE), dtype=torch.long)
        logprobs, values, chunks = [], [], []
        pending, past = self.vision(frames), None  # embeddings not yet fed to the cache
        for p, t in enumerate(TEMPLATE):
            if isinstance(t, str):  # forced structural token: queue it, no forward pass
                tokens[:, p] = TOKEN[t]
                pending = torch.cat([pending, self.embed(tokens[:, p:p + 1].to(self.device))], 1)
                continue
            out = self.lm(inputs_embeds=pending, cache=past, use_cache=True)
            past = out.cache
            chunks.append(out.last_hidden_state)
            last = out.last_hidden_state[:, -1]
            logits = (self.lm_head(last) + self.masks[p]).cpu()  # sampled on the CPU generator
            dist = torch.distributions.Categorical(logits=logits)
            choice = logits.argmax(-1) if greedy else torch.multinomial(dist.probs, 1, generator=generator)[:, 0]
            tokens[:, p] = choice
            logprobs.append(dist.log_prob(choice))
            values.append(self.value(last).squeeze(-1).cpu())
            pending = self.embed(choice[:, None].to(self.device))
        chunks.append(self.lm(inputs_embeds=pending, cache=past, use_cache=True).last_hidden_state)
        hidden = torch.cat(chunks, 1)[:, self.n_visual:].cpu()
        return tokens, torch.stack(logprobs, 1), torch.stack(values, 1), hidden


class GlanceHead(nn.Module):
    """g_psi on the policy's hidden state at the end of <pred>, and the EMA target φ of f_v."""

    def __init__(self, agent: CoTAgent, seed: int, d_in: int | None = None):
        super().__init__()
        d = agent.embed.embedding_dim
        self.generator = torch.Generator().manual_seed(10_007 + seed)
        self.projector = Projector(d, self.generator, d_in).to(agent.device)
        self.target = copy.deepcopy(agent.vision)  # φ starts at v; deepcopy draws no random numbers
        self.target.requires_grad_(False)

    @torch.no_grad()
    def ema_update(self, online: nn.Module, alpha: float) -> None:
        """φ ← αφ + (1−α)v."""
        for phi, v in zip(self.target.parameters(), online.parameters()):
            phi.mul_(alpha).add_(v, alpha=1 - alpha)

    @torch.no_grad()
    def target_feature(self, next_frames: torch.Tensor) -> torch.Tensor:
        return self.target(next_frames).mean(1)  # y: mean of the target's visual tokens (on the agent's device)
