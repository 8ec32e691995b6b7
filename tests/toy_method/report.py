def plots(frame, config):
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(4, 3))
    train = frame[frame["phase"] == "train"]
    for variant, rows in train.groupby("variant"):
        axis.plot(rows["step"], rows["value"], label=variant)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.legend()
    return [("toy loss curve", figure)]
