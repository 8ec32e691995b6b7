"""model= checkpoints: each family in SUPPORTED_FAMILIES, as a tiny random checkpoint written here, goes
through hf.py's loading path and gives transformers' own forward and greedy answer (the first attempt),
without torchvision; check_inputs refuses what hf.py cannot drive, before a run exists."""
from __future__ import annotations

import io

import pytest
import torch

from icml.methods.metaphor_bench.config import SUPPORTED_FAMILIES, MetaphorBenchConfig, check_inputs

WORDS = ["[UNK]", "title", "is", "a", "candle", "video", ":", "user", "assistant", "USER", "ASSISTANT"]
TEXT = "title is a candle video"


def _tokenizer(special: list[str], eos: str, pad: str, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token=eos, pad_token=pad,
                                  additional_special_tokens=special)
    tok.chat_template = template
    return tok


def _llava(path):
    """LLaVA: a CLIP vision tower (28 px, 14 px patches: 4 image tokens) and a Llama decoder."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    template = ("{% for m in messages %}{{ m['role'] | upper }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
                "<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    tok = _tokenizer(["<image>", "</s>", "<pad>"], "</s>", "<pad>", template)
    images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=template).save_pretrained(path)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=32),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1, image_seq_length=4,
        vision_feature_select_strategy="default", eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    return LlavaForConditionalGeneration


def _qwen(path, family: str):
    """Qwen2-VL / Qwen2.5-VL: 14 px patches merged 2 × 2, images scaled to at most 56² px (4 tokens each).
    Written as their checkpoints are (image processor + tokenizer with its chat template): their processor
    class also has a video processor, which transformers builds only with torchvision."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}"
                "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    special = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
               "<|endoftext|>"]
    tok = _tokenizer(special, "<|im_end|>", "<|endoftext|>", template)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    text = dict(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2]})
    if family == "qwen2_vl":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2)
    else:
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=2, hidden_size=16, out_hidden_size=16, intermediate_size=32, num_heads=2, window_size=56,
                      fullatt_block_indexes=[1])
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return model_class


def _frames(n: int = 2) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(n):
        buffer = io.BytesIO()
        Image.new("RGB", (56, 56), (40 + 90 * i, 200 - 60 * i, 30)).save(buffer, format="JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


def _reference_answer(model_class, path, inputs, hf) -> tuple[torch.Tensor, str]:
    """Logits and greedy answer of the family's own transformers class on the same tensors."""
    reference = model_class.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        logits = reference(**inputs).logits
        out = reference.generate(**inputs, max_new_tokens=hf.max_new_tokens, do_sample=False)
    return logits, hf.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]


def _check_against_transformers(model_class, path):
    from icml.methods.metaphor_bench.hf import HFVideoModel

    hf = HFVideoModel(str(path), max_new_tokens=4)
    frames = _frames()
    inputs = hf.inputs(TEXT, frames)
    logits, answer = _reference_answer(model_class, path, inputs, hf)
    with torch.no_grad():
        torch.testing.assert_close(hf.model(**inputs).logits, logits, atol=0, rtol=0)
    assert hf(TEXT, frames) == answer  # attempt 0: greedy
    return hf, inputs


def test_llava_loads_and_answers_as_transformers_does(tmp_path):
    from PIL import Image
    from transformers import LlavaProcessor

    model_class = _llava(tmp_path)
    hf, inputs = _check_against_transformers(model_class, tmp_path)
    # LLaVA's processor has no video processor: transformers' own processor class gives the same tensors
    own = LlavaProcessor.from_pretrained(tmp_path, local_files_only=True)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in _frames()]
    chat = own.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "image"},
                                                                  {"type": "image"}]}], add_generation_prompt=True)
    expected = own(text=[chat], images=images, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], expected["input_ids"])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert int((inputs["input_ids"] == own.image_token_id).sum()) == 2 * 4


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_loads_without_torchvision_and_answers_as_transformers_does(tmp_path, family):
    from PIL import Image
    from transformers import AutoImageProcessor

    model_class = _qwen(tmp_path, family)
    hf, inputs = _check_against_transformers(model_class, tmp_path)
    assert not hasattr(hf.processor, "video_processor") or hf.processor.video_processor is None
    # the image tensors are the image processor's own, and each image gets grid/merge² placeholder tokens
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in _frames()]
    own = AutoImageProcessor.from_pretrained(tmp_path, local_files_only=True)(images, return_tensors="pt")
    assert torch.equal(inputs["pixel_values"], own["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], own["image_grid_thw"])
    image_token = hf.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_token).sum()) == int(own["image_grid_thw"].prod(dim=1).sum()) // 4 == 2 * 4


def test_the_tests_cover_every_supported_family():
    assert SUPPORTED_FAMILIES == ("llava", "qwen2_vl", "qwen2_5_vl")


def test_check_inputs_takes_a_supported_checkpoint_and_refuses_others(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from icml.cli.errors import UsageError

    _llava(tmp_path / "llava")
    check_inputs(MetaphorBenchConfig(model=str(tmp_path / "llava")))
    # a text-only checkpoint: no image path to drive
    GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    _tokenizer([], "[UNK]", "[UNK]", "").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UsageError, match="is a gpt2 checkpoint; metaphor-bench supports llava, qwen2_vl, qwen2_5_vl"):
        check_inputs(MetaphorBenchConfig(model=str(tmp_path / "gpt2")))
    # the model without its processor: eval could not turn frames into pixels
    (tmp_path / "llava" / "processor_config.json").unlink()
    with pytest.raises(UsageError, match="has no image processor"):
        check_inputs(MetaphorBenchConfig(model=str(tmp_path / "llava")))
