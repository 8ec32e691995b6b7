"""Judges: `rule` (procedural data: lexicon matching against the sidecar ids) and `llm` (the
official judge prompt on a local HF causal LM, greedy first, sampled retries)."""
from __future__ import annotations

import re

from icml.methods.metaphor_bench.bench import ELEMENTS, IDEAS, OPPOSITE
from icml.methods.metaphor_bench.protocol import judge_text, parse_judgement, with_retries

CLAUSE = re.compile(r"presents?(?P<content>.*?)content.*?expressing(?P<idea>.*?)idea", re.IGNORECASE | re.DOTALL)


def _lexicon(text: str, vocabulary: list[str]) -> list[str]:
    words = set(re.findall(r"[a-z][a-z\-]*", text.lower()))
    return [w for w in vocabulary if w in words]


def read_entries(analysis: dict) -> list[tuple[list[str], list[str]]]:
    """(elements in the 'presents … content' clause, ideas in the 'expressing … idea' clause) per entry."""
    out = []
    for value in analysis.values():
        match = CLAUSE.search(str(value))
        if match:
            out.append((_lexicon(match["content"], ELEMENTS), _lexicon(match["idea"], IDEAS)))
        else:  # an entry off the template: its words count as content and idea alike
            out.append((_lexicon(str(value), ELEMENTS), _lexicon(str(value), IDEAS)))
    return out


def rule_judge(analysis: dict, pairs: list[tuple[str, str]]) -> dict:
    """strict = every golden idea found and none contradicted; loose = round(10 · weighted idea recall)
    with the core entry weighing 0.5 and the others sharing 0.5 (a single entry weighs 1). The error
    class of a failure (loose < 7): perception if a gold element is missing, else mapping."""
    entries = read_entries(analysis)
    elements = {e for es, _ in entries for e in es}
    ideas = {i for _, is_ in entries for i in is_}
    weights = [1.0] if len(pairs) == 1 else [0.5] + [0.5 / (len(pairs) - 1)] * (len(pairs) - 1)
    found = [idea in ideas for _, idea in pairs]
    recall = sum(w for w, hit in zip(weights, found) if hit)
    contradicted = any(OPPOSITE[idea] in ideas for _, idea in pairs)
    loose = int(round(10 * recall + 1e-9))  # +1e-9: 0.5 rounds up, not to the even neighbour
    strict = int(all(found) and not contradicted)
    perceived = [e in elements for e, _ in pairs]
    error = "" if loose >= 7 else ("perception" if not all(perceived) else "mapping")
    return {"strict": strict, "loose": loose, "error_class": error, "perceived": sum(perceived),
            "mapped": sum(p and f for p, f in zip(perceived, found))}


class LLMJudge:
    """The official judge prompt on a local causal LM; up to `attempts` tries (greedy, then sampled)."""

    def __init__(self, path: str, attempts: int = 5, max_new_tokens: int = 512, device: str = "cpu",
                 prompts: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
        self.attempts, self.max_new_tokens, self.device = attempts, max_new_tokens, device
        self.prompts = prompts  # where the judge prompt comes from (protocol.prompts)

    def _generate(self, prompt: str, attempt: int) -> str:
        import torch

        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt")
        else:
            ids = tok(prompt, return_tensors="pt").input_ids
        ids = ids.to(self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                      do_sample=attempt > 0, pad_token_id=tok.pad_token_id or tok.eos_token_id or 0)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def __call__(self, analysis: dict, golden_answers: list[str]) -> dict | None:
        prompt = judge_text(analysis, golden_answers, self.prompts)
        value, _ = with_retries(lambda a: self._generate(prompt, a), parse_judgement, self.attempts)
        if value is None:
            return None
        strict, loose = value
        return {"strict": strict, "loose": loose}
