"""`icml latent-thought`: PonderLM-2 (arXiv 2509.23184) — a causal LM that emits K continuous latent
thoughts (its own final-norm hidden state, fed back as new input slots sharing the token's position
id) before each token, trained with a Jacobi-parallel solve and decoded exactly with a KV cache."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="latent-thought",
    package=__name__,
    title="PonderLM-2: Pretraining LLM with Latent Thoughts in Continuous Space",
    arxiv="2509.23184",
    status="complete",
    result="partly",
    summary="PonderLM-2: K latent thoughts per token (fed-back hidden states), Jacobi training, exact decoding.",
    config="LatentThoughtConfig",
    tags={"K": "int64", "J": "int64", "solve": "string", "iter": "int64", "seq_len": "int64"},
    metrics={"val_nats_per_byte": LOWER, "val_bits_per_byte": LOWER, "jacobi_gap": None,
             "jacobi_residual": LOWER, "jacobi_error": LOWER, "exact_vs_cached_max_logit_diff": LOWER,
             "train_flops_per_token": None, "infer_flops_per_token": LOWER, "params_nonembed": None,
             "train_tokens_per_s": HIGHER, "gen_tokens_per_s": HIGHER, "decoder_calls_per_token": None,
             "train_loss": LOWER, "wall_s": LOWER},
    variants="ARMS",
    extra_verbs=True,
    preset_times={"paper": "GPU-sized; not timed"},
)
