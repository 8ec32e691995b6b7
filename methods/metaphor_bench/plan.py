"""`icml metaphor-bench plan`: for the paper preset (or any model=), the two HF models that eval holds on the device
at once — the video model (model=) and the LLM judge (judge_model=) — with the tensor-heavy core of one answer
and one verdict, at the preset's sizes on the meta device (cli/plan.py). One process, one GPU: nothing trains.

The paper preset names no checkpoint (model=PATH, judge_model=PATH); the plan takes Qwen2-VL-7B-Instruct for the
video model and Qwen2.5-7B-Instruct for the judge, bfloat16 as from_pretrained loads them, built from configs of
their published sizes. Left out: generate()'s token-by-token decoding (data-dependent; the prefill runs over the
prompt and max_new_tokens more positions, so the KV cache and activations are those of the last step), the
image processor (PIL on the CPU: 50 frames of a 16:9 video, thumbnailed into 1024² as the protocol does, give
image_grid_thw (1, 42, 74) each, 777 merged tokens per frame) and get_rope_index (a loop over the ids: the
positions are given). The text embedder (embed_model=, a sentence encoder) is small and left out. Attention runs
as the GPU's SDPA does, without the [heads, L, L] matrix (the meta device's SDPA would materialise it).
"""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step

LAYOUT = "one process, one GPU (nothing trains; seeds run side by side)"
OVERSIZE = ["max_images=2000"]
PROMPT_TOKENS = 1024  # the final-analysis prompt with a top-10 KG reference, and the judge's prompt (estimates)
JUDGE_NEW_TOKENS = 512  # LLMJudge's max_new_tokens
FRAME_GRID = (1, 42, 74)  # a 1024 × 576 frame after Qwen2-VL's smart_resize (factor 28): 588 × 1036 px
ATTENTION = "icml_plan_sdpa"


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _paper(cfg) -> bool:
    """The HF path: model= given, or the paper preset (judge=llm: the official benchmark with a local MLLM)."""
    return bool(cfg.model) or cfg.judge == "llm"


def _register_attention() -> None:
    """SDPA as a GPU runs it (memory-efficient kernel: output and log-sum-exp, no score matrix)."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, is_causal=None,
                  **kwargs):
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False)) and query.shape[2] > 1
        out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attention_mask, False,
                                                                    is_causal=causal and attention_mask is None,
                                                                    scale=scaling)[0]
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTENTION, attention)


def video_model_config():
    """Qwen2-VL-7B-Instruct's sizes."""
    from transformers import Qwen2VLConfig

    text = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def judge_config():
    """Qwen2.5-7B-Instruct's sizes."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)


def _models(tracker):
    """Both HF models as eval holds them: built before the arms run, on the device, bfloat16."""
    from transformers import Qwen2ForCausalLM, Qwen2VLForConditionalGeneration

    _register_attention()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, as from_pretrained loads the checkpoints
    try:
        with torch.device(tracker.device):
            video = Qwen2VLForConditionalGeneration(video_model_config()).eval()
            judge = Qwen2ForCausalLM(judge_config()).eval()
    finally:
        torch.set_default_dtype(dtype)
    for model in (video, judge):
        model.set_attn_implementation(ATTENTION)
    tracker.watch(video, judge)
    return video, judge


def _answer(cfg):
    def run(tracker):
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        video, _ = _models(tracker)
        device, visual = tracker.device, video.model.visual
        frames = cfg.max_images
        grid = torch.tensor([FRAME_GRID] * frames)  # the processor's image_grid_thw (CPU)
        patches = frames * FRAME_GRID[1] * FRAME_GRID[2]
        cu_seqlens, _ = get_vision_attention_seqlens(grid, visual.config)
        precomputed = {"position_ids": get_vision_position_ids(grid, visual.spatial_merge_size).to(device),
                       "cu_seqlens": cu_seqlens}  # what the tower computes from the grid's values
        pixels = torch.rand(patches, 3 * 2 * 14 * 14, device=device, dtype=torch.bfloat16)
        length = patches // 4 + PROMPT_TOKENS + cfg.max_new_tokens
        with torch.no_grad():
            images = visual(pixels, grid_thw=grid, **precomputed).pooler_output  # [frames · 777, 3584]
            text = video.model.language_model.embed_tokens(torch.randint(0, 1000, (1, length - len(images)),
                                                                         device=device))
            embeds = torch.cat([images[None], text], 1)
            del images, text
            positions = torch.arange(length, device=device).expand(3, 1, length)
            out = video.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=True)
            video.lm_head(out.last_hidden_state[:, -1:])  # generate keeps the last position's logits
    return run


def _verdict(cfg):
    def run(tracker):
        _, judge = _models(tracker)
        length = PROMPT_TOKENS + JUDGE_NEW_TOKENS
        with torch.no_grad():
            ids = torch.randint(0, 1000, (1, length), device=tracker.device)
            judge(input_ids=ids, use_cache=True, logits_to_keep=1)
    return run


def no_gpu(cfg) -> str:
    if _paper(cfg):
        return ""
    return "without model= the tiny MLLM trains and answers on the CPU (CPU-scale); only HF models use the GPU"


def steps(cfg, processes: int) -> list[Step]:
    frames = cfg.max_images
    tokens = frames * FRAME_GRID[1] * FRAME_GRID[2] // 4 + PROMPT_TOKENS + cfg.max_new_tokens
    return [Step("eval", f"video model (Qwen2-VL-7B) answers one item: {frames} frames, prefill of {tokens} "
                         "tokens to the last generated one; the judge held beside it", _answer(cfg)),
            Step("eval", f"LLM judge (Qwen2.5-7B) scores one answer: {PROMPT_TOKENS + JUDGE_NEW_TOKENS} tokens; "
                         "the video model held beside it", _verdict(cfg))]
