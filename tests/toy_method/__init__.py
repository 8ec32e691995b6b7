"""A minimal method used only by the framework tests: least squares by SGD, with
checkpoints, train curves, an eval phase and one plot. It exercises every part of the
lifecycle in a fraction of a second (and slowly, via `sleep`, for the Ctrl-C test)."""
from dataclasses import dataclass, field

from icml.cli.method import LOWER, Method


@dataclass
class ToyConfig:
    steps: int = 20
    lr: float = 0.05
    checkpoint_every: int = 5
    sleep: float = 0.0  # seconds per step, to make a run slow enough to interrupt
    variants: list[str] = field(default_factory=lambda: ["sgd", "momentum"])
    data: str | None = None  # set by --data; the toy only records it


def preset(name: str) -> ToyConfig:
    return ToyConfig(steps={"smoke": 20, "default": 40, "paper": 400}[name])


def validate(cfg: ToyConfig) -> None:
    if cfg.steps <= 0:
        raise ValueError(f"steps must be positive, not {cfg.steps}")


METHOD = Method(name="toy", package=__name__, title="A toy for the framework tests", arxiv="0000.00000",
                status="test", summary="Least squares by SGD.", config=ToyConfig, preset=preset,
                validate=validate, tags={"lr": "float64"}, metrics={"loss": LOWER, "mse": LOWER})
