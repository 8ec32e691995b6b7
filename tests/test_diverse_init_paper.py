"""The paper preset's path end to end on a tiny randomly initialised Stable Diffusion pipeline, saved with
save_pretrained and reloaded with from_pretrained(local_files_only=True): DivIn latents from the pipeline's
own UNet, text embeddings and DDIM schedule, handed to the unchanged pipeline as `latents=`."""
from __future__ import annotations

from dataclasses import astuple

import pytest
import torch

from conftest import invoke

EPS64 = torch.finfo(torch.float64).eps
PROMPT = "a photo of a goldfish"


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    # a byte-level vocabulary without merges (GPT-2's printable byte map): every character is a token
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars])}
    torch.manual_seed(0)
    pipe = StableDiffusionPipeline(
        tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=24),
        text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=37,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  max_position_embeddings=24, projection_dim=32)),
        unet=UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                  layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                  attention_head_dim=4),
        vae=AutoencoderKL(block_out_channels=(32,), down_block_types=("DownEncoderBlock2D",),
                          up_block_types=("UpDecoderBlock2D",), latent_channels=4, sample_size=8),
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                                set_alpha_to_one=False, steps_offset=1),  # SD1.4's scheduler config
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    path = tmp_path_factory.mktemp("sd") / "tiny-sd"
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pipe(pipe_dir):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True).to(torch.float64)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_divin_latents_feed_the_unchanged_pipeline(pipe):
    from icml.methods.diverse_init import divin, paper

    z = paper.divin_latents(pipe, PROMPT, n=3, seed=0, eta=0.05, tau=0.6, k_steps=1)
    noise = divin.initial_noise([divin.sample_seed(0, i) for i in range(3)], (4, 8, 8)).double()  # as paper.py draws it
    assert z.shape == (3, 4, 8, 8) and z.dtype == torch.float64 and not torch.equal(z, noise)
    assert torch.equal(paper.divin_latents(pipe, PROMPT, n=3, seed=0, eta=0.0), noise)  # η = 0: the base noise
    alone = paper.divin_latents(pipe, PROMPT, n=1, seed=0, eta=0.05, tau=0.6, k_steps=1)
    assert torch.allclose(alone, z[:1], rtol=0, atol=1024 * EPS64)  # per-sample streams; matmul blocking only
    images = pipe(PROMPT, latents=z, num_images_per_prompt=3, guidance_scale=7.5, num_inference_steps=3,
                  output_type="np").images
    assert images.shape == (3, 8, 8, 3) and images.min() >= 0 and images.max() <= 1


def test_prompt_potential_is_tweedie_at_the_pipelines_first_ddim_step(pipe):
    """PromptDenoiser's batched pair equals separate conditional and empty-prompt UNet calls, and U sits at
    DDIM-50's first timestep 981 of the pipeline's own scheduler."""
    from icml.methods.diverse_init import divin, paper

    embeds, neg = pipe.encode_prompt(PROMPT, pipe.device, 2, True)
    den = paper.PromptDenoiser(pipe, {"encoder_hidden_states": embeds}, {"encoder_hidden_states": neg})
    sched = divin.Schedule(pipe.scheduler, "eps", 50)
    assert int(sched.timesteps[0]) == 981
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = sched.timesteps[0]
    with torch.no_grad():
        u = divin.potential(den, sched, z, None)
        a = float(pipe.scheduler.alphas_cumprod.double()[981])
        x0 = [(z - (1 - a) ** 0.5 * pipe.unet(z, t, encoder_hidden_states=e).sample) / a ** 0.5 for e in (embeds, neg)]
    expected = (x0[0] - x0[1]).pow(2).flatten(1).sum(1)
    assert torch.allclose(u, expected, rtol=1024 * EPS64, atol=0)


def test_paper_preset_refuses_in_one_line(tmp_path, pipe_dir):
    code, _, err = astuple(invoke("diverse-init", "train", "--preset", "paper", "--runs-dir", tmp_path))
    lines = [line for line in err.splitlines() if line.startswith("icml: error:")]
    assert code == 2 and len(lines) == 1 and "the paper preset needs --model DIR" in lines[0] and "Traceback" not in err
    code, _, err = astuple(invoke("diverse-init", "train", "--preset", "paper", "--model", pipe_dir,
                                  "--runs-dir", tmp_path))
    lines = [line for line in err.splitlines() if line.startswith("icml: error:")]
    assert code == 1 and len(lines) == 1 and "paper.divin_latents" in err and "Traceback" not in err


def test_paper_preset_refuses_an_unusable_pipeline_before_a_run(tmp_path, pipe_dir):
    """The paper preset's --model is read from its headers before a run exists: another pipeline class, the
    other paper.pipeline, a missing component and cut weights are one line, exit 2, nothing created."""
    import json
    import shutil

    def copy(name, change):
        folder = tmp_path / name
        shutil.copytree(pipe_dir, folder)
        change(folder)
        return folder

    def rename(folder, cls):
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": cls}))

    cases = [(copy("ddpm", lambda d: rename(d, "DDPMPipeline")), [], "is a DDPMPipeline, not the StableDiffusionPipeline"),
             (pipe_dir, ["--set", "paper.pipeline=sd3"], "use --set paper.pipeline=sd1"),
             (copy("no-vae", lambda d: shutil.rmtree(d / "vae")), [], "vae/ is missing"),
             (copy("cut", lambda d: (d / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(
                 (d / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()[:-100])), [],
              "diffusion_pytorch_model.safetensors is corrupt or truncated")]
    for folder, argv, needle in cases:
        code, _, err = astuple(invoke("diverse-init", "train", "--preset", "paper", *argv, "--model", folder,
                                      "--runs-dir", tmp_path / "runs"))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (folder.name, err)
        assert not (tmp_path / "runs").exists(), folder.name
