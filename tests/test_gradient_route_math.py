"""GRAM's identities: routing leaves unrouted groups without gradient and bit-identical; detached
parameter views change no gradient that flows; a profile is the model with its modules deleted;
titration at 0 and 1 are the deleted and kept module; the merged export is the same function; the
compute ratio's closed forms; the routing counts and the compute matching."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from icml.methods.gradient_route import training as T
from icml.methods.gradient_route.config import preset
from icml.methods.gradient_route.cr import compute_ratio, fit_power_law, reference_steps
from icml.methods.gradient_route.model import (CORE, RoutedMLP, build_model, deploy, forward, group_of, group_sizes,
                                               lm_loss, merged_gpt2, param_groups)

F32 = torch.finfo(torch.float32).eps
F64 = np.finfo(np.float64).eps
AUX = ["a0", "a1", "a2", "a3"]


def tiny_cfg():
    cfg = preset("smoke")
    cfg.gpt = dataclasses.replace(cfg.gpt, n_embd=16, n_layer=2, n_head=2, context=12)
    cfg.d_dense, cfg.d_core, cfg.d_aux = 32, 24, 8
    cfg.batch, cfg.accum = 8, 4
    return cfg


@pytest.fixture
def gram():
    return build_model(tiny_cfg(), 57, 24, AUX, 8, seed=3)


def tokens(n=4, length=13, seed=0):
    return torch.randint(1, 57, (n, length), generator=torch.Generator().manual_seed(seed))


def backward(model, x, route, frozen=()):
    lm_loss(forward(model, x[:, :-1], route, frozen), x[:, 1:], 0).backward()


def grads_by_group(model):
    out = {}
    for name, p in model.named_parameters():
        out.setdefault(group_of(name), []).append(p.grad)
    return out


def test_aux_batch_without_core_update_touches_only_its_module(gram):
    backward(gram, tokens(), {"a1": 1.0}, frozen={CORE})
    grads = grads_by_group(gram)
    assert all(g is None for g in grads[CORE])  # embeddings, attention, norms, head and core MLPs alike
    assert all(g is None for name in ("a0", "a2", "a3") for g in grads[name])
    assert all(g is not None for g in grads["a1"])
    first_layer = gram.transformer.h[0].mlp.aux["a1"].c_fc.weight.grad
    assert first_layer.abs().sum() > 0  # the layer-0 module learns through the frozen layers above it


def test_detached_views_leave_the_flowing_gradient_unchanged(gram):
    """Freezing by detached parameter views (not detached activations) gives the module exactly the
    gradient it gets when the core is trainable too: the same ops in the same order."""
    x = tokens()
    twin = copy.deepcopy(gram)
    backward(gram, x, {"a2": 1.0}, frozen={CORE})
    backward(twin, x, {"a2": 1.0})
    for (name, p), q in zip(gram.named_parameters(), twin.parameters()):
        if group_of(name) == "a2":
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert all(p.grad is not None for n, p in twin.named_parameters() if group_of(n) == CORE)


def test_unstepped_groups_are_bit_identical(gram):
    cfg = tiny_cfg()
    optimizers = T.GroupOptimizers(gram, cfg)
    before = {n: p.detach().clone() for n, p in gram.named_parameters()}
    backward(gram, tokens(), {"a0": 1.0}, frozen={CORE})
    assert optimizers.step(1e-2) == ["a0"]
    for name, p in gram.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (group_of(name) == "a0"), name  # no decay, no momentum on the others
        assert p.grad is None
    assert all(not opt.state for g, opt in optimizers.optimizers.items() if g != "a0")  # no step counts either
    # the single-optimizer ablation: after a step that did touch the core, a window that does not
    # still moves the core through weight decay and momentum
    single = T.GroupOptimizers(gram, cfg, single=True)
    backward(gram, tokens(seed=1), {})
    single.step(1e-2)
    frozen_core = {n: p.detach().clone() for n, p in gram.named_parameters() if group_of(n) == CORE}
    backward(gram, tokens(seed=2), {"a0": 1.0}, frozen={CORE})
    single.step(1e-2)
    assert all(not torch.equal(p, frozen_core[n]) for n, p in gram.named_parameters() if group_of(n) == CORE)


def test_clipping_is_over_the_union_of_stepped_groups(gram):
    cfg = dataclasses.replace(tiny_cfg(), clip=1e-3)
    optimizers = T.GroupOptimizers(gram, cfg)
    backward(gram, tokens(), {"a3": 1.0})  # core and a3 receive gradient
    grads = [p.grad.clone() for p in gram.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for optimizer in optimizers.optimizers.values():  # intercept the clipped grads
        optimizer.step = lambda *a, **k: None
    clipped = []
    optimizers.optimizers[CORE].zero_grad = lambda set_to_none=True: clipped.extend(
        p.grad.clone() for p in gram.parameters() if p.grad is not None)
    optimizers.step(1e-2)
    scale = cfg.clip / (float(norm) + 1e-6)  # torch's clip_grad_norm_ adds 1e-6 to the norm
    for g, c in zip(grads, clipped):
        torch.testing.assert_close(c, g * scale, rtol=4 * F32, atol=0)


def test_profile_is_the_model_with_modules_deleted(gram):
    x = tokens()[:, :-1]
    served = deploy(gram, ["a0", "a2"])
    assert all(".aux.a1." not in k and ".aux.a3." not in k for k in served.state_dict())  # weights and biases
    with torch.no_grad():
        torch.testing.assert_close(forward(served, x), forward(gram, x, {"a0": 1.0, "a2": 1.0}), rtol=0, atol=0)
        torch.testing.assert_close(forward(deploy(gram, AUX), x), forward(gram, x), rtol=0, atol=0)  # all-on
        core_only = forward(deploy(gram, []), x)
        # titration: w = 0 is the deleted module, w = 1 the kept one
        torch.testing.assert_close(forward(gram, x, {"a0": 0.0}), core_only, rtol=0, atol=0)
        torch.testing.assert_close(forward(deploy(gram, ["a0"]), x, {"a0": 1.0}), forward(deploy(gram, ["a0"]), x),
                                   rtol=0, atol=0)
    with pytest.raises(KeyError):
        forward(served, x, {"a1": 1.0})  # a deleted module cannot run


def test_titration_scales_the_whole_module_output_bias_included():
    cfg = tiny_cfg()
    model = build_model(cfg, 57, 24, ["a0"], 8, seed=1)
    mlp: RoutedMLP = model.transformer.h[0].mlp
    with torch.no_grad():
        mlp.aux["a0"].c_proj.bias.fill_(0.5)  # a bias the weight must scale too
        h = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
        module = mlp.aux["a0"](h)
        for w in (0.25, 0.5, 0.75):
            mlp.route = {"a0": w}
            torch.testing.assert_close(mlp(h) - mlp.core(h), w * module, rtol=8 * F32, atol=8 * F32)
        mlp.route = None


def test_merged_export_is_the_same_function(gram):
    x = tokens()[:, :-1]
    served = deploy(gram, ["a1"])
    merged = merged_gpt2(served)
    assert merged.config.n_inner == 24 + 8 and type(merged).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        expected, got = forward(served, x), merged(input_ids=x).logits
    # float32: the merged MLP sums core and module units in one matmul instead of two; the error
    # is rounding of O(width) terms per layer, relative to the logits' scale
    torch.testing.assert_close(got, expected, rtol=0, atol=64 * F32 * float(expected.abs().max()))


def test_power_law_fit_and_compute_ratio_closed_forms():
    a, alpha, s0 = 3.0, 0.3, 5.0
    steps = np.arange(25, 401, 25, dtype=float)
    law = fit_power_law(steps, a * (steps + s0) ** -alpha)
    # noiseless curve: least squares recovers the law to the solver's tolerance (1e-8 relative on the cost)
    assert law.alpha == pytest.approx(alpha, rel=1e-5) and law.s0 == pytest.approx(s0, rel=1e-4)
    assert law.a == pytest.approx(a, rel=1e-5) and law.rmse < 1e-7
    # L⁻¹(L(s)) = s in closed form: a few ulps of the exp/log round trip, times s
    s = np.array([10.0, 100.0, 400.0, 4000.0])
    np.testing.assert_allclose(law.inverse(law(s)), s, rtol=64 * F64 / law.alpha, atol=0)
    assert law.inverse(law(0.0) * 1.5) == 0.0  # worse than the untrained start: clipped at 0
    finals = np.array([law(400.0) * 1.01, law(400.0) * 0.99, law(400.0)])  # three baseline seeds
    s_bar = reference_steps(law, finals)
    assert np.mean(compute_ratio(law, s_bar, finals)) == pytest.approx(1.0, abs=16 * F64)  # the baseline's CR is 1
    losses = np.linspace(finals.min() * 0.9, law(1.0), 50)
    crs = compute_ratio(law, s_bar, losses)
    assert np.all(np.diff(crs) < 0)  # strictly monotone: lower loss, more baseline compute


def test_a_curve_bent_like_a_wsd_decay_keeps_finite_compute_ratios():
    """A WSD curve falls faster at the end than any power law: the fit runs to large α and s₀ (A itself
    overflows float64), and L⁻¹ must stay finite because it is computed in log space."""
    steps = np.arange(20, 201, 20, dtype=float)
    losses = np.exp(1.0 - steps / 400.0)  # log-linear: the α, s₀ → ∞ limit of a power law
    law = fit_power_law(steps, losses)
    assert law.rmse < 1e-3 and law.s0 > 10 * steps.max()
    s_bar = reference_steps(law, losses[-1:])
    assert np.isfinite(s_bar) and s_bar == pytest.approx(200.0, rel=1e-2)
    assert compute_ratio(law, s_bar, losses[-1]) == pytest.approx(1.0, abs=16 * F64)
    assert 0 < compute_ratio(law, s_bar, losses[-1] * 1.1) < 1


def test_stratified_routing_counts_and_heterogeneous_windows():
    cfg = dataclasses.replace(tiny_cfg(), p_cr=0.5, p_as=0.3, batch=8, accum=4)
    windows = {"core": tokens(160), **{d: tokens(40, seed=i + 1) for i, d in enumerate(AUX)}}
    steps = T.plan(windows, cfg, 0, routed=True, modules=AUX)
    batches = [mb for step in steps for mb in step]
    core = [mb for mb in batches if mb.label == "core"]
    assert sum(bool(mb.route) for mb in core) == round(0.5 * len(core))
    for d in AUX:
        own = [mb for mb in batches if mb.label == d]
        assert all(mb.route == {d: 1.0} for mb in own)  # the forward set is {core, own module}
        assert sum(CORE in mb.update for mb in own) == round(0.3 * len(own))
        assert all(mb.frozen == ({CORE} if CORE not in mb.update else set()) for mb in own)
    for mb in core:
        assert mb.update == {CORE, *mb.route}  # updated = the forward set
    assert any(len({mb.label for mb in step}) > 1 for step in steps)  # masks per micro-batch, mixed windows
    uniform = T.plan(windows, cfg, 0, routed=True, modules=AUX, window_level=True)
    assert all(len({(mb.label, mb.update) for mb in step}) == 1 for step in uniform)
    # p_af oversampling divides p_as, so the core sees the same amount of aux data
    oversampled = T.plan(windows, dataclasses.replace(cfg, p_af=2.0), 0, routed=True, modules=AUX)
    own = [mb for step in oversampled for mb in step if mb.label == "a0"]
    assert sum(CORE in mb.update for mb in own) == round(0.15 * len(own))


def test_dense_plans_update_the_core_everywhere_and_unlabelled_updates_all():
    cfg = tiny_cfg()
    windows = {"core": tokens(16), "a0": tokens(8, seed=1), "unlabelled": tokens(8, seed=2)}
    assert all(mb.update == {CORE} and mb.route == {} for step in T.plan(windows, cfg, 0, routed=False, modules=[])
               for mb in step)
    routed = [mb for step in T.plan(windows, cfg, 0, routed=True, modules=["a0"]) for mb in step]
    assert all(mb.route is None and mb.update == {CORE, "a0"} for mb in routed if mb.label == "unlabelled")


def test_compute_matching_spends_the_baseline_flops():
    from icml.methods.gradient_route.data import SyntheticCorpus

    cfg = dataclasses.replace(tiny_cfg(), steps=40, batch=8)
    corpus = SyntheticCorpus(0, cfg.gpt.context, 8, 2)
    base = T.baseline_counts(cfg, corpus)
    dense = build_model(cfg, corpus.vocab_size, cfg.d_dense, [], cfg.d_aux, 0)
    gram = build_model(cfg, corpus.vocab_size, cfg.d_core, AUX, cfg.d_aux, 0)
    windows, lam = T.gram_windows(cfg, corpus, base, sum(group_sizes(dense).values()), group_sizes(gram))
    assert lam > 1  # core-only batches run fewer parameters than the dense MLP
    base_flops = T.flops({d: corpus.train(d, n) for d, n in base.items()}, group_sizes(dense), 0.0, routed=False)
    gram_flops = T.flops(windows, group_sizes(gram), cfg.p_cr, routed=True)
    assert gram_flops / base_flops == pytest.approx(1.0, abs=len(windows) / sum(map(len, windows.values())))


def test_wsd_schedule():
    lrs = [T.wsd_lr(t, 100, 1.0, [0.1, 0.8, 0.1]) for t in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[50] == 1.0 and lrs[89] == 1.0
    assert lrs[90] == pytest.approx(1.0) and lrs[99] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_maxent_kl_to_uniform_matches_torch():
    logits = torch.randn(3, 5, 57, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    log_p = torch.log_softmax(logits, -1)
    ours = (log_p.exp() * log_p).sum(-1).mean() + np.log(57)
    uniform = torch.full_like(log_p, -np.log(57))
    reference = torch.nn.functional.kl_div(uniform, log_p, log_target=True, reduction="none").sum(-1).mean()
    torch.testing.assert_close(ours, reference, rtol=0, atol=32 * F64)


def test_maxent_loss_is_kl_to_uniform_at_lambda_zero_and_affine_in_lambda():
    model = build_model(tiny_cfg(), 57, 32, [], 8, seed=1).double()
    x_f, x_r = tokens(seed=1), tokens(seed=2)
    with torch.no_grad():
        at_zero = T.maxent_loss(model, x_f, x_r, 0.0, 0)
        log_p = torch.log_softmax(forward(model, x_f[:, :-1]), -1)
        uniform = torch.full_like(log_p, -np.log(57))
        kl = torch.nn.functional.kl_div(uniform, log_p, log_target=True, reduction="none").sum(-1).mean()
        retain = lm_loss(forward(model, x_r[:, :-1]), x_r[:, 1:], 0)
        # λ = 0: the forget term alone; any λ: that plus λ × the retain cross-entropy
        torch.testing.assert_close(at_zero, kl, rtol=0, atol=64 * F64)
        for lam in (0.5, 15.0):
            torch.testing.assert_close(T.maxent_loss(model, x_f, x_r, lam, 0), kl + lam * retain, rtol=0,
                                       atol=64 * F64 * (1 + lam))


def test_filter_distance_is_the_mean_over_roles_of_mean_squared_cr_gaps():
    from icml.methods.gradient_route.pipeline import filter_distance

    reference = {"core": 1.0, "a0": 0.9, "a1": 0.6, "a2": 0.5, "a3": 0.7}
    crs = {"core": 0.8, "a0": 1.2, "a1": 0.7, "a2": 0.9, "a3": 0.7}
    # profile core+a0: core (0.2²), retain a0 (0.3²), forget a1–a3 ((0.1² + 0.4² + 0²) / 3), each role 1/3
    expected = (0.04 + 0.09 + (0.01 + 0.16 + 0.0) / 3) / 3
    assert filter_distance(crs, reference, ["a0"], AUX) == pytest.approx(expected, rel=1e-14)
    # profile core: no retain role, so the mean is over core and forget only
    assert filter_distance(crs, reference, [], AUX) == pytest.approx((0.04 + (0.09 + 0.01 + 0.16) / 4) / 2, rel=1e-14)
    assert filter_distance(reference, reference, ["a0"], AUX) == 0.0


def test_param_groups_cover_every_parameter_once(gram):
    groups = param_groups(gram)
    assert set(groups) == {CORE, *AUX}
    assert sum(len(v) for v in groups.values()) == len(list(gram.parameters()))
    sizes = group_sizes(gram)
    # 2 layers × (c_fc 16×8 + 8, c_proj 8×16 + 16) per module
    assert all(sizes[a] == 2 * (16 * 8 + 8 + 8 * 16 + 16) for a in AUX)


def test_lora_starts_as_the_base_trains_only_itself_and_merges_to_the_same_function():
    """FT-LoRA: B = 0 makes the wrapped model the base exactly; a training step moves only A and B
    (the base is bit-identical); merging x A B into W serves the same function as the wrapped layers."""
    from icml.methods.gradient_route.model import add_lora, lora_rank, lora_state, merge_lora

    cfg = dataclasses.replace(tiny_cfg(), lr=1e-2)
    base = build_model(cfg, 57, 32, [], 8, seed=5).double()
    x = tokens()
    wrapped = copy.deepcopy(base)
    lora = add_lora(wrapped, rank=3, seed=0)
    assert len(lora) == 2 * 2 * cfg.gpt.n_layer  # A and B of c_fc and c_proj per block
    with torch.no_grad():
        torch.testing.assert_close(forward(wrapped, x[:, :-1]), forward(base, x[:, :-1]), rtol=0, atol=0)
    frozen = {n: p.detach().clone() for n, p in wrapped.named_parameters() if not p.requires_grad}
    steps = T.plan({"core": tokens(8)}, cfg, 0, routed=False, modules=[])
    T.train_steps(wrapped, steps, cfg, 0)
    assert all(torch.equal(p, frozen[n]) for n, p in wrapped.named_parameters() if n in frozen)
    assert all(p.detach().abs().sum() > 0 for p in lora)  # B has left zero, so A got gradient too
    merged = merge_lora(copy.deepcopy(base), [lora_state(wrapped)])
    with torch.no_grad():
        expected, got = forward(wrapped, x[:, :-1]), forward(merged, x[:, :-1])
    # float64: x(W + AB) against xW + (xA)B, rounding of O(width) products per layer
    torch.testing.assert_close(got, expected, rtol=0, atol=256 * F64 * float(expected.abs().max()))
    # merging two domains adds both updates; merging none is the base
    twice = merge_lora(copy.deepcopy(base), [lora_state(wrapped)] * 2)
    layer = "transformer.h.0.mlp.core.c_fc"
    delta = lora_state(wrapped)[layer]
    torch.testing.assert_close(dict(twice.named_modules())[layer].weight,
                               dict(base.named_modules())[layer].weight + 2 * delta, rtol=0, atol=4 * F64)
    # rank 13 at the default: the LoRA of a block has one aux module's parameter count (to within one rank)
    default = build_model(preset("default"), 57, 512, [], 64, seed=0)
    per_rank, module = 2 * (128 + 512), 2 * 128 * 64 + 64 + 128
    assert lora_rank(default, 64) == 13 and abs(13 * per_rank - module) <= per_rank / 2


def test_a_chunked_attack_round_is_the_full_batch_step(gram):
    """attack_round over parts of 3 windows (padding in some) takes the full batch's mean-loss gradient: the same
    loss and the same AdamW step as one full-batch backward, up to float32 summation order."""
    x = tokens(n=8, seed=5)
    x[1, 9:] = 0  # padded tails: the mean is over the batch's real targets, not per part
    x[6, 4:] = 0
    models = [copy.deepcopy(gram) for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    whole = T.attack_round(models[0], optimizers[0], x, 0, clip=1e9)
    parts = T.attack_round(models[1], optimizers[1], x, 0, clip=1e9, chunk=3)
    assert float(parts) == pytest.approx(float(whole), rel=32 * F32)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=64 * F32, atol=64 * F32)
