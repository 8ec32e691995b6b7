"""`icml single-index plan` (cli/plan.py): the train phase's estimators on the preset's sample, on one device.
The eval phase integrates the population ODE with scipy on the CPU: it has no GPU part."""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.single_index.estimator import (DTYPE, Sample, eigenvalues, ridge_coefficients, save_direction,
                                                 sir_direction, sphere_step)
from icml.methods.single_index.hermite import hermite_features, target_coefficients
from icml.methods.single_index.pipeline import start_direction

LAYOUT = "one process; a GPU is optional"
OVERSIZE = ["rkhs.n=100000000"]


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _train(cfg):
    def run(tracker):
        rkhs = cfg.rkhs
        with tracker.buffers():  # the sample X [n, d], y and the test set in float64, as make_sample moves them to
            # the device; the run draws them on the host first (host memory, not the GPU's), which the plan skips
            sample = Sample(*(torch.empty(shape, dtype=DTYPE, device=tracker.device) for shape in
                              ((rkhs.n, rkhs.d), (rkhs.n,), (rkhs.n_test, rkhs.d), (rkhs.n_test,))),
                            torch.nn.functional.normalize(torch.ones(rkhs.d, dtype=DTYPE, device=tracker.device), dim=0),
                            target_coefficients(rkhs.target, rkhs.K, unit_norm=True))
        w = start_direction(cfg, sample, 0)
        lam = eigenvalues(rkhs.K, rkhs.rho, w.device)
        # one iteration of fit_joint (its per-iteration logging reads values: left out on meta)
        features = hermite_features(sample.x @ w, rkhs.K)
        a = ridge_coefficients(features, sample.y, lam, rkhs.mu)
        w = sphere_step(w, sample.x, sample.y, a, rkhs.eta, features)
        hermite_features(sample.x @ w, rkhs.K)
        for direction in (save_direction, sir_direction):  # the baselines: slice, whiten, eigendecompose
            direction(sample.x, sample.y, rkhs.slices)
    return run


def steps(cfg, processes: int) -> list[Step]:
    r = cfg.rkhs
    return [Step("train", f"the sample (n = {r.n}, d = {r.d}, float64), one joint iteration, SAVE and SIR", _train(cfg))]
