"""The local-HF code paths on tiny random checkpoints written here: the official judge prompt on a
causal LM (through from_pretrained, local files only) and a mean-pooled encoder for retrieval."""
from __future__ import annotations

import pytest
import torch


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "```json", "{", "}", '"', ":", "reasoning", "x", "1", "7", ","])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", eos_token="[PAD]")
    tok.save_pretrained(path)
    return len(vocab)


def test_llm_judge_runs_the_official_prompt_on_a_local_causal_lm(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from icml.methods.metaphor_bench.judges import LLMJudge

    n = _word_tokenizer(tmp_path)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=n, n_positions=2048, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    judge = LLMJudge(str(tmp_path), attempts=2, max_new_tokens=3)
    calls = []
    original = judge._generate
    judge._generate = lambda prompt, attempt: calls.append((prompt, attempt)) or original(prompt, attempt)
    # a random 3-token answer is never the judge JSON: every attempt is used, then the item is unjudged
    assert judge({"analysis_1": "a"}, ["g"]) is None
    assert [a for _, a in calls] == [0, 1] and "{'analysis_1': 'a'}" in calls[0][0] and "['g']" in calls[0][0]
    judge._generate = lambda prompt, attempt: '```json\n{"reasoning": "r", "strict_score": 1, "loose_score": 7}\n```'
    assert judge({"analysis_1": "a"}, ["g"]) == {"strict": 1, "loose": 7}


def test_hf_embedder_is_mean_pooled_and_unit_norm(tmp_path):
    from transformers import BertConfig, BertModel

    from icml.methods.metaphor_bench.kg import HFEmbedder

    n = _word_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=n, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=64))
    model.save_pretrained(tmp_path)
    embed = HFEmbedder(str(tmp_path))
    out = embed(["x 1", "x 1 7 , x"])
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2), atol=4 * torch.finfo(torch.float32).eps, rtol=0)
    batch = embed.tokenizer(["x 1"], return_tensors="pt")
    with torch.no_grad():
        alone = torch.nn.functional.normalize(embed.model(**batch).last_hidden_state.mean(1), dim=-1)
    # padding in a batch does not change the masked mean (float32 attention over ≤ 7 tokens)
    torch.testing.assert_close(out[0], alone[0], atol=1e-5, rtol=0)
