"""cli/checkpoints.py: what `--model` names, read from headers only, and every bad checkpoint refused in one
line that names the fix (the methods' check_inputs call it before a run directory exists)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from icml.cli import checkpoints
from icml.cli.errors import UsageError


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32)).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def refusal(given, **kwargs) -> str:
    with pytest.raises(UsageError) as caught:
        checkpoints.check(str(given), **{"families": ("llama",), "method": "m", "tokenizer": False, **kwargs})
    line = caught.value.line()
    assert "\n" not in line and caught.value.fix
    return line


def test_a_directory_is_its_config_s_family(llama_dir):
    ckpt = checkpoints.check(str(llama_dir), ("llama",), "m", tokenizer=False)
    assert (ckpt.model_type, ckpt.gguf_file, ckpt.kwargs()) == ("llama", None, {"local_files_only": True})


def test_bad_directories_are_one_line_each(llama_dir, tmp_path):
    assert "does not exist" in refusal(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in refusal(tmp_path / "empty")
    assert "is a llama checkpoint; m supports qwen2" in refusal(llama_dir, families=("qwen2",))
    assert "has no tokenizer" in refusal(llama_dir, tokenizer=True)
    (tmp_path / "notes.txt").write_text("hi")
    assert "not a .gguf file" in refusal(tmp_path / "notes.txt")
    weights = llama_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-7])
    assert "truncated (it holds" in refusal(llama_dir)
    weights.write_bytes((10).to_bytes(8, "little") + b"not json!!" + bytes(32))
    assert "not a safetensors header" in refusal(llama_dir)
    weights.unlink()
    assert "has no weights" in refusal(llama_dir)
    (llama_dir / "config.json").write_text(json.dumps({"hidden_size": 16}))
    assert "no model_type" in refusal(llama_dir)
    (llama_dir / "config.json").write_text("{not json")
    assert "not a JSON object" in refusal(llama_dir)


def test_sharded_weights_are_checked_shard_by_shard(llama_dir):
    (llama_dir / "model.safetensors").rename(llama_dir / "model-00001-of-00001.safetensors")
    (llama_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}))
    checkpoints.check(str(llama_dir), ("llama",), "m", tokenizer=False)
    (llama_dir / "model-00001-of-00001.safetensors").unlink()
    assert "the file is missing" in refusal(llama_dir)


def test_gguf_files_by_path_and_short_name_and_a_cut_one(tmp_path):
    named = checkpoints.resolve("smollm2-135m")
    path = named.directory / named.gguf_file
    by_path = checkpoints.check(str(path), ("llama",), "m")  # a GGUF carries its tokenizer
    assert by_path.kwargs() == {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"} and by_path.model_type == "llama"
    with open(path, "rb") as fh:
        head = fh.read(1 << 20)
    (tmp_path / "cut.gguf").write_bytes(head)
    assert "corrupt or truncated GGUF" in refusal(tmp_path / "cut.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + head[4:4096])
    assert "bad magic" in refusal(tmp_path / "fake.gguf")


def test_importing_it_imports_neither_torch_nor_transformers():
    code = ("import sys; import icml.cli.checkpoints; "
            "print(any(m in sys.modules for m in ('torch', 'transformers', 'numpy')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
