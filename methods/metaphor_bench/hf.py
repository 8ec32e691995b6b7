"""A local HF image-text model through the official call shape: one user turn, the text first and
then the sampled frames; greedy decoding (sampled retries), max_new_tokens from the config."""
from __future__ import annotations

import io


class HFVideoModel:
    def __init__(self, path: str, max_new_tokens: int = 1024, device: str = "cpu"):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).to(device).eval()
        self.max_new_tokens, self.device = max_new_tokens, device

    def __call__(self, text: str, frames: list[bytes], attempt: int = 0) -> str:
        import torch
        from PIL import Image

        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in frames]
        messages = [{"role": "user", "content": [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]}]
        chat = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=[chat], images=images or None, return_tensors="pt").to(self.device)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=attempt > 0)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
