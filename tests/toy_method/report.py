def plots(frame, config, run=None):
    """Two plots: one from metrics.parquet, one from the run's extra table (a hook with `run`)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(4, 3))
    train = frame[frame["phase"] == "train"]
    for variant, rows in train.groupby("variant"):
        axis.plot(rows["step"], rows["value"], label=variant)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.legend()
    out = [("toy loss curve", figure)]
    predictions = run.table("predictions") if run is not None else None
    if predictions is not None:
        figure, axis = plt.subplots(figsize=(4, 3))
        axis.scatter(predictions["target"], predictions["predicted"], s=4)
        out.append(("toy predictions", figure))
    return out
