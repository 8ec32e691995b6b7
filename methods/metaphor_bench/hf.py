"""A local HF image-text model through the official call shape: one user turn, the text first and
then the sampled frames; greedy decoding (sampled retries), max_new_tokens from the config."""
from __future__ import annotations

import io


def load_processor(path: str):
    """The checkpoint's processor without its video processor, if it has one (Qwen2-VL's family does).
    The frames go in as images, so a video processor is never used, and transformers builds video
    processors only with torchvision: loading it would make torchvision a requirement for nothing
    (AutoProcessor raised a bare ImportError without it). The image processor falls back to its PIL
    backend without torchvision."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    class ImagesOnly(processor_class):
        @classmethod
        def get_attributes(cls):  # the sub-processors from_pretrained loads and __init__ checks
            return [name for name in super().get_attributes() if name != "video_processor"]

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly.from_pretrained(path, local_files_only=True)


class HFVideoModel:
    def __init__(self, path: str, max_new_tokens: int = 1024, device: str = "cpu"):
        from transformers import AutoModelForImageTextToText

        self.processor = load_processor(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).to(device).eval()
        self.max_new_tokens, self.device = max_new_tokens, device

    def inputs(self, text: str, frames: list[bytes]):
        """The processor's tensors for one user turn: the text, then one image per frame."""
        from PIL import Image

        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in frames]
        messages = [{"role": "user", "content": [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]}]
        chat = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        return self.processor(text=[chat], images=images or None, return_tensors="pt").to(self.device)

    def __call__(self, text: str, frames: list[bytes], attempt: int = 0) -> str:
        import torch

        inputs = self.inputs(text, frames)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=attempt > 0)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
