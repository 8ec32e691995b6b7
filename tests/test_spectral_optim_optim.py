"""SpectralOptimizer: the update rules pinned against torch's AdamW/SGD and against Ψ_p itself.

Most tests set gradients by hand on a tiny model (d = 8) so that every update is known in closed
form; with zero-initialised weights and lr = 1 a single step writes −Ψ_p(direction) into W exactly.
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from icml.methods.spectral_optim.optim import (ABLATIONS, PAPER_VARIANTS, VARIANTS, SpectralOptimizer,
                                               lr_schedule, optimizer_state_bytes, param_layout)
from icml.methods.spectral_optim.psi import psi

D, VOCAB, CONTEXT = 8, 12, 6
BETAS, EPS, MU = (0.9, 0.95), 1e-8, 0.9
SPECTRAL_VARIANTS = ["AdamS", "AdamQ", "AdamZ", "mSGDS", "mSGDQ", "mSGDZ"]




class TinyLM(nn.Module):
    """Linear-layout stand-in for a GPT: tied embedding/head, position embedding, fused QKV."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CONTEXT, D)
        self.ln = nn.LayerNorm(D)
        self.c_attn = nn.Linear(D, 3 * D)  # packed QKV, (3d, d)
        self.up = nn.Linear(D, 3 * D)  # the same shape, but not a QKV by role
        self.down = nn.Linear(3 * D, D, bias=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        h = self.ln(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        q, k, v = self.c_attn(h).split(D, dim=-1)
        h = h + self.down(torch.relu(self.up(h))) + (q * k).sum(-1, keepdim=True) * v
        return self.lm_head(h)


def assign_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def zero_weights(model):
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()


def params_of(model):
    return dict(model.named_parameters())


def make(model, variant, lr_matrix=1.0, lr_vector=1e-2, **kwargs):
    return SpectralOptimizer(model.named_parameters(), variant, lr_matrix, lr_vector, model=model, **kwargs)


def rms_normalised(grads):
    """R_t of Adam, computed from scratch for a gradient history."""
    m = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    for g in grads:
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    t = len(grads)
    return (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)


# ---------------------------------------------------------------------------------------------
# Variants and parameter groups
# ---------------------------------------------------------------------------------------------

def test_variant_table_is_the_papers():
    assert {name: tuple(spec) for name, spec in PAPER_VARIANTS.items()} == {
        "Adam": ("adam", 1.0, 4e-3, 3e-4, 3e-6), "AdamS": ("adam", 0.5, 1e-2, 3e-4, 3e-6),
        "AdamQ": ("adam", 0.25, 2e-2, 6e-4, 3e-6), "AdamZ": ("adam", 0.0, 7e-3, 3e-4, 3e-6),
        "mSGD": ("msgd", 1.0, 5.0, 3e-4, 1e-6), "mSGDS": ("msgd", 0.5, 0.2, 3e-4, 1e-6),
        "mSGDQ": ("msgd", 0.25, 4e-2, 3e-4, 1e-6), "mSGDZ": ("msgd", 0.0, 7e-3, 3e-4, 1e-6),
    }
    for ablation, (base, _) in ABLATIONS.items():
        assert VARIANTS[ablation] == VARIANTS[base]
    model = TinyLM()
    assert make(model, "AdamS_svd").psi_method == "svd"
    assert make(model, "mSGDZ_nosplit", split_qkv=True).split_qkv is False
    assert make(model, "mSGDZ_embvec").embeddings_as_vectors is True
    with pytest.raises(ValueError):
        make(model, "Lion")
    with pytest.raises(ValueError):
        make(model, "Adam", betas=(0.9, 1.0))


def test_groups_hold_every_matrix_once_including_tied_embeddings():
    model = TinyLM()
    opt = make(model, "mSGDZ")
    matrix, vector = opt.param_groups
    assert (matrix["kind"], vector["kind"]) == ("matrix", "vector")
    assert matrix["param_names"] == ["wte.weight", "wpe.weight", "c_attn.weight", "up.weight", "down.weight"]
    assert vector["param_names"] == ["ln.weight", "ln.bias", "c_attn.bias", "up.bias"]
    assert matrix["qkv_layouts"] == ["none", "none", "contiguous", "none", "none"]  # by role, not by shape
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert vector["weight_decay"] == 0.0
    # A hand-built list that names the tied weight twice still counts it once.
    doubled = list(model.named_parameters(remove_duplicate=False))
    assert len(SpectralOptimizer(doubled, "Adam", 1.0, 1.0, model=model).param_groups[0]["params"]) == 5
    # The common Muon convention, on request.
    emb_as_vectors = make(model, "mSGDZ", embeddings_as_vectors=True)
    assert emb_as_vectors.param_groups[0]["param_names"] == ["c_attn.weight", "up.weight", "down.weight"]
    assert "wte.weight" in emb_as_vectors.param_groups[1]["param_names"]
    # Both groups exist even when one is empty (e.g. a bias-only fine-tune); vectors need no model.
    bias_only = SpectralOptimizer([("ln.bias", model.ln.bias)], "AdamS", 1.0, 1.0)
    assert [len(g["params"]) for g in bias_only.param_groups] == [0, 1]


# ---------------------------------------------------------------------------------------------
# p = 1 is exactly AdamW / momentum SGD
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_equals_torch_adamw(weight_decay):
    model = TinyLM()
    reference = copy.deepcopy(model)
    opt = make(model, "Adam", lr_matrix=1e-2, lr_vector=1e-2, weight_decay=weight_decay)
    matrices = [p for p in reference.parameters() if p.ndim >= 2]
    vectors = [p for p in reference.parameters() if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                               {"params": vectors, "weight_decay": 0.0}], lr=1e-2, betas=BETAS, eps=EPS)
    for step in range(5):
        assign_grads(model, step)
        assign_grads(reference, step)
        opt.step()
        adamw.step()
    for name, param in params_of(model).items():
        assert torch.allclose(param, params_of(reference)[name], rtol=0, atol=1e-6), name


def test_msgd_matrices_equal_torch_sgd_and_vectors_equal_adamw():
    model = TinyLM()
    reference = copy.deepcopy(model)
    opt = make(model, "mSGD", lr_matrix=0.1, lr_vector=1e-2)
    sgd = torch.optim.SGD([p for p in reference.parameters() if p.ndim >= 2], lr=0.1, momentum=MU,
                          dampening=0.0, nesterov=False)
    adamw = torch.optim.AdamW([p for p in reference.parameters() if p.ndim < 2], lr=1e-2, betas=BETAS,
                              eps=EPS, weight_decay=0.0)
    for step in range(5):
        assign_grads(model, step)
        assign_grads(reference, step)
        opt.step()
        sgd.step()
        adamw.step()
    for name, param in params_of(model).items():
        assert torch.allclose(param, params_of(reference)[name], rtol=0, atol=1e-6), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vectors_follow_adamw_under_every_variant(variant):
    model = TinyLM()
    reference = copy.deepcopy(model)
    opt = make(model, variant, lr_matrix=1e-2, lr_vector=3e-2)
    vector_names = opt.param_groups[1]["param_names"]
    adamw = torch.optim.AdamW([params_of(reference)[n] for n in vector_names], lr=3e-2, betas=BETAS,
                              eps=EPS, weight_decay=0.0)
    for step in range(3):
        assign_grads(model, step)
        assign_grads(reference, step)
        opt.step()
        adamw.step()
    for name in vector_names:
        assert torch.allclose(params_of(model)[name], params_of(reference)[name], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Ψ_p is applied to M_t (mSGD) or R_t (Adam), per QKV block, in (out, in) orientation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["mSGDS", "mSGDQ", "mSGDZ"])
def test_msgd_update_is_psi_of_the_summed_momentum_buffer(variant):
    model = TinyLM()
    zero_weights(model)
    opt = make(model, variant)
    p = VARIANTS[variant].p
    assign_grads(model, 0)
    g1 = model.down.weight.grad.clone()
    opt.step()
    after_first = model.down.weight.detach().clone()
    assert torch.equal(after_first, -psi(g1, p))  # M₁ = G₁, no (1 − μ) factor
    assign_grads(model, 1)
    g2 = model.down.weight.grad.clone()
    opt.step()
    update = model.down.weight.detach() - after_first
    assert torch.allclose(update, -psi(MU * g1 + g2, p), rtol=0, atol=1e-6)
    assert not torch.allclose(update, -psi(g2, p), rtol=0, atol=1e-3)  # not the raw gradient


@pytest.mark.parametrize("variant", ["AdamS", "AdamQ", "AdamZ"])
def test_adam_update_is_psi_of_the_rms_normalised_direction(variant):
    model = TinyLM()
    zero_weights(model)
    opt = make(model, variant)
    p = VARIANTS[variant].p
    grads = []
    for step in range(3):
        assign_grads(model, step)
        grads.append(model.down.weight.grad.clone())
        before = model.down.weight.detach().clone()
        opt.step()
    update = model.down.weight.detach() - before
    assert torch.allclose(update, -psi(rms_normalised(grads), p), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["mSGDS", "mSGDQ", "mSGDZ"])
def test_batched_step_gives_every_matrix_its_own_psi(variant):
    """One step transforms all matrices together, stacked by shape (the QKV blocks with the
    other d×d matrices, `up` with `down` in their wide orientation); each update must still be
    Ψ_p of that matrix's own direction, as if transformed alone."""
    model = TinyLM()
    zero_weights(model)
    opt = make(model, variant)
    p = VARIANTS[variant].p
    assign_grads(model, 0)
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.ndim >= 2}
    opt.step()
    weights = params_of(model)
    for name, grad in grads.items():  # zero weights, lr = 1, M₁ = G₁: W = −Ψ_p(G)
        blocks = grad.split(D, dim=0) if name == "c_attn.weight" else (grad,)
        expected = -torch.cat([psi(block, p) for block in blocks])
        assert torch.allclose(weights[name].detach(), expected, rtol=0, atol=1e-6), name


def first_step_on_qkv(variant):
    """(update of c_attn, update of up, their directions) after one step from zero weights, lr = 1."""
    model = TinyLM()
    zero_weights(model)
    opt = make(model, variant)
    assign_grads(model, 0)
    grads = model.c_attn.weight.grad.clone(), model.up.weight.grad.clone()
    directions = grads if VARIANTS[variant].family == "msgd" else [rms_normalised([g]) for g in grads]
    opt.step()
    return -model.c_attn.weight.detach(), -model.up.weight.detach(), *directions


@pytest.mark.parametrize("variant", ["AdamS", "mSGDZ"])
def test_packed_qkv_is_split_into_three_blocks(variant):
    p = VARIANTS[variant].p
    qkv_update, up_update, qkv_direction, up_direction = first_step_on_qkv(variant)
    split = torch.cat([psi(block, p) for block in qkv_direction.split(D, dim=0)])
    unsplit = psi(qkv_direction, p)
    # R_1 recomputed here differs from the optimizer's in the last ulp, and the 8×8 blocks of the
    # near-±1 matrix R_1 are ill-conditioned enough to amplify that to ~4e-6.
    assert torch.allclose(qkv_update, split, rtol=0, atol=2e-5)
    assert float((split - unsplit).norm() / unsplit.norm()) > 0.05  # splitting matters
    assert torch.allclose(up_update, psi(up_direction, p), rtol=0, atol=1e-6)  # same shape, not QKV


def test_nosplit_ablation_transforms_the_fused_qkv_whole():
    qkv_update, _, qkv_direction, _ = first_step_on_qkv("mSGDZ_nosplit")
    assert torch.allclose(qkv_update, psi(qkv_direction, 0.0), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=2 * D, n_layer=1, n_head=2, n_positions=CONTEXT,
                                     vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_hf_gpt2_conv1d_weights_are_transformed_in_out_in_orientation(tiny_gpt2):
    model = copy.deepcopy(tiny_gpt2)
    d = model.config.n_embd
    layout = param_layout(model)
    assert layout["transformer.h.0.attn.c_attn.weight"] == "conv1d"
    assert layout["transformer.h.0.mlp.c_fc.weight"] == "conv1d"
    assert layout["lm_head.weight"] == "linear"

    zero_weights(model)
    opt = SpectralOptimizer(model.named_parameters(), "mSGDZ", 1.0, 1e-2, model=model)
    names = opt.param_groups[0]["param_names"]
    assert "transformer.wte.weight" in names and "transformer.wpe.weight" in names
    assert "lm_head.weight" not in names  # tied: listed once, under the embedding's name
    assert opt.param_groups[0]["qkv_layouts"][names.index("transformer.h.0.attn.c_attn.weight")] == "contiguous"

    assign_grads(model, 0)
    block = model.transformer.h[0]
    fc_grad = block.mlp.c_fc.weight.grad.clone()  # stored (in, out) = (d, 4d)
    qkv_grad = block.attn.c_attn.weight.grad.clone()  # stored (d, 3d)
    opt.step()
    fc_update = -block.mlp.c_fc.weight.detach()
    assert torch.allclose(fc_update, psi(fc_grad.T, 0.0).T, rtol=0, atol=1e-6)
    # Logical (out, in) = (4d, d): shape factor √4 = 2 on a band of singular values around 1.
    assert float(torch.linalg.svdvals(fc_update).mean()) == pytest.approx(2.0, rel=0.15)
    qkv_blocks = [psi(b.T, 0.0).T for b in qkv_grad.split(d, dim=1)]  # split along the output dim
    assert torch.allclose(-block.attn.c_attn.weight.detach(), torch.cat(qkv_blocks, dim=1), rtol=0, atol=1e-6)

    # Without the model the layout is unknown (the stored (d, 4d) orientation would get factor 1,
    # c_attn would go unsplit): refused, names or not (tests/test_spectral_optim_gpt2.py).
    with pytest.raises(ValueError, match="'transformer.wte.weight' comes without model="):
        SpectralOptimizer(model.named_parameters(), "mSGDZ", 1.0, 1e-2)
    # Passing the model itself is the same as passing named_parameters() and model=.
    assert SpectralOptimizer(model, "mSGDZ", 1.0, 1e-2).param_groups[0]["param_layouts"] == \
        opt.param_groups[0]["param_layouts"]


def test_ablation_svd_is_exact_and_newton_is_close_to_it():
    updates = {}
    for variant in ("AdamS", "AdamS_svd"):
        model = TinyLM()
        zero_weights(model)
        opt = make(model, variant)
        assign_grads(model, 0)
        direction = rms_normalised([model.down.weight.grad.clone()])
        opt.step()
        updates[variant] = -model.down.weight.detach()
    exact = psi(direction, 0.5, method="svd")
    assert torch.allclose(updates["AdamS_svd"], exact, rtol=0, atol=1e-6)
    # R_1 ≈ sign(G): a well-conditioned (8, 24) matrix, where the damping bias is ~1e-4.
    assert float((updates["AdamS"] - exact).norm() / exact.norm()) < 1e-3


def test_no_svd_is_called_in_the_optimizer_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("SVD/eigendecomposition in the optimizer path")

    for name in ("svd", "svdvals", "eigh", "eig", "eigvalsh"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    monkeypatch.setattr(torch, "svd", forbidden)
    for variant in SPECTRAL_VARIANTS:
        model = TinyLM()
        opt = make(model, variant, lr_matrix=1e-2)
        assign_grads(model, 0)
        opt.step()
    model = TinyLM()
    opt = make(model, "AdamS_svd")
    assign_grads(model, 0)
    with pytest.raises(AssertionError):
        opt.step()


@pytest.mark.parametrize("variant", ["AdamS", "mSGDZ"])
def test_weight_decay_is_decoupled_and_spares_vectors(variant):
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make(model, variant, lr_matrix=0.5, weight_decay=0.1)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # a zero direction: Ψ_p(0) = 0, only the decay acts
    opt.step()
    for name, param in model.named_parameters():
        expected = before[name] * (1 - 0.5 * 0.1) if param.ndim >= 2 else before[name]
        assert torch.equal(param.detach(), expected), name


# ---------------------------------------------------------------------------------------------
# Optimizer plumbing: state, closures, schedulers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["AdamS", "mSGDZ", "mSGD"])
def test_state_dict_round_trip_gives_identical_steps(variant):
    model = TinyLM()
    opt = make(model, variant, lr_matrix=1e-2)
    for step in range(2):
        assign_grads(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    clone = copy.deepcopy(model)
    clone_opt = make(clone, variant, lr_matrix=1e-2)
    clone_opt.load_state_dict(torch.load(buffer))
    for step in range(2, 5):
        assign_grads(model, step)
        assign_grads(clone, step)
        opt.step()
        clone_opt.step()
    for name, param in params_of(model).items():
        assert torch.equal(param, params_of(clone)[name]), name


def test_closure_loss_is_returned_and_used():
    model = TinyLM()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(0))

    def loss_of(m):
        return nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())

    opt = make(model, "AdamS", lr_matrix=1e-2)

    def closure():
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() == pytest.approx(loss_of(reference).item())
    reference_opt = make(reference, "AdamS", lr_matrix=1e-2)
    loss_of(reference).backward()
    reference_opt.step()
    for name, param in params_of(model).items():
        assert torch.equal(param, params_of(reference)[name]), name


def test_lr_schedule_closed_form():
    peak, floor, warmup, total = 2.0, 0.02, 10, 110
    assert lr_schedule(0, total, peak, warmup, floor) == pytest.approx(peak / 11)
    assert lr_schedule(9, total, peak, warmup, floor) == pytest.approx(peak * 10 / 11)
    assert lr_schedule(10, total, peak, warmup, floor) == pytest.approx(peak)
    assert lr_schedule(60, total, peak, warmup, floor) == pytest.approx((peak + floor) / 2)
    assert lr_schedule(110, total, peak, warmup, floor) == pytest.approx(floor)
    assert lr_schedule(500, total, peak, warmup, floor) == floor
    decay = [lr_schedule(s, total, peak, warmup, floor) for s in range(warmup, total + 1)]
    assert decay == sorted(decay, reverse=True)


def test_lambda_lr_scheduler_sets_each_group_on_its_own_schedule():
    model = TinyLM()
    spec = VARIANTS["mSGD"]
    opt = make(model, "mSGD", lr_matrix=spec.lr_matrix, lr_vector=spec.lr_vector)
    total, warmup = 20, 4
    schedules = [lambda s, peak=g["lr"]: lr_schedule(s, total, peak, warmup, spec.min_lr) / peak
                 for g in opt.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
    for step in range(total + 2):
        for group, peak in zip(opt.param_groups, (spec.lr_matrix, spec.lr_vector)):
            assert group["lr"] == pytest.approx(lr_schedule(step, total, peak, warmup, spec.min_lr), rel=1e-12)
        assign_grads(model, step)
        opt.step()
        scheduler.step()
    assert all(math.isfinite(p.detach().abs().max().item()) for p in model.parameters())


def test_optimizer_state_bytes_counts_moments_and_buffers():
    model = TinyLM()
    matrix_bytes = sum(p.numel() * 4 for p in model.parameters() if p.ndim >= 2)
    vector_bytes = sum(p.numel() * 4 for p in model.parameters() if p.ndim < 2)
    for variant, expected in (("AdamS", 2 * (matrix_bytes + vector_bytes)),
                              ("mSGDZ", matrix_bytes + 2 * vector_bytes)):
        opt = make(model, variant, lr_matrix=1e-3)
        assert optimizer_state_bytes(opt) == 0
        assign_grads(model, 0)
        opt.step()
        assert optimizer_state_bytes(opt) == expected
