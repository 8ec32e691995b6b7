"""The corpus: the Python standard library's own source files as bytes (V = 256), split by file,
or a user's UTF-8 text file (bytes, or the checkpoint's tokenizer with --model).

Training draws seeded random windows of T+1 tokens; validation is the first N non-overlapping
windows of the validation split, identical for every arm.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
SEPARATOR = b"\x00"


@dataclass
class Corpus:
    train: np.ndarray  # token ids (int64)
    val: np.ndarray
    info: dict  # what run.json records (python version, file counts, hashes)
    tokenizer: object | None = None  # the checkpoint's tokenizer (--model); None: byte tokens, 1 byte each


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of every *.py under the stdlib, sorted, without the excluded directories."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]):
            found.append(relative.as_posix())
    return sorted(found)


def is_validation(relpath: str) -> bool:
    return int(hashlib.md5(relpath.encode()).hexdigest(), 16) % 20 == 0


def split_hash(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\x00" + (root / rel).read_bytes() + b"\x00")
    return digest.hexdigest()


def stdlib_corpus(root: Path | None = None) -> tuple[bytes, bytes, dict]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    val_files = [f for f in files if is_validation(f)]
    train_files = [f for f in files if not is_validation(f)]
    join = lambda names: SEPARATOR.join((root / f).read_bytes() for f in names)  # noqa: E731
    info = {"source": "stdlib", "python_version": platform.python_version(), "root": str(root),
            "train_files": len(train_files), "val_files": len(val_files),
            "train_sha256": split_hash(root, train_files), "val_sha256": split_hash(root, val_files)}
    return join(train_files), join(val_files), info


def file_corpus(path: str) -> tuple[str, str, dict]:
    """A user text file: the last 5% (cut at a line boundary) validates."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"data '{path}' is not UTF-8 text (byte {exc.start}): convert it to UTF-8") from None
    cut = text.rfind("\n", 0, int(len(text) * 0.95)) + 1 or int(len(text) * 0.95)
    info = {"source": "file", "path": str(path), "sha256": hashlib.sha256(raw).hexdigest()}
    return text[:cut], text[cut:], info


def load_corpus(data: str | None, tokenizer=None) -> Corpus:
    """Bytes of the stdlib or of `data`; token ids of the checkpoint's tokenizer when one is given."""
    if data is None:
        train, val, info = stdlib_corpus()
        if tokenizer is not None:
            train, val = train.decode("utf-8", "replace"), val.decode("utf-8", "replace")
    else:
        train, val, info = file_corpus(data)
    if tokenizer is None:
        as_bytes = lambda s: s if isinstance(s, bytes) else s.encode("utf-8")  # noqa: E731
        ids = [np.frombuffer(as_bytes(s), dtype=np.uint8).astype(np.int64) for s in (train, val)]
    else:
        ids = [np.asarray(tokenizer(s, add_special_tokens=False)["input_ids"], dtype=np.int64) for s in (train, val)]
    info.update(train_tokens=int(ids[0].size), val_tokens=int(ids[1].size))
    return Corpus(ids[0], ids[1], info, tokenizer)


def target_bytes(windows: np.ndarray, tokenizer=None) -> int:
    """UTF-8 bytes of the text that the targets (tokens 1…T) of consecutive `val_windows` spell.

    Byte tokens: one byte each. With a tokenizer: the decoded text of the whole token sequence (the
    windows share their boundary tokens) minus that of its first, context-only token. Decoding each
    token alone would drop SentencePiece's leading space ('▁x' decodes to 'x' at a sequence start) and
    count each piece of a multi-byte character split across byte-fallback tokens as a 3-byte U+FFFD."""
    windows = np.asarray(windows)
    if tokenizer is None:
        return int(windows[:, 1:].size)
    if (windows[1:, 0] != windows[:-1, -1]).any():
        raise ValueError("target_bytes needs consecutive windows (val_windows), each starting at the last token "
                         "of the previous one")
    sequence = np.concatenate([windows[0], windows[1:, 1:].ravel()]).tolist()
    decoded = lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False).encode("utf-8")  # noqa: E731
    return len(decoded(sequence)) - len(decoded(sequence[:1]))


def check_sizes(corpus: Corpus, seq_len: int, n_val: int) -> None:
    if corpus.train.size < seq_len + 2:
        raise ValueError(f"the training split has {corpus.train.size} tokens, fewer than seq_len+1 = {seq_len + 1}: "
                         "use a larger --data file or a smaller seq_len")
    if corpus.val.size < seq_len + 1:
        raise ValueError(f"the validation split has {corpus.val.size} tokens, fewer than seq_len+1 = {seq_len + 1}: "
                         "use a larger --data file or a smaller seq_len")


def val_windows(tokens: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """The first n non-overlapping windows of T+1 tokens (fewer if the split is short)."""
    n = min(n, (tokens.size - 1) // seq_len)
    return np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def train_windows(tokens: np.ndarray, seq_len: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """A batch of seeded random windows of T+1 tokens."""
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    return np.stack([tokens[s: s + seq_len + 1] for s in starts])
