"""attribute-motion data and evaluation: the moving-sprite generator (factors, analytic flow,
padding, decoys), the user-clip loader on small hand-made folders (incl. malformed ones), the flow
estimators and the VBench-style metrics on videos with known answers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icml.data.videos import (NULL_PROMPT, VideoDataError, load_clip_folder, make_clip, prompt_id, random_spec)
import torch.nn.functional as F

from icml.methods.attribute_motion.flow import estimate_flow, gray, horn_schunck, lucas_kanade
from icml.methods.attribute_motion.vbench import (AppearanceNet, dynamic_degree, motion_smoothness, subject_consistency,
                                                  top_flow)


def spec(motion, seed=0, **kw):
    return random_spec(np.random.default_rng(seed), motion, **kw)


def test_generator_is_deterministic_and_in_range():
    a, b = make_clip(spec("orbit", 1)), make_clip(spec("orbit", 1))
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.flow, b.flow)
    assert a.frames.shape == (8, 16, 16, 3) and a.frames.dtype == np.float32
    assert -1 <= a.frames.min() and a.frames.max() <= 1


def test_padding_repeats_the_last_valid_frame_and_zeroes_its_flow():
    clip = make_clip(spec("right", 2, valid_len=4))
    assert clip.valid.tolist() == [True] * 4 + [False] * 4
    assert all(np.array_equal(clip.frames[f], clip.frames[3]) for f in range(4, 8))
    assert np.count_nonzero(clip.flow[3:]) == 0


def test_analytic_flow_is_the_sprite_displacement_on_sprite_pixels():
    s = spec("diagonal", 3, valid_len=8)
    clip = make_clip(s)
    step = s.speed
    moving = np.abs(clip.flow[0]).sum(0) > 0
    assert moving.any()
    assert np.allclose(clip.flow[0, 0][moving], step) and np.allclose(clip.flow[0, 1][moving], step)
    assert np.count_nonzero(make_clip(spec("static", 3)).flow) == 0


def test_camera_pan_moves_the_background_and_keeps_the_sprite():
    s = spec("static", 4, pan=True, valid_len=8, decoy_type="pan")
    clip = make_clip(s)
    background = np.abs(clip.flow[0]).sum(0) > 0
    assert background.mean() > 0.7  # most pixels are background and carry the pan
    assert np.allclose(np.hypot(*clip.flow[0][:, background]), s.pan, atol=1e-5)
    assert s.background != "flat"  # a pan over a flat background would be invisible


def test_appearance_twin_copies_the_look_not_the_motion():
    from icml.data.videos import appearance_of

    query = spec("orbit", 5)
    twin = random_spec(np.random.default_rng(9), "right", appearance=appearance_of(query), decoy_type="twin")
    assert (twin.shape, twin.hue, twin.background, twin.bg_seed) == (query.shape, query.hue, query.background, query.bg_seed)
    assert twin.motion == "right" and twin.prompt_id != query.prompt_id


def test_prompt_ids_cover_motion_times_shape():
    ids = {prompt_id(m, s) for m in ("static", "right", "down", "diagonal", "orbit", "bounce", "jitter")
           for s in ("square", "disk", "cross")}
    assert ids == set(range(21)) and NULL_PROMPT == 21


def write_folder(root, clips=None, captions=None):
    root.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for name in clips or ("a", "b", "c"):
        np.save(root / f"{name}.npy", rng.integers(0, 255, (6, 32, 32, 3), dtype=np.uint8))
    (root / "captions.csv").write_text(captions or "clip_id,prompt_id,split\na,3,pretrain\nb,,pool\nc,12,query\n")
    return root


def test_loader_reads_npy_npz_and_png_folders(tmp_path):
    import matplotlib.image as mpimg

    root = write_folder(tmp_path / "clips")
    np.savez(root / "d.npz", clip=np.full((10, 16, 16, 3), 255, np.uint8))
    frames = root / "e"
    frames.mkdir()
    for f in range(3):
        mpimg.imsave(frames / f"{f:03d}.png", np.full((20, 20, 3), f * 100, np.uint8))
    (root / "captions.csv").write_text("clip_id,prompt_id,split\na,3,pretrain\nb,,pool\nc,12,query\nd,0,pool\ne,1,pool\n")
    splits = load_clip_folder(root, frames=8, size=16)
    assert [c for c, _ in splits["pool"]] == ["b", "d", "e"]
    clip_b = splits["pool"][0][1]
    assert clip_b.frames.shape == (8, 16, 16, 3) and clip_b.valid_len == 6 and clip_b.prompt_id == NULL_PROMPT
    assert clip_b.flow is None
    clip_d = splits["pool"][1][1]
    assert clip_d.valid_len == 8 and np.allclose(clip_d.frames, 1.0)  # cut to 8 frames, 255 → 1
    clip_e = splits["pool"][2][1]
    assert clip_e.valid_len == 3 and clip_e.frames[0].max() == pytest.approx(-1.0)


@pytest.mark.parametrize("captions, clips, message", [
    (None, None, None),
    ("clip_id,split\na,pool\n", None, "needs the header"),
    ("clip_id,prompt_id,split\na,3,train\n", None, "split 'train'"),
    ("clip_id,prompt_id,split\na,x,pool\n", None, "prompt_id 'x' is not an integer"),
    ("clip_id,prompt_id,split\na,40,pool\n", None, "outside 0..21"),
    ("clip_id,prompt_id,split\nzz,1,pool\n", None, "no clip 'zz'"),
    ("clip_id,prompt_id,split\na,1,pool\nb,1,query\n", None, "no clip with split 'pretrain'"),
])
def test_loader_rejects_malformed_folders_in_one_line(tmp_path, captions, clips, message):
    root = write_folder(tmp_path / "clips", captions=captions)
    if message is None:  # the well-formed folder loads; removing captions.csv breaks it
        assert len(load_clip_folder(root)["query"]) == 1
        (root / "captions.csv").unlink()
        message = "captions.csv' is missing"
    with pytest.raises(VideoDataError) as info:
        load_clip_folder(root)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_loader_rejects_corrupt_and_misshapen_arrays(tmp_path):
    root = write_folder(tmp_path / "clips")
    (root / "b.npy").write_bytes(b"not a numpy file")
    with pytest.raises(VideoDataError, match="not a readable numpy array"):
        load_clip_folder(root)
    np.save(root / "b.npy", np.zeros((4, 16, 16), np.uint8))
    with pytest.raises(VideoDataError, match=r"expected \(T, H, W, 3\)"):
        load_clip_folder(root)


def smooth_pattern(shift_x: float, shift_y: float, size: int = 16) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    x, y = xs - shift_x, ys - shift_y
    return 0.5 + 0.2 * torch.sin(2 * np.pi * x / 12) + 0.2 * torch.cos(2 * np.pi * y / 11 + 0.5 * torch.sin(x / 4))


def test_lucas_kanade_recovers_a_subpixel_translation():
    a, b = smooth_pattern(0, 0)[None], smooth_pattern(0.6, -0.4)[None]
    flow = lucas_kanade(a[:, None], b[:, None])
    interior = flow[0, :, 4:-4, 4:-4]
    assert interior[0].mean().item() == pytest.approx(0.6, abs=0.08)
    assert interior[1].mean().item() == pytest.approx(-0.4, abs=0.08)


def test_horn_schunck_recovers_a_subpixel_translation():
    a, b = smooth_pattern(0, 0)[None, None], smooth_pattern(0.6, -0.4)[None, None]
    interior = horn_schunck(a, b)[0, :, 4:-4, 4:-4]
    assert interior[0].mean().item() == pytest.approx(0.6, abs=0.08)
    assert interior[1].mean().item() == pytest.approx(-0.4, abs=0.08)


def test_horn_schunck_on_one_channel_is_the_classical_jacobi_update():
    torch.manual_seed(0)
    a = torch.rand(2, 1, 12, 12, dtype=torch.float64)
    b = torch.roll(a, 1, dims=-1) + 0.01 * torch.rand(2, 1, 12, 12, dtype=torch.float64)
    alpha, iters = 0.3, 25
    # Horn & Schunck (1981): u ← ū − I_x(I_x ū + I_y v̄ + I_t)/(α² + I_x² + I_y²), from zero flow
    pad = lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate")
    m = pad((a + b) / 2)
    ix, iy, it = (m[..., 1:-1, 2:] - m[..., 1:-1, :-2]) / 2, (m[..., 2:, 1:-1] - m[..., :-2, 1:-1]) / 2, b - a
    kernel = torch.tensor([[1, 2, 1], [2, 0, 2], [1, 2, 1]], dtype=a.dtype)[None, None] / 12
    u, v = torch.zeros_like(a), torch.zeros_like(a)
    for _ in range(iters):
        ub, vb = F.conv2d(pad(u), kernel), F.conv2d(pad(v), kernel)
        common = (ix * ub + iy * vb + it) / (alpha ** 2 + ix ** 2 + iy ** 2)
        u, v = ub - ix * common, vb - iy * common
    flow = horn_schunck(a, b, alpha=alpha, sigma=0.0, iters=iters, rounds=1)
    torch.testing.assert_close(flow, torch.cat([u, v], 1), rtol=1e-10, atol=1e-12)


def test_colour_flow_with_equal_channels_is_gray_flow_at_alpha_over_sqrt3():
    """Summing the data term over three equal channels triples J and b, i.e. divides α² by 3."""
    a, b = smooth_pattern(0, 0)[None, None].double(), smooth_pattern(0.7, 0.3)[None, None].double()
    colour = horn_schunck(a.expand(-1, 3, -1, -1), b.expand(-1, 3, -1, -1), alpha=0.5)
    torch.testing.assert_close(colour, horn_schunck(a, b, alpha=0.5 / 3 ** 0.5), rtol=1e-9, atol=1e-12)


def isoluminant_sprite_video(step: int, frames: int = 8) -> torch.Tensor:
    """A 4×4 sprite on a gray background of the same luminance (0.299·1 + 0.587·g + 0.114·0.5 = 0.5)."""
    video = torch.full((1, frames, 16, 16, 3), 0.5)
    sprite = torch.tensor([1.0, (0.5 - 0.299 - 0.057) / 0.587, 0.5])
    for f in range(frames):
        video[0, f, 6:10, 3 + step * f:7 + step * f] = sprite
    return video * 2 - 1


def test_colour_flow_sees_a_sprite_that_luminance_cannot():
    video = isoluminant_sprite_video(1)
    luminance = gray(video)
    assert (luminance - 0.5).abs().max() < 1e-6  # invisible to a luminance-only estimator
    assert torch.count_nonzero(lucas_kanade(luminance[0, :-1, None], luminance[0, 1:, None])) == 0
    for method in ("lk", "hs"):
        assert dynamic_degree(video, method).item() == 1.0
        assert dynamic_degree(isoluminant_sprite_video(0), method).item() == 0.0
    flow = estimate_flow(video, "hs")[0]
    inside = torch.stack([flow[f, :, 6:10, 3 + f:7 + f].mean((1, 2)) for f in range(7)])  # the sprite moves 1 px right
    torch.testing.assert_close(inside, torch.tensor([[1.0, 0.0]]).expand(7, 2), atol=0.15, rtol=0)


def test_horn_schunck_reads_sampling_noise_as_static_where_lucas_kanade_does_not():
    """The calibration behind eval.flow=hs: noise of std 0.1 (on [−1, 1]) on a still textured video
    must not count as motion, while the same noise on a 1 px/frame translation must."""
    gen = torch.Generator().manual_seed(0)
    still = moving_video(0.0).expand(8, -1, -1, -1, -1)
    moving = moving_video(1.0).expand(8, -1, -1, -1, -1)
    noisy_still = still + 0.1 * torch.randn(still.shape, generator=gen)
    noisy_moving = moving + 0.1 * torch.randn(moving.shape, generator=gen)
    assert dynamic_degree(noisy_still, "hs").tolist() == [0.0] * 8
    assert dynamic_degree(noisy_moving, "hs").tolist() == [1.0] * 8
    assert dynamic_degree(noisy_still, "lk").mean() > 0.5


def moving_video(step: float, frames: int = 8) -> torch.Tensor:
    gray = torch.stack([smooth_pattern(step * f, 0) for f in range(frames)])
    return (gray[..., None].expand(-1, -1, -1, 3) * 2 - 1)[None]


def test_dynamic_degree_follows_the_vbench_rule():
    video = torch.zeros(2, 8, 16, 16, 3)
    flow = torch.zeros(2, 7, 2, 16, 16)
    threshold = 6 * 16 / 256
    flow[0, :2, 0] = threshold * 1.5  # two pairs above the threshold: round(4·8/16) = 2 needed → dynamic
    flow[1, :1, 0] = threshold * 1.5  # one pair only → static
    assert dynamic_degree(video, flow=flow).tolist() == [1.0, 0.0]
    magnitudes = torch.zeros(1, 1, 2, 16, 16)
    magnitudes[0, 0, 1].view(-1)[:20] = torch.arange(20.0)  # top 5% of 256 = 13 pixels: 19, 18, …, 7
    assert top_flow(video[:1, :2], flow=magnitudes).item() == pytest.approx(13.0)
    assert dynamic_degree(moving_video(1.0)).item() == 1.0
    assert dynamic_degree(moving_video(0.0)).item() == 0.0


def test_motion_smoothness_is_one_for_static_and_linear_videos():
    assert motion_smoothness(moving_video(0.0)).item() == pytest.approx(1.0, abs=1e-6)
    frames = torch.linspace(-1, 1, 8)[:, None, None, None].expand(8, 16, 16, 3)[None]  # linear in time
    assert motion_smoothness(frames, interp="linear").item() == pytest.approx(1.0, abs=1e-6)
    flickering = frames.clone()
    flickering[:, 1::2] *= -1
    assert motion_smoothness(flickering, interp="linear").item() < 0.9


def test_subject_consistency_is_one_for_a_frozen_video():
    torch.manual_seed(0)
    net = AppearanceNet().eval()
    frozen = moving_video(0.0)
    assert subject_consistency(frozen, net).item() == pytest.approx(1.0, abs=1e-5)
    noisy = torch.rand(1, 8, 16, 16, 3) * 2 - 1
    assert subject_consistency(noisy, net).item() <= 1.0


def test_estimated_flow_pads_the_last_frame_with_zero():
    flow = estimate_flow(moving_video(1.0))
    assert flow.shape == (1, 8, 2, 16, 16) and torch.count_nonzero(flow[:, -1]) == 0


def test_pool_composition_follows_the_spec():
    from icml.methods.attribute_motion.clips import synthetic
    from icml.methods.attribute_motion.config import preset

    cfg = preset("default")
    cfg.clips.n_pretrain, cfg.clips.n_pool, cfg.clips.n_queries, cfg.clips.n_heldout = 100, 100, 4, 4
    sets = synthetic(cfg, seed=0)
    table = sets.table
    pool = table[table["split"] == "pool"]
    assert len(pool) == 100 and (pool["motion"] == "orbit").sum() == 10 and (pool["motion"] == "diagonal").sum() == 10
    assert (pool["decoy_type"] == "twin").sum() == 5 and (pool["decoy_type"] == "pan").sum() == 10
    assert (pool["decoy_type"] == "jitter").sum() >= 10  # 10% jitter decoys plus random jitter clips
    twins = pool[pool["decoy_type"] == "twin"]
    queries = table[table["split"] == "query"]
    looks = set(zip(queries["shape"], queries["hue"], queries["bg_seed"]))
    assert all(look in looks for look in zip(twins["shape"], twins["hue"], twins["bg_seed"]))
    assert not set(twins["motion"]) & {"orbit", "diagonal"}
    assert sorted(queries["query_target"].value_counts().tolist()) == [4, 4]
    assert set(pool["valid_len"]) == {4, 6, 8} and not (pool["clip_id"].isin(queries["clip_id"])).any()
    from dataclasses import fields

    from icml.data.videos import ClipSpec

    assert {f.name for f in fields(ClipSpec)} | {"clip_id", "split", "seed"} <= set(table.columns)  # every factor
    again = synthetic(cfg, seed=0)
    assert np.array_equal(sets.videos, again.videos) and table.equals(again.table)


def write_video(path, frames: np.ndarray, codec: str) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def smooth_frames(n=6, size=32):
    ys, xs = np.mgrid[0:size, 0:size]
    return np.stack([np.stack([(xs * 7 + f * 9) % 256, (ys * 5) % 256, np.full_like(xs, 128)], -1)
                     for f in range(n)]).astype(np.uint8)


@pytest.mark.parametrize("suffix, codec", [(".mp4", "libx264"), (".webm", "libvpx-vp9")])
def test_video_files_decode_to_the_clip_they_encode(tmp_path, suffix, codec):
    from icml.methods.attribute_motion.video_files import read_clip, read_video_file

    frames = smooth_frames()
    path = tmp_path / f"clip{suffix}"
    write_video(path, frames, codec)
    decoded = read_video_file(path)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(float) - frames).mean() < 12  # lossy codec, same picture
    video, valid = read_clip(path, 8, 16)
    assert video.shape == (8, 16, 16, 3) and valid.tolist() == [True] * 6 + [False] * 2
    assert video.min() >= -1 and video.max() <= 1


def test_float_and_out_of_range_arrays_are_refused_in_one_line(tmp_path):
    from icml.data.videos import VideoDataError
    from icml.methods.attribute_motion.video_files import read_clip

    unit = tmp_path / "unit.npy"
    np.save(unit, np.random.default_rng(0).random((6, 16, 16, 3)).astype(np.float32))
    with pytest.raises(VideoDataError, match=r"float32 in \[.*\]; expected uint8 RGB in 0..255 \(multiply"):
        read_clip(unit, 8, 16)
    wide = tmp_path / "wide.npy"
    np.save(wide, np.full((6, 16, 16, 3), 300, np.int32))
    with pytest.raises(VideoDataError, match="values in .300, 300.; expected uint8"):
        read_clip(wide, 8, 16)
    fine = tmp_path / "fine.npy"
    np.save(fine, np.full((6, 16, 16, 3), 255.0, np.float64))  # float but 0..255: accepted
    assert read_clip(fine, 8, 16)[0].max() == pytest.approx(1.0)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    with pytest.raises(VideoDataError, match="is not a readable video file"):
        read_clip(broken, 8, 16)
