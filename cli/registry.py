"""The registry of methods: subcommand -> package. Add one line here per new method.

Kept explicit (no entry-point or folder scanning) so that `grep` finds every method and a
test can check that every folder under methods/ is listed and importable without torch.
"""
from __future__ import annotations

import importlib

from .errors import UsageError
from .method import Method

METHODS: dict[str, str] = {
    "attribute-motion": "icml.methods.attribute_motion",
    "belief-filter": "icml.methods.belief_filter",
    "curious-agent": "icml.methods.curious_agent",
    "diverse-init": "icml.methods.diverse_init",
    "drive-world": "icml.methods.drive_world",
    "event-classify": "icml.methods.event_classify",
    "explain-vit": "icml.methods.explain_vit",
    "fgad": "icml.methods.fgad",
    "flow-bounds": "icml.methods.flow_bounds",
    "gradient-route": "icml.methods.gradient_route",
    "kv-compress": "icml.methods.kv_compress",
    "latent-thought": "icml.methods.latent_thought",
    "metaphor-bench": "icml.methods.metaphor_bench",
    "reason-stop": "icml.methods.reason_stop",
    "rl-sgd": "icml.methods.rl_sgd",
    "robust-sysid": "icml.methods.robust_sysid",
    "single-index": "icml.methods.single_index",
    "soup": "icml.methods.soup",
    "spectral-optim": "icml.methods.spectral_optim",
}


def get(name: str) -> Method:
    if name not in METHODS:
        raise UsageError(f"unknown method '{name}'",
                         f"run 'icml list' to see the methods ({', '.join(sorted(METHODS))})")
    return importlib.import_module(METHODS[name]).METHOD


def all_methods() -> list[Method]:
    return [get(name) for name in METHODS]
