"""Event loaders on hand-made bytes (every format, overflow markers, headers, malformed files), the
ESIM-style simulator (determinism, polarity and threshold behaviour, the direction task) and the
preprocessing (time-order invariance, augmentation)."""
from __future__ import annotations

import struct

import h5py
import numpy as np
import pytest

from icml.data.events import (EventFileError, SimulatorConfig, load_labelled, read_aedat2, read_aedat31, read_bin,
                              read_events, read_gesture_labels, read_h5, read_h5_windows, read_npy,
                              simulate_dataset, simulate_events)
from icml.methods.event_classify.data import event_cloud, random_crop, split_validation, time_reverse, windows_of


def bin_record(x, y, p, t):
    return bytes([x, y, (p << 7) | ((t >> 16) & 0x7F), (t >> 8) & 0xFF, t & 0xFF])


# N-MNIST .bin ------------------------------------------------------------------------------------
def test_bin_decodes_records_and_overflow_markers(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(bin_record(3, 4, 1, 0x000345) + bin_record(33, 0, 0, 0x001F00)
                     + bin_record(0, 240, 0, 0)  # overflow: dropped, later events + 2^13 µs
                     + bin_record(5, 6, 1, 0x000010) + bin_record(7, 8, 0, 0x7F1234))
    ev = read_bin(path, (34, 34))
    assert ev["x"].tolist() == [3, 33, 5, 7] and ev["y"].tolist() == [4, 0, 6, 8]
    assert ev["p"].tolist() == [1, 0, 1, 0]
    assert ev["t"].tolist() == [0x345, 0x1F00, 0x10 + 8192, 0x7F1234 + 8192]


def test_bin_overflow_shifts_every_later_timestamp(tmp_path):
    path = tmp_path / "b.bin"
    path.write_bytes(bin_record(1, 1, 0, 100) + bin_record(0, 240, 0, 0) + bin_record(2, 2, 1, 50)
                     + bin_record(0, 240, 0, 0) + bin_record(3, 3, 0, 20))
    ev = read_bin(path, (34, 34))
    assert ev["t"].tolist() == [100, 50 + 8192, 20 + 2 * 8192]
    assert ev["x"].tolist() == [1, 2, 3]


def test_bin_malformed_files(tmp_path):
    partial = tmp_path / "partial.bin"
    partial.write_bytes(bin_record(1, 2, 1, 10) + b"\x01\x02")
    with pytest.warns(UserWarning, match="2 trailing bytes"):
        assert len(read_bin(partial, (34, 34))) == 1
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"\x00\x01")
    with pytest.raises(EventFileError, match="no complete 5-byte"):
        read_bin(tiny)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(EventFileError, match="not increasing|outside"):
        read_bin(garbage, (34, 34))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bin_record(40, 2, 1, 10))
    with pytest.raises(EventFileError, match="outside the 34×34 sensor"):
        read_bin(outside, (34, 34))


# AEDAT 2.0 ---------------------------------------------------------------------------------------
def aedat2_bytes(pairs, header=b"#!AER-DAT2.0\r\n# This is a raw AE data file\r\n"):
    return header + b"".join(struct.pack(">II", a, t) for a, t in pairs)


def test_aedat2_header_and_dvs128_addresses(tmp_path):
    path = tmp_path / "r.aedat"
    address = (77 << 8) | (21 << 1) | 1  # y = 77, x = 21, p = 1
    path.write_bytes(aedat2_bytes([(address, 1000), ((5 << 8) | (127 << 1), 2000)]) + b"\x00\x01\x02")
    with pytest.warns(UserWarning, match="3 trailing bytes"):
        ev = read_events(path)  # auto: .aedat with an AER-DAT2 header
    assert ev["x"].tolist() == [21, 127] and ev["y"].tolist() == [77, 5] and ev["p"].tolist() == [1, 0]
    assert ev["t"].tolist() == [1000, 2000]
    path.write_bytes(aedat2_bytes([(address, 1000)]))
    cifar = read_aedat2(path, "cifar10dvs")
    assert (cifar["x"][0], cifar["y"][0], cifar["p"][0]) == (77, 127 - 21, 0)


def test_aedat2_malformed(tmp_path):
    path = tmp_path / "bad.aedat"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(EventFileError, match="AER-DAT2"):
        read_aedat2(path)
    path.write_bytes(b"#!AER-DAT2.0\r\n")
    with pytest.raises(EventFileError, match="no complete 8-byte"):
        read_aedat2(path)


# AEDAT 3.1 ---------------------------------------------------------------------------------------
def packet(kind, events: bytes, size, capacity, overflow=0):
    return struct.pack("<hhiiiiii", kind, 0, size, 4, overflow, capacity, capacity, capacity) + events


def polarity_word(x, y, p):
    return (x << 17) | (y << 2) | (p << 1) | 1


AEDAT3_HEADER = b"#!AER-DAT3.1\r\n#Format: RAW\r\n#!END-HEADER\r\n"


def test_aedat31_packets(tmp_path):
    events = struct.pack("<Ii", polarity_word(100, 20, 1), 500) + struct.pack("<Ii", polarity_word(3, 127, 0), 900)
    frame = packet(2, b"\xff" * 16, 8, 2)  # not polarity: skipped
    late = packet(1, struct.pack("<Ii", polarity_word(7, 8, 1), 10), 8, 1, overflow=1)
    path = tmp_path / "user01_fluorescent.aedat"
    path.write_bytes(AEDAT3_HEADER + packet(1, events, 8, 2) + frame + late)
    ev = read_events(path)
    assert ev["x"].tolist() == [100, 3, 7] and ev["y"].tolist() == [20, 127, 8] and ev["p"].tolist() == [1, 0, 1]
    assert ev["t"].tolist() == [500, 900, (1 << 31) | 10]
    truncated = tmp_path / "t.aedat"
    truncated.write_bytes(AEDAT3_HEADER + packet(1, events[:10], 8, 2))
    with pytest.raises(EventFileError, match="truncated"):
        read_aedat31(truncated)


def test_gesture_folder_becomes_labelled_segments(tmp_path):
    words = b"".join(struct.pack("<Ii", polarity_word(i % 128, 5, i % 2), t) for i, t in
                     enumerate(range(0, 10000, 100)))
    (tmp_path / "user01_led.aedat").write_bytes(AEDAT3_HEADER + packet(1, words, 8, 100))
    (tmp_path / "user01_led_labels.csv").write_text("class,startTime_usec,endTime_usec\n3,0,4000\n5,5000,9000\n")
    assert read_gesture_labels(tmp_path / "user01_led_labels.csv") == [(3, 0, 4000), (5, 5000, 9000)]
    data = load_labelled(tmp_path)
    assert data.classes == ["3", "5"] and data.labels.tolist() == [0, 1]
    assert [len(e) for e in data.events] == [40, 40]  # [start, end) and data.sensor == (128, 128)
    (tmp_path / "user01_led_labels.csv").write_text("class,start\nx,y\n")
    with pytest.raises(EventFileError, match="labels CSV"):
        load_labelled(tmp_path)


# npy / h5 ----------------------------------------------------------------------------------------
def test_npy_structured_and_columns(tmp_path):
    structured = np.zeros(2, [("x", "i2"), ("y", "i2"), ("t", "i8"), ("p", "u1")])
    structured["x"], structured["y"], structured["t"], structured["p"] = [4, 1], [2, 3], [20, 10], [1, 0]
    np.save(tmp_path / "s.npy", structured)
    ev = read_npy(tmp_path / "s.npy")
    assert ev["t"].tolist() == [10, 20] and ev["x"].tolist() == [1, 4]
    np.save(tmp_path / "c.npy", np.array([[10, 1, 2, -1], [5, 3, 4, 1]], float))
    ev = read_npy(tmp_path / "c.npy", "t,x,y,p")
    assert ev["t"].tolist() == [5, 10] and ev["x"].tolist() == [3, 1] and ev["p"].tolist() == [1, 0]
    with pytest.raises(EventFileError, match="N×4"):
        read_npy(tmp_path / "c.npy", "t,x,y")
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(EventFileError, match="not a .npy"):
        read_npy(tmp_path / "bad.npy")


def test_official_h5_windows_are_read_as_t_x_y_p(tmp_path):
    """The official data/label/mark files store (t, x, y, p): with the default `columns=auto` the
    model's t is the file's rising column (before: the file's y)."""
    from icml.data.events import detect_columns
    from icml.methods.event_classify.config import preset
    from icml.methods.event_classify.data import make_clouds

    rng = np.random.default_rng(0)
    windows = np.stack([np.column_stack([np.sort(rng.random(32)), rng.random(32), rng.random(32),
                                         rng.integers(0, 2, 32)]) for _ in range(6)])
    with h5py.File(tmp_path / "official.h5", "w") as f:
        f["data"], f["label"], f["mark"] = windows, [0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 2, 3]
    dataset = load_labelled(tmp_path / "official.h5")
    cfg = preset("smoke")
    assert cfg.columns == "auto"
    clouds = make_clouds(dataset, np.arange(4), cfg, 32, 0, augment=False)
    np.testing.assert_array_equal(clouds.x, windows.astype(np.float32))  # (t, x, y, p) as stored
    assert detect_columns(windows[..., [1, 2, 0, 3]]) == "x,y,t,p"  # t found wherever it is
    assert detect_columns(rng.random((6, 32, 4))) == "t,x,y,p"  # nothing rises: the official order
    cfg.columns = "x,y,t,p"  # an explicit order is obeyed
    assert np.array_equal(make_clouds(dataset, np.arange(4), cfg, 32, 0, augment=False).x[..., 0],
                          windows[..., 2].astype(np.float32))


def test_aedat2_with_a_random_body_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    header = b"#!AER-DAT2.0\r\n# This is a raw AE data file\r\n"
    (tmp_path / "random.aedat").write_bytes(header + rng.integers(0, 256, 8 * 5000, dtype=np.uint8).tobytes())
    with pytest.raises(EventFileError, match="bits above 15"):
        read_aedat2(tmp_path / "random.aedat")
    addresses = rng.integers(0, 1 << 15, 5000)  # plausible addresses, but a shuffled clock
    shuffled = np.column_stack([addresses, rng.permutation(5000) * 10]).astype(">u4").tobytes()
    (tmp_path / "clock.aedat").write_bytes(header + shuffled)
    with pytest.raises(EventFileError, match=r"timestamps decrease at 5\d%"):
        read_aedat2(tmp_path / "clock.aedat")


def test_npz_event_files(tmp_path):
    np.savez(tmp_path / "e.npz", t=[30, 10, 20], x=[1, 2, 3], y=[4, 5, 6], p=[1, 0, 1])
    with pytest.raises(EventFileError, match="timestamps decrease"):  # 1 of 2 steps falls
        read_events(tmp_path / "e.npz")
    np.savez(tmp_path / "f.npz", t=[10, 20, 30], x=[1, 2, 3], y=[4, 5, 6], p=[-1, 1, 1])
    ev = read_events(tmp_path / "f.npz")
    assert ev["t"].tolist() == [10, 20, 30] and ev["x"].tolist() == [1, 2, 3] and ev["p"].tolist() == [0, 1, 1]
    np.savez(tmp_path / "g.npz", t=[10, 20], x=[1, 2], y=[4, 5])
    with pytest.raises(EventFileError, match=r"lacks array\(s\) \['p'\]"):
        read_events(tmp_path / "g.npz")
    np.savez(tmp_path / "h.npz", t=[10, 20], x=[1, 2], y=[4, 5], p=[0, 7])
    with pytest.raises(EventFileError, match="polarity p must be 0/1"):
        read_events(tmp_path / "h.npz")


def test_h5_layouts(tmp_path):
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f["events/xs"], f["events/ys"] = [1, 2], [3, 4]
        f["events/ts"], f["events/ps"] = [0.5, 0.25], [1, 0]  # seconds
    ev = read_h5(tmp_path / "e.h5")
    assert ev["t"].tolist() == [250000, 500000] and ev["x"].tolist() == [2, 1] and ev["p"].tolist() == [0, 1]
    with h5py.File(tmp_path / "w.h5", "w") as f:
        f["data"] = np.random.default_rng(0).random((6, 32, 4))
        f["label"], f["mark"] = [2, 2, 7, 7, 2, 7], [0, 0, 1, 1, 2, 3]
    data, label, mark = read_h5_windows(tmp_path / "w.h5")
    assert data.shape == (6, 32, 4) and mark.tolist() == [0, 0, 1, 1, 2, 3]
    labelled = load_labelled(tmp_path / "w.h5")
    assert labelled.classes == ["2", "7"] and labelled.labels.tolist() == [0, 0, 1, 1, 0, 1]
    with pytest.raises(EventFileError, match="single recording has no labels"):
        load_labelled(tmp_path / "e.h5")
    with pytest.raises(EventFileError, match="no events/"):
        read_h5(tmp_path / "w.h5")
    (tmp_path / "junk.h5").write_bytes(b"junk" * 10)
    with pytest.raises(EventFileError, match="not an HDF5"):
        read_h5(tmp_path / "junk.h5")


def test_folder_of_class_subfolders_with_train_test(tmp_path):
    for split in ("Train", "Test"):
        for cls in ("0", "1"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(2):
                (folder / f"{i}.bin").write_bytes(b"".join(bin_record(i, int(cls), 1, t) for t in range(10, 60, 10)))
    data = load_labelled(tmp_path)
    assert data.classes == ["0", "1"] and data.sensor == (34, 34)
    assert data.split.tolist() == ["train"] * 4 + ["test"] * 4 and data.labels.tolist() == [0, 0, 1, 1] * 2
    with pytest.raises(EventFileError, match="single event file has no labels"):
        load_labelled(tmp_path / "Train" / "0" / "0.bin")
    (tmp_path / "Train" / "1" / "broken.bin").write_bytes(b"\x01")
    with pytest.raises(EventFileError, match="broken.bin: no complete"):
        load_labelled(tmp_path)


# simulator ---------------------------------------------------------------------------------------
def test_simulator_is_deterministic():
    a, b = simulate_dataset("saccade-shapes", 6, 3), simulate_dataset("saccade-shapes", 6, 3)
    assert all(np.array_equal(x, y) for x, y in zip(a.events, b.events))
    assert a.labels.tolist() == b.labels.tolist()
    c = simulate_dataset("saccade-shapes", 6, 4)
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a.events, c.events))


def one_pixel_step(refractory_us):
    """A bright pixel at (3, 3) jumps to (4, 3) at frame 1 and stays: ΔL = ±(log 1.05 − log 0.05)."""
    image = np.zeros((1, 8, 8))
    image[0, 3, 3] = 255.0
    cfg = SimulatorConfig(threshold_sd=0.0, refractory_us=refractory_us, noise_hz=0.0, duration_us=5000)
    (events,) = simulate_events(image, lambda k: (np.array([0.0 if k == 0 else 1.0]), np.zeros(1)), cfg,
                                np.random.default_rng(0))
    return events


def test_simulator_polarity_and_threshold():
    contrast = np.log(1.05) - np.log(0.05)
    n = int(np.floor(contrast / 0.2))  # events per pixel for the step, threshold 0.2
    ev = one_pixel_step(0)
    on, off = ev[ev["p"] == 1], ev[ev["p"] == 0]
    assert len(on) == len(off) == n == 15
    assert set(zip(on["x"], on["y"])) == {(4, 3)} and set(zip(off["x"], off["y"])) == {(3, 3)}
    assert (ev["t"] < 1000).all()  # spread inside the first frame; L_ref caught up, nothing later
    assert np.allclose(np.sort(on["t"]), ((np.arange(n) + 0.5) * 1000 / n).astype(int))
    refractory = one_pixel_step(500)  # events 500 µs apart at most: 1/15 ms spacing keeps 2 per pixel
    assert len(refractory) == 4 and np.diff(np.sort(refractory[refractory["p"] == 1]["t"]))[0] >= 500


def test_direction_requires_time_motion_matches_label():
    data = simulate_dataset("direction", 24, 1)
    unit = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
    agree = 0
    for events, label in zip(data.events, data.labels):
        early, late = events[events["t"] < 100_000], events[events["t"] > 200_000]
        move = np.array([late["x"].mean() - early["x"].mean(), late["y"].mean() - early["y"].mean()])
        agree += np.dot(move, unit[data.classes[label]]) > 1.0
    assert agree >= 22  # the event centroid follows the labelled direction


# preprocessing -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def events():
    return simulate_dataset("saccade-digits", 1, 0).events[0]


def test_cloud_is_independent_of_event_order_and_normalised(events):
    shuffled = events[np.random.default_rng(1).permutation(len(events))]
    a = event_cloud(events, 512, (34, 34), "01", 5)
    b = event_cloud(shuffled, 512, (34, 34), "01", 5)
    assert np.array_equal(a, b)
    assert a[:, 0].min() == 0 and a[:, 0].max() == 1 and (np.diff(a[:, 0]) >= 0).all()
    assert set(np.unique(a[:, 3])) == {0.0, 1.0} and a[:, 1].max() < 1
    pm1 = event_cloud(events, 512, (34, 34), "pm1", 5)
    assert set(np.unique(pm1[:, 3])) == {-1.0, 1.0}
    few = event_cloud(events[:100], 512, (34, 34), "01", 5)  # with replacement
    assert few.shape == (512, 4) and (np.diff(few[:, 0]) >= 0).all()


def test_augmentations_and_windows(events):
    rng = np.random.default_rng(0)
    rev = time_reverse(events, True, 0.0, rng)
    assert (np.diff(rev["t"]) >= 0).all() and rev["t"].min() == events["t"].min()
    assert np.array_equal(rev["t"][::-1], events["t"].max() + events["t"].min() - events["t"])
    assert np.array_equal(rev["p"], events["p"][::-1])
    flipped = time_reverse(events, True, 1.0, rng)
    assert np.array_equal(flipped["p"], 1 - events["p"][::-1])
    kept = time_reverse(events, False, 0.0, rng)
    assert np.array_equal(kept["x"], events["x"])  # the code's index order
    for seed in range(6):
        crop = random_crop(events, (34, 34), np.random.default_rng(seed))
        assert 16 <= len(crop) <= len(events) and (np.diff(crop["t"]) >= 0).all()


def test_random_crop_is_one_crop_and_the_spatial_one_translates():
    """Every pixel fires at t = 0 and at t = T, plus 4000 events at distinct times in between, so
    the output tells which crop ran: a spatial crop keeps the full duration and shifts a rectangle
    of pixels by one (dx, dy) inside the sensor; a temporal crop keeps every event of an interval
    of time, in place. Never both (the official code applies exactly one)."""
    from icml.data.events import make_events

    W = H = 32
    T = 1_000_000
    rng = np.random.default_rng(0)
    xs, ys = np.meshgrid(np.arange(W), np.arange(H), indexing="ij")
    middle_t = rng.choice(np.arange(1, T), 4000, replace=False)
    middle_x, middle_y = rng.integers(0, W, 4000), rng.integers(0, H, 4000)
    events = make_events(np.concatenate([np.tile(xs.ravel(), 2), middle_x]),
                         np.concatenate([np.tile(ys.ravel(), 2), middle_y]),
                         np.concatenate([np.repeat([0, T], W * H), middle_t]), rng.integers(0, 2, 2 * W * H + 4000))
    source_x, source_y = np.full(T + 1, -1), np.full(T + 1, -1)  # where each middle event came from, by time
    source_x[middle_t], source_y[middle_t] = middle_x, middle_y
    kinds, shifts = [], set()
    for seed in range(60):
        crop = random_crop(events, (W, H), np.random.default_rng(seed))
        assert crop["x"].min() >= 0 and crop["x"].max() < W and crop["y"].min() >= 0 and crop["y"].max() < H
        inner = crop[(crop["t"] > 0) & (crop["t"] < T)]
        from_x, from_y = source_x[inner["t"]], source_y[inner["t"]]
        if crop["t"].min() == 0 and crop["t"].max() == T:  # spatial
            dx, dy = set(inner["x"] - from_x), set(inner["y"] - from_y)
            assert len(dx) == 1 and len(dy) == 1  # one translation for the whole crop
            shifts.add((dx.pop(), dy.pop()))
            box = (middle_x >= from_x.min()) & (middle_x <= from_x.max()) & \
                (middle_y >= from_y.min()) & (middle_y <= from_y.max())
            assert box.sum() == len(inner)  # every source event inside the rectangle, nothing else
            assert 0.7 * W - 1 <= from_x.max() - from_x.min() + 1 < W  # 0.7 … (W−1)/W of a side
            kinds.append("spatial")
        else:  # temporal: in place, every event of one interval
            assert np.array_equal(inner["x"], from_x) and np.array_equal(inner["y"], from_y)
            lo, hi = crop["t"].min(), crop["t"].max()
            assert len(crop) == int(((events["t"] >= lo) & (events["t"] <= hi)).sum())
            assert 0.6 * T - 2 <= hi - lo < T
            kinds.append("temporal")
    assert 15 < kinds.count("spatial") < 45  # each with probability ½
    assert len(shifts) > 10 and any(shift != (0, 0) for shift in shifts)  # the crop is translated


def test_validation_split_partitions_the_training_samples():
    train_idx = np.arange(3, 103, 2)  # 50 training sample ids
    fit, val = split_validation(train_idx, 0.1, seed=4)
    assert len(val) == 5 and len(fit) == 45
    assert np.array_equal(np.sort(np.concatenate([fit, val])), train_idx)
    assert np.array_equal(val, split_validation(train_idx, 0.1, seed=4)[1])
    assert not np.array_equal(val, split_validation(train_idx, 0.1, seed=5)[1])
    fit, val = split_validation(train_idx, 0.0, seed=4)
    assert len(val) == 0 and np.array_equal(fit, train_idx)
    fit, val = split_validation(train_idx[:2], 0.9, seed=4)  # never empties the training set
    assert len(fit) == 1 and len(val) == 1
