"""`icml curious-agent plan`: the VLM agent's perception warm-up step, one PPO minibatch step of each GLANCE arm
(the policy's forward/backward on a rollout minibatch, the alignment gradients, both optimisers, the EMA target)
and the teacher-forced forward of evaluation, at the preset's sizes on the meta device (cli/plan.py).

The preset's agent is Qwen2.5-VL-3B-Instruct (--model) in float32, built from a config of its published sizes.
Left out: the rollouts (`CoTAgent.generate`: token-by-token sampling on the CPU generator, and the environments;
no gradient, a 23-token sequence per frame, less than a minibatch's forward), the greedy evaluation episodes (the
same) and the pixel arms ppo / ppo_rnd (CPU-scale CNNs on the host). The image processor (PIL on the CPU) is
replaced by its output's shapes: 28 × 28 frames become 56 × 56, 4 × 4 patches of 14 (image_grid_thw (1, 4, 4));
the grid's position ids and window indices, which the vision tower computes from the grid's values, are given
to it precomputed. The agent's host tensors (logits, values, hidden states that PPO's losses read on the CPU)
stay on the planned device.
"""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.curious_agent.model import SAMPLED, TEMPLATE, CoTAgent, QwenLanguageModel, QwenVision
from icml.methods.curious_agent.ppo import Glance, arm_spec, n_actions, ppo_minibatch, warmup_step

LAYOUT = "one process, one GPU per (arm, seed) job (the VLM arms; ppo / ppo_rnd run on the CPU)"
OVERSIZE = ["ppo.rollout=4096"]
PATCH_INPUT = 3 * 2 * 14 * 14  # pixel_values per patch: channels × temporal_patch_size × 14²


def hardware(preset: str) -> Hardware:
    # the paper's arms include glance_lm_grad: float32 Qwen2.5-VL-3B with Adam for the policy and a second Adam
    # over Λ_ℓ for the alignment hold 87 GB of model state; the other arms fit one 80 GB GPU (README)
    return Hardware(1, 141e9) if preset == "paper" else Hardware(1, 80e9)


def qwen25_vl_3b():
    """Qwen2.5-VL-3B-Instruct's config (its published sizes)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                intermediate_size=11008, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                hidden_act="silu", rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)


def no_gpu(cfg) -> str:
    if _tiny_agent(cfg):
        return "without --model the tiny agent and the pixel arms run on the CPU (CPU-scale); only a VLM uses the GPU"
    return ""


def _tiny_agent(cfg) -> bool:
    return cfg.model.path is None and not _paper(cfg)


def _paper(cfg) -> bool:
    """The paper preset's --model agent: its PPO budget is the paper's (500 000 steps)."""
    return cfg.ppo.total_steps >= 500_000


def _agent(cfg, tracker) -> CoTAgent:
    m = cfg.model
    with torch.device(tracker.device):  # as CoTAgent.from_pretrained assembles it (float32)
        base = _vlm(qwen25_vl_3b()).model
        vision = QwenVision(base.visual, None, m.visual_tokens)
        vision.patches = _patches(vision, cfg, tracker.device)
        agent = CoTAgent(base.language_model.config.hidden_size, visual_tokens=m.visual_tokens,
                         n_actions=n_actions(cfg), vision=vision, lm=QwenLanguageModel(base.language_model,
                                                                                        vision.side))
    agent.host = torch.device(tracker.device)
    return agent


def _vlm(config):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(config).float()


def _patches(vision: QwenVision, cfg, device):
    """QwenVision.patches for the plan: the processor's output shapes, the grid's precomputed tower inputs."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # torchvision-free
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    tower = vision.tower
    side = 7 * cfg.env.tile_size
    height, width = smart_resize(side, side, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    per_frame = (height // 14) * (width // 14)

    per_window = min(per_frame, (tower.window_size // 14) ** 2)
    if per_frame != per_window:
        raise NotImplementedError(f"the plan's vision tower takes one attention window per frame; {side}-px frames "
                                  f"give {per_frame} patches per frame")
    _register_frame_attention(per_frame)
    tower.config._attn_implementation = FRAME_ATTENTION

    def patches(frames):
        grid = torch.tensor([[1, height // 14, width // 14]] * len(frames))
        cu_seqlens = torch.tensor([0, len(frames) * per_frame], dtype=torch.int32)  # one segment: FRAME_ATTENTION
        window_index, _ = get_vision_window_index(grid, tower.spatial_merge_size, tower.window_size,
                                                  tower.patch_size)
        cu_window_seqlens = cu_seqlens  # one window per frame: the same blocks (FRAME_ATTENTION)
        precomputed = {"position_ids": get_vision_position_ids(grid, tower.spatial_merge_size).to(device),
                       "cu_seqlens": cu_seqlens, "window_index": window_index, "cu_window_seqlens": cu_window_seqlens}
        return torch.rand(len(frames) * per_frame, PATCH_INPUT, device=device), grid, precomputed
    return patches


FRAME_ATTENTION = "icml_plan_frame_blocks"


def _register_frame_attention(per_frame: int) -> None:
    """The vision tower's attention for the plan: every frame is one window and one full-attention segment of
    `per_frame` patches (4 × 4 at 28 px), so attention within each frame's block. The tower itself splits its
    packed sequence per segment in Python and runs one SDPA call per frame and layer (tens of thousands per
    minibatch, minutes on the meta device); here one batched call per layer on the same blocks: the same
    FLOPs, and the same per-frame [heads, patches, patches] scores."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, is_causal=False,
                  **kwargs):
        _, heads, n, dim = query.shape  # [1, heads, frames · per_frame, dim]: the packed sequence
        blocks = [t.reshape(heads, n // per_frame, per_frame, dim).transpose(0, 1) for t in (query, key, value)]
        out = torch.nn.functional.scaled_dot_product_attention(*blocks, scale=scaling)
        return out.transpose(1, 2).reshape(1, n, heads, dim), None

    AttentionInterface.register(FRAME_ATTENTION, attention)


def _frames(cfg, n: int, device) -> torch.Tensor:
    side = 7 * cfg.env.tile_size
    return torch.rand(n, 3, side, side, device=device)


def _tokens(n: int, device) -> torch.Tensor:
    return torch.randint(0, 8, (n, len(TEMPLATE)), device=device)


def _warmup(cfg):
    def run(tracker):
        agent = _agent(cfg, tracker)
        optimiser = torch.optim.Adam(agent.parameters(), lr=cfg.warmup.lr)
        tracker.watch(agent, optimiser)
        frames, tokens = _frames(cfg, cfg.warmup.batch, tracker.device), _tokens(cfg.warmup.batch, tracker.device)
        for _ in range(2):
            warmup_step(agent, optimiser, frames, tokens)
    return run


def _minibatch_rows(cfg) -> int:
    """train_arm's minibatch: the update's n_envs × rollout turns split into `minibatches` parts."""
    n = cfg.ppo.n_envs * cfg.ppo.rollout
    return min(n, max(1, n // cfg.ppo.minibatches))


def _planned_rows(cfg) -> int:
    """The rows the PPO step is planned on: one micro-batch (ppo.micro_batch; every micro-batch of a minibatch
    is the same forward/backward, gradients accumulated in place), else the whole minibatch."""
    rows = _minibatch_rows(cfg)
    return cfg.ppo.micro_batch if 0 < cfg.ppo.micro_batch < rows else rows


def _ppo(cfg, arm: str):
    def run(tracker):
        spec = arm_spec(arm, cfg)
        agent = _agent(cfg, tracker)
        glance = Glance(agent, spec, cfg, 0)
        optimiser = torch.optim.Adam(agent.parameters(), lr=cfg.ppo.lr)
        tracker.watch(agent, glance.head, optimiser, glance.optimiser)
        rows, device = _planned_rows(cfg), tracker.device
        with tracker.buffers():  # the minibatch's rows of the rollout buffer
            mb = {"frames": _frames(cfg, rows, device), "next": _frames(cfg, rows, device),
                  "tokens": _tokens(rows, device), "logp": torch.randn(rows, len(SAMPLED), device=device),
                  "actions": torch.randint(0, n_actions(cfg), (rows,), device=device)}
            adv, ret = torch.randn(rows, len(SAMPLED), device=device), torch.randn(rows, len(SAMPLED), device=device)
        validate = torch.distributions.Distribution._validate_args  # Categorical's argument checks read values
        torch.distributions.Distribution.set_default_validate_args(False)
        try:
            for _ in range(2):  # the second step holds both optimisers' state from its start
                ppo_minibatch(agent, optimiser, spec, cfg.ppo, mb, adv, ret, glance)
        finally:
            torch.distributions.Distribution.set_default_validate_args(validate)
    return run


def _eval(cfg):
    def run(tracker):
        agent = _agent(cfg, tracker).eval()
        tracker.watch(agent)
        n = min(cfg.eval_episodes, 16)
        with torch.no_grad():
            agent.forward_turn(_frames(cfg, n, tracker.device), _tokens(n, tracker.device))
    return run


def steps(cfg, processes: int) -> list[Step]:
    cot = [a for a in cfg.arms if arm_spec(a, cfg).cot]
    out = [Step("train", f"perception warm-up: an Adam step on {cfg.warmup.batch} teacher-forced turns",
                _warmup(cfg), repeats=2)]
    # the GLANCE arms differ in what the alignment optimiser holds: f_v and g_ψ, or Λ_ℓ too (glance_lm_grad, the
    # largest); vagen_lite is glance without the alignment. One arm, the largest present, keeps the plan short.
    arm = next((a for a in ("glance_lm_grad", "glance", "glance_no_reset") if a in cot), cot[0] if cot else None)
    if arm is not None:
        rows, minibatch = _planned_rows(cfg), _minibatch_rows(cfg)
        part = f"one micro-batch of {rows} turns of a {minibatch}-turn minibatch (FLOPs: the micro-batch's)" \
            if rows < minibatch else f"one minibatch of {rows} turns"
        out.append(Step("train", f"{arm}: a PPO step on {part}; {cfg.ppo.n_envs} envs × {cfg.ppo.rollout} turns "
                                 "per update", _ppo(cfg, arm), repeats=2))
    out.append(Step("eval", f"teacher-forced turns of {min(cfg.eval_episodes, 16)} frames (greedy episodes' "
                            "forward)", _eval(cfg)))
    return out
