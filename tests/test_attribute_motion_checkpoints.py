"""`--model` of attribute-motion: every checkpoint kind it accepts loads to the module diffusers' own
`from_pretrained` gives for that directory (the same outputs on the same input), and a checkpoint of the
wrong kind, with the wrong parts or with cut weights is refused in one line, exit 2, before a run exists."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import invoke

FRAMES = 8  # the smoke preset's clips.frames: its UNet stacks 3·8 = 24 channels


def tiny_unet(frames: int = FRAMES):
    from icml.methods.attribute_motion.model import build_unet

    return build_unet(frames, 16, [8, 16, 16], 1, seed=0)


def same_outputs(ours, theirs, frames: int = FRAMES) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 * frames, 16, 16, generator=gen)
    t, labels = torch.tensor([750.0, 10.0]), torch.tensor([3, 21])
    with torch.no_grad():
        return torch.equal(ours(x, t, class_labels=labels).sample, theirs(x, t, class_labels=labels).sample)


def cut(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


@pytest.mark.parametrize("kind", ["pipeline", "bare", "sharded"])
def test_each_accepted_unet_kind_loads_as_diffusers_own_from_pretrained(tmp_path, kind):
    """A pipeline directory (model_index.json, unet/, scheduler/), a bare UNet2DModel directory, and one saved in
    shards (diffusion_pytorch_model.safetensors.index.json): load_unet = UNet2DModel.from_pretrained."""
    from diffusers import UNet2DModel

    from icml.methods.attribute_motion.model import load_unet, save_pipeline

    folder = tmp_path / kind
    if kind == "pipeline":
        save_pipeline(tiny_unet(), folder)
    else:
        tiny_unet().save_pretrained(folder, max_shard_size="20KB" if kind == "sharded" else "10GB")
    if kind == "sharded":
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    theirs = UNet2DModel.from_pretrained(str(folder), subfolder="unet" if kind == "pipeline" else None)
    assert same_outputs(load_unet(folder, FRAMES, 16), theirs)


def test_a_wan_pipeline_loads_as_diffusers_own_from_pretrained(tmp_path):
    from diffusers import WanPipeline
    from test_attribute_motion_wan import tiny_wan_pipeline

    from icml.methods.attribute_motion import wan

    folder = tiny_wan_pipeline(tmp_path / "wan")
    ours, theirs = wan.load(folder), WanPipeline.from_pretrained(str(folder), local_files_only=True)
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 4, 3, 4, 4, generator=gen), torch.randn(1, 5, 16, generator=gen)
    t = torch.tensor([750.0])
    with torch.no_grad():
        assert torch.equal(ours.model(latents, t, text, return_dict=False)[0],
                           theirs.transformer(latents, t, text, return_dict=False)[0])


def _unet_cases(tmp_path: Path):
    """(name, folder, words the one line must hold) of UNet-preset checkpoints the run cannot use."""
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DConditionModel

    from icml.methods.attribute_motion.model import pipeline_class, save_pipeline

    save_pipeline(tiny_unet(), tmp_path / "cut")
    cut(tmp_path / "cut" / "unet" / "diffusion_pytorch_model.safetensors")
    tiny_unet().save_pretrained(tmp_path / "cut-shard", max_shard_size="20KB")
    cut(next((tmp_path / "cut-shard").glob("diffusion_pytorch_model-00001-*.safetensors")))
    save_pipeline(tiny_unet(), tmp_path / "no-weights")
    (tmp_path / "no-weights" / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    tiny_unet(frames=2).save_pretrained(tmp_path / "frames")
    UNet2DConditionModel(sample_size=8, in_channels=24, out_channels=24, block_out_channels=(32, 64),
                         layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                         attention_head_dim=4).save_pretrained(tmp_path / "sd-unet")
    pipeline_class()(unet=tiny_unet(), scheduler=DDPMScheduler()).save_pretrained(tmp_path / "ddpm")
    save_pipeline(tiny_unet(), tmp_path / "shifted", FlowMatchEulerDiscreteScheduler(shift=3.0))
    save_pipeline(tiny_unet(), tmp_path / "no-scheduler")
    shutil.rmtree(tmp_path / "no-scheduler" / "scheduler")
    return [("cut", tmp_path / "cut", "diffusion_pytorch_model.safetensors is corrupt or truncated"),
            ("cut-shard", tmp_path / "cut-shard", "-00001-of-"),
            ("no-weights", tmp_path / "no-weights", "has no weights in unet/"),
            ("frames", tmp_path / "frames", "use --set clips.frames=2"),
            ("sd-unet", tmp_path / "sd-unet", "describes UNet2DConditionModel, not a UNet2DModel"),
            ("ddpm", tmp_path / "ddpm", "needs a UNet2DModel with a FlowMatchEulerDiscreteScheduler"),
            ("shifted", tmp_path / "shifted", "shifts the σ schedule"),
            ("no-scheduler", tmp_path / "no-scheduler", "scheduler/scheduler_config.json is missing")]


def test_an_unusable_unet_checkpoint_is_refused_before_a_run(tmp_path):
    for name, folder, needle in _unet_cases(tmp_path):
        result = invoke("attribute-motion", "train", "--preset", "smoke", "--model", folder,
                        "--runs-dir", tmp_path / "runs")
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert result.code == 2 and len(lines) == 1 and needle in lines[0], (name, result.err)
        assert not (tmp_path / "runs").exists(), name


def test_an_unusable_wan_pipeline_is_refused_before_a_run(tmp_path):
    from test_attribute_motion_wan import WAN_TINY, tiny_wan_pipeline

    good = tiny_wan_pipeline(tmp_path / "wan")
    cases = []
    for name, change, needle in (
            ("cut", lambda d: cut(d / "transformer" / "diffusion_pytorch_model.safetensors"),
             "diffusion_pytorch_model.safetensors is corrupt or truncated"),
            ("cut-text", lambda d: cut(d / "text_encoder" / "model.safetensors"), "model.safetensors is corrupt"),
            ("no-vae-weights", lambda d: (d / "vae" / "diffusion_pytorch_model.safetensors").unlink(),
             "has no weights in vae/"),
            ("vae-class", lambda d: (d / "vae" / "config.json").write_text(json.dumps(
                {**json.loads((d / "vae" / "config.json").read_text()), "_class_name": "AutoencoderKL"})),
             "describes a AutoencoderKL, not the AutoencoderKLWan")):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        cases.append((name, folder, needle))
    for name, folder, needle in cases:
        result = invoke("attribute-motion", "train", *WAN_TINY, "--model", folder, "--runs-dir", tmp_path / "runs")
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert result.code == 2 and len(lines) == 1 and needle in lines[0], (name, result.err)
        assert not (tmp_path / "runs").exists(), name
