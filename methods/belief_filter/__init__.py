"""`icml belief-filter`: linear recurrent memory as HMM belief filters (arXiv 2605.31261)."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="belief-filter",
    package=__name__,
    title="Why Linear Recurrent Memory Works in Partially Observable Reinforcement Learning",
    arxiv="2605.31261",
    status="complete",
    result="partly",
    summary="Exact logit filter, approximate leaky linear filter and filter features for RL.",
    config="BeliefFilterConfig",
    tags={"experiment": "string", "inv_eps": "float64", "eps": "float64", "delta": "float64",
          "horizon": "int64", "n_traj": "int64", "n_states": "int64", "n_obs": "int64", "hidden": "int64"},
    metrics={"max_logit_gap": LOWER, "decode_error": LOWER, "decode_error_ci_low": None,
             "decode_error_ci_high": None, "error_over_eps_log": LOWER, "xi": None,
             "episode_return": HIGHER, "return_auc": HIGHER, "final_return": HIGHER,
             "success_rate": HIGHER, "trap_rate": LOWER, "feature_decode_error": LOWER},
    variants="ARMS",
    preset_times={"smoke": "≈ 19 s train+eval+report", "default": "≈ 3 min 20 s train+eval",
                  "paper": "GPU-sized; not timed"},
)
