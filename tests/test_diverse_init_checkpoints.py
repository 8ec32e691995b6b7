"""`--model` of diverse-init: every checkpoint kind it accepts loads to the module and the noise schedule that
diffusers' own `from_pretrained` gives for that directory, and a checkpoint of the wrong kind, with the wrong
parts or with cut weights is refused in one line, exit 2, before a run exists."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import invoke

SMOKE = ["--preset", "smoke", "--set", "tiers=digits"]


def tiny_unet(in_channels: int = 1, num_class_embeds: int | None = 11):
    """A random class-conditional UNet2DModel on the digits grid (1 × 16², 10 classes + null)."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=16, in_channels=in_channels, out_channels=in_channels, block_out_channels=(8, 16),
                       layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                       num_class_embeds=num_class_embeds)


def cut(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def save(kind: str, folder: Path) -> Path:
    """A checkpoint of each accepted kind: a UNet2DModel directory with a DDIM scheduler config beside it
    (as train saves its models), a DDPMPipeline directory (unet/, scheduler/), and a GmmDenoiser with a
    FlowMatchEuler scheduler config."""
    from diffusers import DDPMPipeline, DDPMScheduler, FlowMatchEulerDiscreteScheduler

    from icml.methods.diverse_init.model import GmmDenoiser, make_scheduler

    if kind == "unet":
        tiny_unet().save_pretrained(folder)
        make_scheduler("eps").save_pretrained(folder)
    elif kind == "pipeline":
        scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2")  # not SD's table: the loader must read it
        DDPMPipeline(unet=tiny_unet(), scheduler=scheduler).save_pretrained(folder)
    elif kind == "gmm":
        torch.manual_seed(0)
        GmmDenoiser(hidden=16).save_pretrained(folder)
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["unet", "pipeline", "gmm"])
def test_each_accepted_kind_loads_as_diffusers_own_from_pretrained(tmp_path, kind):
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler, UNet2DModel

    from icml.methods.diverse_init.model import GmmDenoiser, load_checkpoint

    folder = save(kind, tmp_path / kind)
    model, scheduler, param, null, conditional = load_checkpoint(folder)
    subfolder = "unet" if kind == "pipeline" else None
    theirs = (GmmDenoiser if kind == "gmm" else UNet2DModel).from_pretrained(str(folder), subfolder=subfolder)
    x = torch.randn((3, 2) if kind == "gmm" else (3, 1, 16, 16), generator=torch.Generator().manual_seed(0))
    t, labels = torch.tensor(500.0), torch.tensor([0, 3, null])
    with torch.no_grad():
        ours_out, theirs_out = model(x, t, class_labels=labels), theirs(x, t, class_labels=labels)
    assert torch.equal(getattr(ours_out, "sample", ours_out), getattr(theirs_out, "sample", theirs_out))
    assert conditional and null == (4 if kind == "gmm" else 10)
    if kind == "gmm":  # flow: the sigma table of diffusers' own scheduler
        assert param == "flow"
        reference = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder))
        assert torch.equal(scheduler.sigmas, reference.sigmas)
    else:  # eps: the ᾱ table of diffusers' own scheduler, whatever its class (sampled with DDIM)
        assert param == "eps"
        reference = DDPMScheduler.from_pretrained(str(folder), subfolder="scheduler" if kind == "pipeline" else None)
        assert torch.equal(scheduler.alphas_cumprod, reference.alphas_cumprod)


def _cases(tmp_path: Path):
    """(name, folder, extra argv, words the one line must hold) of checkpoints the run cannot use."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from icml.methods.diverse_init.model import make_scheduler

    cases = []

    def case(name, needle, change=None, kind="unet", argv=()):
        folder = save(kind, tmp_path / name)
        if change is not None:
            change(folder)
        cases.append((name, folder, list(argv), needle))

    case("cut", "diffusion_pytorch_model.safetensors is corrupt or truncated",
         lambda d: cut(d / "unet" / "diffusion_pytorch_model.safetensors"), kind="pipeline")
    case("no-weights", "has no weights", lambda d: (d / "diffusion_pytorch_model.safetensors").unlink())
    case("v-prediction", "predicts v_prediction", lambda d: DDPMScheduler(prediction_type="v_prediction")
         .save_pretrained(d / "scheduler"), kind="pipeline")
    case("lms", "scheduler 'LMSDiscreteScheduler'", lambda d: (d / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "LMSDiscreteScheduler"})))
    case("no-scheduler", "has no scheduler_config.json", lambda d: (d / "scheduler_config.json").unlink())
    case("bad-json", "scheduler_config.json is not valid JSON", lambda d: (d / "scheduler_config.json").write_text("{"))
    case("null", "null_class 11 is outside the model's 11 class embeddings", argv=["--set", "null_class=11"])
    case("gmm", "is a GmmDenoiser; the digits tier replaces its UNet2DModel", kind="gmm")
    # the run's digits tier needs 1 × 16² samples (generate --model takes any size)
    rgb = tmp_path / "rgb"
    tiny_unet(in_channels=3).save_pretrained(rgb)
    make_scheduler("eps").save_pretrained(rgb)
    cases.append(("rgb", rgb, [], "makes 3×16² samples"))
    sd_unet = tmp_path / "sd-unet"
    UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                         down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                         attention_head_dim=4).save_pretrained(sd_unet)
    make_scheduler("eps").save_pretrained(sd_unet)
    cases.append(("sd-unet", sd_unet, [], "goes with --preset paper"))
    return cases


def test_an_unusable_checkpoint_is_refused_before_a_run(tmp_path):
    for name, folder, argv, needle in _cases(tmp_path):
        result = invoke("diverse-init", "train", *SMOKE, *argv, "--model", folder, "--runs-dir", tmp_path / "runs")
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert result.code == 2 and len(lines) == 1 and needle in lines[0], (name, result.err)
        assert not (tmp_path / "runs").exists(), name


def test_generate_reads_the_same_headers(tmp_path):
    """`generate --model` goes through the same check (no run is involved): cut weights are one line."""
    folder = save("unet", tmp_path / "unet")
    cut(folder / "diffusion_pytorch_model.safetensors")
    result = invoke("diverse-init", "generate", "--model", folder, "--out", tmp_path / "g.png")
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code == 2 and len(lines) == 1 and "is corrupt or truncated" in lines[0], result.err
    assert not (tmp_path / "g.png").exists()
