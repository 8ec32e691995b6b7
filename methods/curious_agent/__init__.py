"""`icml curious-agent`: GLANCE visual-linguistic curiosity for a tiny VLM agent (arXiv 2605.03782)."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="curious-agent",
    package=__name__,
    title="What You Think is What You See: Driving Exploration in VLM Agents via Visual-Linguistic Curiosity",
    arxiv="2605.03782",
    status="complete",  # diagnosed negative at this scale (README)
    result="not at this scale",
    summary="GLANCE: curiosity from a tiny VLM agent's linguistic next-state prediction, in MiniGrid.",
    config="CuriousAgentConfig",
    tags={"experiment": "string", "env_id": "string", "reward_mode": "string", "beta": "float64", "reset_every": "float64",
          "ema_alpha": "float64"},
    metrics={"success_rate": HIGHER, "mean_return": HIGHER, "steps_to_first_success": LOWER,
             "first_success_found": HIGHER, "coverage": HIGHER, "explore_loss": None,
             "intrinsic_reward_raw": None, "intrinsic_reward_norm": None, "projector_reset": None,
             "ri_novel_over_revisit": HIGHER, "probe_ri_decay": LOWER, "probe_fresh_ri_decay": HIGHER,
             "obs_slot_acc": HIGHER, "pred_slot_acc": HIGHER, "pred_slot_acc_late": HIGHER,
             "policy_entropy": None, "value_loss": None, "sps": None, "episode_return": HIGHER},
    variants="ARMS",
    preset_times={"default": "≈ 8.7 min train+eval", "paper": "GPU-sized; not timed"},
)
