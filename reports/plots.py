"""Small plotting helpers shared by the methods' report hooks (matplotlib, Agg backend)."""
from __future__ import annotations


def new_axes(title: str, xlabel: str, ylabel: str, *, xlog: bool = False, ylog: bool = False,
             size: tuple[float, float] = (6.4, 4.0)):
    """A titled, labelled single-panel figure; returns (figure, axis)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=size)
    axis.set_title(title)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if xlog:
        axis.set_xscale("log")
    if ylog:
        axis.set_yscale("log")
    return figure, axis
