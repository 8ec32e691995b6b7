"""The training step's micro-batching is exact: length-sorted micro-batches, each padded to its own
longest trace, give the loss and the gradient of HF's loss on the one batch padded to its longest
trace (`model(**pad_batch(batch)).loss`), and the validation loss does not depend on the order of
the traces. float64, so the only differences are summation order."""
from __future__ import annotations

import random

import pytest
import torch

from icml.methods.reason_stop.config import preset
from icml.methods.reason_stop.data import VOCAB, encode_trace, generate_traces
from icml.methods.reason_stop.model import accumulate_batch_gradient, pad_batch, validation_loss

EPS = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = preset("smoke")
    vocab = {w: i for i, w in enumerate(VOCAB)}
    traces = [encode_trace(t, vocab) for t in generate_traces(cfg, 0, "train", 24)]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"  # the training attention
    return LlamaForCausalLM(config).double().train(), traces, cfg


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("micro_batch,max_length", [(1, 192), (5, 192), (24, 192), (5, 60)])
def test_micro_batches_equal_one_padded_batch(setup, micro_batch, max_length):
    model, traces, _ = setup
    lengths = {len(ids) for ids, _ in traces}
    assert max(lengths) - min(lengths) > 50  # padding to the longest trace would matter
    padded = pad_batch(traces, 0, max_length)
    # HF's loss casts the logits to float32: it pins the definition (shifted labels, mean over the
    # labelled tokens) to float32 rounding; the tight float64 reference below is the same definition
    hf_loss = model(**padded).loss.item()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=padded["input_ids"]).logits[:, :-1]
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  padded["labels"][:, 1:].reshape(-1), ignore_index=-100)
    reference.backward()
    reference_grad = gradients(model).clone()
    assert reference.item() == pytest.approx(hf_loss, rel=1e-6, abs=0)
    model.zero_grad(set_to_none=True)
    loss = accumulate_batch_gradient(model, traces, 0, max_length, micro_batch, "cpu")
    grad = gradients(model)
    # ~2000 target tokens summed in another order and split over micro-batches: rounding is a few
    # hundred eps at most on O(1) values; 1e-12 is ~4500 eps, far below any real change (a dropped
    # or double-counted token moves the loss by ~1e-3)
    assert loss == pytest.approx(reference.item(), rel=1e-12, abs=0)
    assert torch.allclose(grad, reference_grad, rtol=1e-10, atol=1e-12 * float(reference_grad.abs().max()))
    assert float(reference_grad.abs().max()) > 1e-3  # a real gradient, not zeros on both sides


def test_validation_loss_is_order_free(setup):
    model, _, cfg = setup
    vocab = {w: i for i, w in enumerate(VOCAB)}
    traces = [encode_trace(t, vocab) for t in generate_traces(cfg, 0, "val", 150)]  # 3 chunks of 64
    shuffled = list(traces)
    random.Random(1).shuffle(shuffled)
    by_trace = []
    with torch.no_grad():
        for ids, think_at in traces:
            batch = pad_batch([(ids, think_at)], 0, cfg.max_length)
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
            target = batch["labels"][:, 1:]
            by_trace.append((torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                               ignore_index=-100, reduction="sum"),
                             int((target != -100).sum())))
    expected = sum(float(s) for s, _ in by_trace) / sum(n for _, n in by_trace)
    # validation casts the logits to float32 (as HF's loss does): float32 rounding, eps32 = 1.2e-7
    assert validation_loss(model, shuffled, cfg, 0, "cpu") == pytest.approx(expected, rel=1e-6, abs=0)
    assert model.training  # validation hands the model back in training mode
