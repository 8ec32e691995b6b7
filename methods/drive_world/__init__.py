"""`icml drive-world`: VectorWorld — vector-graph driving tiles, a motion-gated VAE, an edge-gated DiT
trained with interval-conditioned MeanFlow for one-step outpainting, and the ΔSim kinematic NPC policy
in closed-loop rollouts (arXiv 2603.17652)."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="drive-world",
    package=__name__,
    title="VectorWorld: Efficient Streaming World Model via Diffusion Flow on Vector Graphs",
    arxiv="2603.17652",
    status="complete",  # ΔSim's 1 km stalls are a diagnosed negative (README: which agent stops the ego)
    result="partly",
    summary="Vector-graph tiles, gated VAE, edge-gated MeanFlow DiT (one-step outpainting), ΔSim NPCs, rollouts.",
    config="DriveWorldConfig",
    tags={"nfe": "int64", "solver": "string", "cfg_scale": "float64", "rel_gate": "string",
          "policy": "string", "start_mode": "string", "model": "string"},
    metrics={"endpoint_gap_m": LOWER, "route_length_m": None, "fd_connectivity": LOWER, "fd_density": LOWER,
             "fd_reach": LOWER, "fd_convenience": LOWER, "nearest_dist_jsd": LOWER, "lat_dev_jsd": LOWER,
             "ang_dev_jsd": LOWER, "length_jsd": LOWER, "width_jsd": LOWER, "speed_jsd": LOWER,
             "collision_rate_pct": LOWER, "static_frac_err": LOWER, "ms_per_tile": LOWER, "toy_energy_distance": LOWER,
             "npc_token_acc": HIGHER, "npc_ade_m": LOWER, "kin_violation_rate": LOWER, "kin_cost_mean": LOWER,
             "offroad_rate": LOWER, "sim_collision_rate": LOWER, "ttc_violation_rate": LOWER,
             "jerk_first_1s": LOWER, "jerk_mean": LOWER, "rollout_km": HIGHER, "rollout_success_1km": HIGHER,
             "stitch_gap_m": LOWER, "stitch_fallback_rate": LOWER,
             "loss": LOWER, "wall_s": LOWER},
    extra_verbs=True,
    variants=("meanflow_1", "meanflow_3", "flow_heun24", "flow_euler1", "meanflow_1_nogate", "vae_recon",
              "idm", "deltasim_discrete", "deltasim_no_dkal", "deltasim", "deltasim_proj"),
    preset_times={"smoke": "≈ 39 s train+eval+report", "default": "≈ 6.3 min train+eval"},
)
