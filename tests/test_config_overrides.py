"""--set / --config parsing against a method's config dataclasses."""
from __future__ import annotations

import pytest

from icml.cli import config as config_io
from icml.cli.errors import UsageError
from icml.methods.belief_filter.config import BeliefFilterConfig, preset


def test_types_are_parsed_from_the_field_annotations():
    cfg = BeliefFilterConfig()
    config_io.apply_overrides(cfg, ["e2.n_traj=100", "e2.lambda=0.5", "arms=gru,alf", "env.slip=uniform",
                                    "e3.inv_eps_grid=[30, 60.5]", "hmm.path=x.json", "ppo.lr=1e-3"])
    assert cfg.e2.n_traj == 100 and isinstance(cfg.e2.n_traj, int)
    assert cfg.e2.lambda_ == 0.5
    assert cfg.arms == ["gru", "alf"]
    assert cfg.env.slip == "uniform"
    assert cfg.e3.inv_eps_grid == [30.0, 60.5] and all(isinstance(v, float) for v in cfg.e3.inv_eps_grid)
    assert cfg.hmm.path == "x.json" and cfg.ppo.lr == 1e-3
    config_io.apply_overrides(cfg, ["hmm.path=none", "e3.inv_eps_grid=30,60"])
    assert cfg.hmm.path is None and cfg.e3.inv_eps_grid == [30.0, 60.0]
    config_io.apply_overrides(cfg, ["hmm.path=1e3", "env.slip=true"])  # text that parses as JSON
    assert cfg.hmm.path == "1e3" and cfg.env.slip == "true"
    config_io.apply_overrides(cfg, ["e2.inv_eps_grid=40", "arms=gru"])  # one value for a list key
    assert cfg.e2.inv_eps_grid == [40.0] and cfg.arms == ["gru"]


@pytest.mark.parametrize("assignment, message", [
    ("e2.n_traj=1.5", "expected an integer"),
    ("e2.n_traj=true", "expected an integer"),
    ("ppo.lr=fast", "expected a number"),
    ("e3.inv_eps_grid=a,b", "expected a list of a number"),
    ("e2=3", "unknown config key 'e2'"),
    ("e2.n_traj.x=3", "unknown config key"),
    ("=3", "malformed --set"),
])
def test_bad_overrides(assignment, message):
    with pytest.raises(UsageError) as info:
        config_io.apply_overrides(BeliefFilterConfig(), [assignment])
    assert message in info.value.line()


def test_unknown_key_lists_valid_keys():
    with pytest.raises(UsageError) as info:
        config_io.apply_overrides(BeliefFilterConfig(), ["e2.ntraj=4"])
    line = info.value.line()
    assert "did you mean 'e2.n_traj'" in line
    assert all(key in line for key in config_io.valid_keys(BeliefFilterConfig))


def test_dict_round_trip_reproduces_the_config():
    cfg = preset("smoke")
    config_io.apply_overrides(cfg, ["e2.lambda=0.3", "arms=gru"])
    tree = config_io.to_dict(cfg)
    assert tree["e2"]["lambda"] == 0.3 and "lambda_" not in tree["e2"]
    rebuilt = config_io.apply_tree(preset("default"), tree, "test")
    assert rebuilt == cfg


def test_config_tree_rejects_unknown_and_mistyped_keys():
    with pytest.raises(UsageError, match="unknown config key 'e2.bogus'"):
        config_io.apply_tree(BeliefFilterConfig(), {"e2": {"bogus": 1}}, "file")
    with pytest.raises(UsageError, match="for 'seeds'"):
        config_io.apply_tree(BeliefFilterConfig(), {"seeds": "three"}, "file")
