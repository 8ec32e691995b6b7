"""`icml rl-sgd`: SGD vs AdamW for RL with verifiable rewards — GRPO from a warm-started tiny Llama,
update sparsity on bf16 snapshots, effective rank of the updates and optimizer memory
(arXiv 2602.07729)."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="rl-sgd",
    package=__name__,
    title="Do We Need Adam? Surprisingly Strong and Sparse Reinforcement Learning with SGD in LLMs",
    arxiv="2602.07729",
    status="complete",
    result="partly",
    summary="GRPO with SGD vs AdamW (and momentum/adaptivity ablations): accuracy, bf16 update density, rank, memory.",
    config="RlSgdConfig",
    tags={"optimizer": "string", "lr": "float64", "regime": "string", "master_dtype": "string",
          "group_size": "int64", "selected": "string"},
    metrics={"reward_mean": HIGHER, "frac_groups_skipped": None, "grad_norm": None, "loss": None,
             "sft_loss": LOWER, "band_accuracy": HIGHER, "accuracy": HIGHER, "best_accuracy": HIGHER,
             "update_density_bf16": None, "update_density_bf16_matrices": None, "update_density_tol": None,
             "update_density_fp32": None, "effective_rank_99": None, "effective_rank_99_bf16": None, "optimizer_state_bytes": LOWER,
             "wall_time_s": LOWER, "gap_adamw_minus_sgd": None, "diverged": LOWER},
    variants="ARMS",
    preset_times={"default": "≈ 8.3 min train+eval", "paper": "GPU-sized; not timed"},
)
