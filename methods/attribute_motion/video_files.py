"""User clips in the formats people have: video files (.mp4, .webm, .mkv, .avi, .mov, decoded with PyAV)
next to the array and PNG-folder formats of data/videos.py, and a dtype / range check of arrays.

An array clip must be uint8 (T, H, W, 3) in 0..255 (what data/videos.py expects); a float array in [0, 1]
would otherwise be read as 0..255 and land at ≈ −1 everywhere, so it is refused with the fix.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from icml.data.videos import VideoDataError

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")
ARRAY_SUFFIXES = (".npy", ".npz")


def read_video_file(path: Path, max_frames: int | None = None) -> np.ndarray:
    """Decode a video file → (T, H, W, 3) uint8 RGB, at most `max_frames` frames."""
    try:
        import av
    except ImportError:
        raise VideoDataError(f"clip '{path}' is a video file and PyAV is not installed (pip install av)") from None
    frames = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoDataError(f"clip '{path}' has no video stream")
            for frame in container.decode(video=0):
                frames.append(frame.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except VideoDataError:
        raise
    except Exception as exc:  # PyAV raises its own error types for unreadable or truncated files
        raise VideoDataError(f"clip '{path}' is not a readable video file ({type(exc).__name__})") from None
    if not frames:
        raise VideoDataError(f"clip '{path}' has no decodable frame")
    return np.stack(frames)


def check_array(path: Path) -> None:
    """Refuse an array clip that is not uint8-valued 0..255 in one line that says what is expected."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                array = archive[archive.files[0]] if archive.files else None
        else:
            array = np.load(path, allow_pickle=False, mmap_mode="r")
    except Exception:
        return  # unreadable: data/videos.py names the problem
    if array is None or array.size == 0:
        return
    if array.dtype == np.uint8:
        return
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise VideoDataError(f"clip '{path}' has dtype {array.dtype}; expected uint8 RGB in 0..255")
    low, high = float(np.min(array)), float(np.max(array))
    if np.issubdtype(array.dtype, np.floating) and high <= 1.0:
        raise VideoDataError(f"clip '{path}' is {array.dtype} in [{low:.3g}, {high:.3g}]; expected uint8 RGB in 0..255 "
                             "(multiply [0, 1] frames by 255, or map [−1, 1] frames with (x + 1) · 127.5, then cast to uint8)")
    if low < 0 or high > 255:
        raise VideoDataError(f"clip '{path}' has values in [{low:.3g}, {high:.3g}]; expected uint8 RGB in 0..255")


def read_clip(path: Path, frames: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Any user clip → (frames (T, size, size, 3) in [−1, 1], valid (T,)) through data/videos.py."""
    from icml.data.videos import read_user_clip

    if path.suffix.lower() in VIDEO_SUFFIXES:
        return read_user_clip(decoded_array(path, frames), frames, size)
    if path.suffix in ARRAY_SUFFIXES:
        check_array(path)
    return read_user_clip(path, frames, size)


def decoded_array(path: Path, frames: int, into: Path | None = None) -> Path:
    """Decode a video file once into a uint8 .npy beside a run (or a temporary folder) and return its path,
    so the array loader of data/videos.py reads it like any other clip."""
    import tempfile

    folder = into or Path(tempfile.mkdtemp(prefix="icml-video-"))
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{path.stem}.npy"
    np.save(out, read_video_file(path, max_frames=frames))
    return out


def is_clip(path: Path) -> bool:
    return path.is_dir() or path.suffix in ARRAY_SUFFIXES or path.suffix.lower() in VIDEO_SUFFIXES


def staged_folder(root: Path, frames: int, staging: Path) -> Path:
    """A --data folder as data/videos.py reads it: video files decoded to uint8 .npy under `staging`,
    every other entry linked; arrays checked first. Returns `root` itself when it holds no video file."""
    for path in root.iterdir():
        if path.suffix in ARRAY_SUFFIXES:
            check_array(path)
    videos = [p for p in root.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES]
    if not videos:
        return root
    staging.mkdir(parents=True, exist_ok=True)
    decoded = {p.stem for p in videos}
    for path in videos:
        decoded_array(path, frames, staging)
    for path in root.iterdir():
        if path.stem in decoded and path.suffix.lower() in VIDEO_SUFFIXES:
            continue
        link = staging / path.name
        if not link.exists():
            link.symlink_to(path.resolve(), target_is_directory=path.is_dir())
    return staging
