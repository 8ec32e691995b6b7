"""The tiny MLLM: a per-frame CNN (2 tokens per frame), one temporal attention layer with frame
positions, prefixed to a GPT-2 decoder over a word-level vocabulary. A task token replaces the long
official prompt; the title and the reference are tokenised; answers are emitted as pieces whose
concatenation is official-format text, so they go through the official parser like any model's.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from icml.methods.metaphor_bench.bench import ATTRIBUTES, ELEMENTS, IDEAS, NEUTRAL_TITLES

SPECIAL = ["<pad>", "<eos>", "<unk>", "<qa>", "<keywords>", "<final>", "<title>", "<ref>", "<ans>", "•"]
MAX_ENTRIES = 5
PIECES = (['```json\n{"analysis_dict": {', " content, implicitly expressing the ", ' idea"', ", ", "}}\n```",
           '```json\n{"keywords": [', '"', "]}\n```"]
          + [f'"analysis_{k}": "The video presents the ' for k in range(1, MAX_ENTRIES + 1)])
TITLE_WORDS = sorted({w for t in NEUTRAL_TITLES + ["the story"] for w in t.split()})
WORDS = ELEMENTS + [e + "s" for e in ELEMENTS] + IDEAS + ATTRIBUTES + TITLE_WORDS
TASKS = {"qa": "<qa>", "keywords": "<keywords>", "final": "<final>"}
WORD_RE = re.compile(r"[A-Za-z][A-Za-z\-]*|•")


class Vocab:
    def __init__(self):
        self.tokens = SPECIAL + PIECES + [w for w in dict.fromkeys(WORDS) if w not in SPECIAL]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.content = set(ELEMENTS) | {e + "s" for e in ELEMENTS} | set(IDEAS) | set(ATTRIBUTES)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, token: str) -> int:
        return self.index.get(token, self.index["<unk>"])

    def words(self, text: str, content_only: bool = False) -> list[int]:
        """Input text → ids; the reference keeps its content words and line bullets only (the tiny
        model's choice: the template's function words carry no information)."""
        found = WORD_RE.findall(text)
        if content_only:
            found = [w for w in found if w in self.content or w == "•"]
        return [self[w] for w in found]

    def analysis(self, pairs: list[tuple[str, str]]) -> list[int]:
        ids = [self[PIECES[0]]]
        for k, (element, idea) in enumerate(pairs[:MAX_ENTRIES]):
            if k:
                ids.append(self[", "])
            ids += [self[f'"analysis_{k + 1}": "The video presents the '], self[element],
                    self[" content, implicitly expressing the "], self[idea], self[' idea"']]
        return ids + [self["}}\n```"], self["<eos>"]]

    def keywords(self, words: list[str]) -> list[int]:
        ids = [self['```json\n{"keywords": [']]
        for k, word in enumerate(words):
            ids += ([self[", "]] if k else []) + [self['"'], self[word], self['"']]
        return ids + [self["]}\n```"], self["<eos>"]]

    def prompt(self, task: str, title: str, reference: str | None) -> list[int]:
        ids = [self[TASKS[task]], self["<title>"]] + self.words(title)
        if reference is not None:
            ids += [self["<ref>"]] + self.words(reference, content_only=True)
        return ids + [self["<ans>"]]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            token = self.tokens[i]
            if token == "<eos>":
                break
            out.append(token if token in PIECES else token if token not in SPECIAL else "")
        return "".join(out)


class TinyMLLM(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layer: int, n_head: int, n_frames: int,
                 n_positions: int = 512):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # frames are average-pooled to 32×32 first: the icons survive and a CPU step stays cheap
        self.cnn = nn.Sequential(nn.AdaptiveAvgPool2d(32), nn.Conv2d(3, 16, 5, 2, 2), nn.ReLU(),
                                 nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, d_model, 3, 2, 1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d((1, 2)))
        self.frame_pos = nn.Embedding(n_frames, d_model)
        self.temporal = nn.TransformerEncoderLayer(d_model, n_head, 2 * d_model, dropout=0.0, batch_first=True)
        config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=d_model, n_layer=n_layer,
                            n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                            bos_token_id=1, eos_token_id=1)
        self.decoder = GPT2LMHeadModel(config)
        self.n_frames = n_frames

    def visual(self, frames: torch.Tensor) -> torch.Tensor:
        """frames uint8 [B, F, 3, S, S] → [B, 2F, d]."""
        b, f = frames.shape[:2]
        x = frames.flatten(0, 1).float() / 255.0 - 0.5
        tokens = self.cnn(x).flatten(2).transpose(1, 2).reshape(b, f, 2, -1)  # 2 tokens per frame
        tokens = tokens + self.frame_pos(torch.arange(f, device=frames.device))[None, :, None]
        return self.temporal(tokens.reshape(b, 2 * f, -1))

    def forward(self, frames, ids, attention_mask, labels=None, position_ids=None, past_key_values=None):
        embeds = self.decoder.transformer.wte(ids)
        if frames is not None:
            embeds = torch.cat([self.visual(frames), embeds], dim=1)
        return self.decoder(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels,
                            position_ids=position_ids, past_key_values=past_key_values, use_cache=labels is None)


def batch_for_training(frames: torch.Tensor, prompts: list[list[int]], targets: list[list[int]], n_visual: int):
    """Right-padded [visual | prompt | target]; labels only on the target."""
    lengths = [len(p) + len(t) for p, t in zip(prompts, targets)]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    labels = torch.full((len(prompts), n_visual + width), -100, dtype=torch.long)
    mask = torch.zeros(len(prompts), n_visual + width, dtype=torch.long)
    for b, (p, t) in enumerate(zip(prompts, targets)):
        ids[b, :len(p) + len(t)] = torch.tensor(p + t)
        labels[b, n_visual + len(p):n_visual + len(p) + len(t)] = torch.tensor(t)
        mask[b, :n_visual + len(p) + len(t)] = 1
    return frames, ids, mask, labels


@torch.no_grad()
def generate(model: TinyMLLM, frames: torch.Tensor, prompts: list[list[int]], eos: int, max_new: int = 48,
             sample: bool = False, generator: torch.Generator | None = None) -> list[list[int]]:
    """Batched decoding with a KV cache; prompts left-padded after the visual prefix (greedy, or
    sampled at temperature 1 for the retries)."""
    model.eval()
    n_visual = 2 * frames.shape[1]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    text_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        text_mask[b, width - len(p):] = 1
    mask = torch.cat([torch.ones(len(prompts), n_visual, dtype=torch.long), text_mask], dim=1)
    embeds = torch.cat([model.visual(frames), model.decoder.transformer.wte(ids)], dim=1)
    # visual tokens take positions 0…n_visual-1 and the text continues after them, pads excluded
    position = (mask.cumsum(1) - 1).clamp_min(0)
    out = model.decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=position, use_cache=True)
    past, last = out.past_key_values, position[:, -1]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    result = [[] for _ in prompts]
    logits = out.logits[:, -1]
    for _ in range(max_new):
        if sample:
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
        else:
            token = logits.argmax(-1)
        for b in range(len(prompts)):
            if not done[b]:
                result[b].append(int(token[b]))
        done |= token == eos
        if done.all():
            break
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        last = last + 1
        out = model.decoder(input_ids=token[:, None], attention_mask=mask, position_ids=last[:, None],
                            past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return result
