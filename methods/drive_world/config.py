"""Configuration of `icml drive-world`: one dataclass tree, three presets (spec: Models and presets)."""
from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("vae", "dit", "sim", "toy")
GENERATORS = ("meanflow_1", "meanflow_3", "flow_heun24", "flow_euler1", "meanflow_1_nogate", "vae_recon")
POLICIES = ("idm", "deltasim_discrete", "deltasim_no_dkal", "deltasim", "deltasim_proj")


@dataclass
class DataConfig:
    n_tiles: int = 6000  # training tiles (held-out tiles: eval_tiles, from other world seeds)
    eval_tiles: int = 200
    tiles_per_world: int = 12
    tile_m: float = 64.0
    max_lanes: int = 32
    lane_points: int = 10
    max_agents: int = 16
    partition_frac: float = 0.3  # training tiles that carry a random partition (outpainting)
    parked_frac: float = 0.2
    history_s: float = 3.0
    data_dir: str = ""  # user tiles (Scenario-Dreamer *.pkl) instead of generated ones: scenario_dreamer.py


@dataclass
class VAEConfig:
    d: int = 64
    blocks: int = 2
    heads: int = 4
    lane_latent: int = 8
    agent_latent: int = 6
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3


@dataclass
class DiTConfig:
    lane_d: int = 96
    agent_d: int = 64
    heads: int = 4
    blocks: int = 2  # l2l repeats
    edge_d: int = 32
    steps: int = 3000
    batch_size: int = 32
    lr: float = 5e-4
    cfg_drop: float = 0.1
    guidance: float = 4.0
    r_equals_t: float = 0.75
    forced_frac: float = 0.15  # last share of each batch forced to (t, r) = (1, 0)
    logit_mean: float = -0.4
    logit_std: float = 1.0
    adaptive_power: float = 0.8
    w_lane: float = 1.0
    clamp: float = 5.0


@dataclass
class SimConfig:
    d: int = 64
    layers: int = 2
    heads: int = 4
    history: int = 10  # 1 s at 10 Hz
    neighbours: int = 8
    vocab: int = 128
    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    dkal: float = 0.05
    dkal_beta: float = 1.0
    dkal_cost_cap: float = 10.0  # [S] token costs capped inside DKAL (deltasim.policy_loss; NOTES.md)
    avoid_beta: float = 2.0
    avoid_margin: float = 0.2
    a_max: float = 6.0
    omega_max: float = 1.5
    kappa_max: float = 0.25
    a_lat: float = 8.0


@dataclass
class RolloutConfig:
    n: int = 20
    km: float = 1.0
    agents: int = 12
    frontier_m: float = 20.0  # outpaint when the route ahead of the ego is shorter than this
    seed_m: float = 16.0  # [S] the procedural seed scene reaches this far ahead of the ego start
    stitch_m: float = 1.0  # a generated lane continues the route if it starts within this of the route end
    stitch_heading_deg: float = 30.0  # [S] … and its start heading is within this of the route-end heading
    max_steps: int = 1500


@dataclass
class ToyConfig:
    """The 2-D 8-Gaussian toy: the scene MeanFlow / flow code on one 2-D node (dit.* sampling keys shared)."""
    steps: int = 1000
    batch_size: int = 256
    hidden: int = 128
    lr: float = 1e-3
    samples: int = 1000  # generated points scored per variant


@dataclass
class DriveWorldConfig:
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    data: DataConfig = field(default_factory=DataConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)
    eval_samples: int = 64  # generated tiles scored per generator variant
    latency_repeats: int = 10


def preset(name: str) -> DriveWorldConfig:
    cfg = DriveWorldConfig()
    if name == "smoke":
        cfg.data.n_tiles, cfg.data.eval_tiles = 300, 48
        cfg.vae.d, cfg.vae.steps, cfg.vae.blocks = 32, 100, 1
        cfg.dit.lane_d, cfg.dit.agent_d, cfg.dit.blocks, cfg.dit.steps, cfg.dit.edge_d = 48, 32, 1, 100, 16
        cfg.sim.d, cfg.sim.layers, cfg.sim.steps, cfg.sim.vocab = 32, 1, 100, 64
        cfg.vae.batch_size, cfg.dit.batch_size, cfg.sim.batch_size = 8, 4, 64  # the 60 s budget
        cfg.rollout.n, cfg.rollout.km, cfg.rollout.agents = 1, 0.2, 4
        cfg.rollout.max_steps = 300  # 0.2 km needs ≈ 200 steps: an ego stuck behind a stopped NPC ends there
        cfg.eval_samples, cfg.latency_repeats = 8, 2
        cfg.toy.steps, cfg.toy.samples = 100, 256
    elif name == "default":  # calibrated to < 15 min of CPU on 2 cores (NOTES.md: the default preset, its cuts against the spec)
        cfg.vae.steps = 600
        cfg.dit.steps, cfg.dit.batch_size = 400, 16  # MeanFlow step 0.37 CPU s at batch 16 (forward + JVP + backward)
        cfg.sim.steps = 600
        cfg.rollout.n = 10  # 10 × 1 km per policy × start mode (spec: 20; ≈ 2.5 CPU s per km, NOTES.md)
    elif name == "paper":
        cfg.vae.d, cfg.vae.blocks, cfg.vae.steps, cfg.vae.lane_latent, cfg.vae.agent_latent = 768, 3, 85_000, 24, 18
        cfg.dit.lane_d, cfg.dit.agent_d, cfg.dit.steps, cfg.dit.heads, cfg.dit.blocks = 2048, 512, 165_000, 16, 3
        cfg.sim.d, cfg.sim.vocab, cfg.sim.history = 256, 384, 10
        cfg.data.max_lanes, cfg.data.lane_points, cfg.data.max_agents = 100, 20, 30
    return cfg


def validate(cfg: DriveWorldConfig) -> None:
    bad = [s for s in cfg.stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stage '{bad[0]}' in stages; valid: {', '.join(STAGES)}")
    for key, value in (("data.n_tiles", cfg.data.n_tiles), ("data.eval_tiles", cfg.data.eval_tiles),
                       ("vae.steps", cfg.vae.steps), ("dit.steps", cfg.dit.steps), ("sim.steps", cfg.sim.steps),
                       ("sim.vocab", cfg.sim.vocab), ("rollout.n", cfg.rollout.n), ("eval_samples", cfg.eval_samples),
                       ("toy.steps", cfg.toy.steps), ("toy.batch_size", cfg.toy.batch_size),
                       ("data.max_lanes", cfg.data.max_lanes), ("data.max_agents", cfg.data.max_agents)):
        if value < 1:
            raise ValueError(f"{key} must be ≥ 1 (got {value})")
    for key, value in (("data.partition_frac", cfg.data.partition_frac), ("dit.r_equals_t", cfg.dit.r_equals_t),
                       ("dit.forced_frac", cfg.dit.forced_frac), ("dit.cfg_drop", cfg.dit.cfg_drop),
                       ("data.parked_frac", cfg.data.parked_frac)):
        if not 0 <= value <= 1:
            raise ValueError(f"{key} must be in [0, 1] (got {value})")
    if cfg.data.data_dir:
        from pathlib import Path

        if not Path(cfg.data.data_dir).is_dir():
            raise ValueError(f"data.data_dir {cfg.data.data_dir} is not a directory; pass a folder of Scenario-Dreamer "
                             "*.pkl tiles")
        if not any(Path(cfg.data.data_dir).glob("*.pkl")):
            raise ValueError(f"data.data_dir {cfg.data.data_dir} holds no *.pkl tiles (Scenario-Dreamer format)")
    if cfg.toy.samples < 2:
        raise ValueError(f"toy.samples must be ≥ 2 for the energy distance (got {cfg.toy.samples})")
    if cfg.sim.dkal_cost_cap <= 0:
        raise ValueError(f"sim.dkal_cost_cap must be > 0 (got {cfg.sim.dkal_cost_cap}); use inf for uncapped costs")
    if cfg.rollout.km <= 0:
        raise ValueError(f"rollout.km must be > 0 (got {cfg.rollout.km})")
    if cfg.rollout.stitch_m <= 0 or not 0 < cfg.rollout.stitch_heading_deg <= 180:
        raise ValueError(f"rollout.stitch_m must be > 0 and rollout.stitch_heading_deg in (0, 180] (got "
                         f"{cfg.rollout.stitch_m}, {cfg.rollout.stitch_heading_deg})")
    if not 0 < cfg.rollout.seed_m <= cfg.data.tile_m / 2 or cfg.rollout.frontier_m <= 0:
        raise ValueError(f"rollout.seed_m must be in (0, data.tile_m/2] and rollout.frontier_m > 0 (got "
                         f"{cfg.rollout.seed_m}, {cfg.rollout.frontier_m})")
    for name, d in (("vae.d", cfg.vae.d), ("dit.lane_d", cfg.dit.lane_d), ("dit.agent_d", cfg.dit.agent_d)):
        heads = cfg.vae.heads if name == "vae.d" else cfg.dit.heads
        if d % heads:
            raise ValueError(f"{name} ({d}) must be divisible by the number of heads ({heads})")
