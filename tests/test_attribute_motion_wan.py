"""The Wan path of `--preset paper` on a tiny randomly initialised WanPipeline built here (WanTransformer3DModel,
AutoencoderKLWan, a UMT5 encoder and a word-level tokenizer, no network) and saved with save_pretrained:
the identities of the latent-space loss and mask, then train → eval → report through the CLI with --model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import invoke

WAN_TINY = ["--preset", "paper", "--set", "clips.frames=9", "--set", "clips.size=16", "--set", "clips.n_pool=30",
            "--set", "clips.n_queries=2", "--set", "clips.n_heldout=4", "--set", "clips.targets=orbit",
            "--set", "attr.dim=32", "--set", "attr.cos_subset=6", "--set", "attr.chunk=8", "--set", "attr.attr_seeds=0,1",
            "--set", "selectors=motive,motive_dense,no_mask,random,flow_magnitude,appearance_match",
            "--set", "arms=motive,full", "--set", "finetune.steps=2", "--set", "finetune.batch_size=2",
            "--set", "eval.n_videos=2", "--set", "unet.sample_steps=2", "--set", "eval.evaluator_clips=40",
            "--set", "eval.evaluator_steps=3", "--set", "attr.flow=analytic"]  # the generator's flow: the estimators are tested elsewhere
SPEC_METRICS = {"p_at_k", "ap", "appearance_outrank_rate", "decoy_rate", "length_spearman", "seed_spearman",
                "proj_cos_err", "dynamic_degree", "motion_smoothness", "subject_consistency", "target_motion_acc",
                "win_rate_vs_base", "fm_loss_heldout", "featurize_s_per_clip", "finetune_s"}


def tiny_wan_pipeline(folder: Path) -> Path:
    """A random WanPipeline small enough for CPU tests: z_dim 4 latents on the Wan VAE's 4×8×8 grid, one
    transformer block, a one-layer UMT5 over a word-level vocabulary of the captions, UniPC with flow sigmas."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from icml.data.videos import SHAPES
    from icml.methods.attribute_motion.wan import MOTION_PHRASES

    words = ["<pad>", "</s>", "<unk>", "a", *SHAPES, *sorted({w for p in MOTION_PHRASES.values() for w in p.split()})]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2, relative_attention_num_buckets=8))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                           latents_std=[1.5, 0.5, 1.0, 2.0])
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)  # the scheduler Wan2.1's Diffusers checkpoints ship
    pipe.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    return tiny_wan_pipeline(tmp_path_factory.mktemp("wan") / "tiny-wan")


@pytest.fixture(scope="module")
def space(wan_dir):
    from icml.methods.attribute_motion import wan

    return wan.load(wan_dir)


def test_mask_on_the_latent_grid_of_a_known_mask():
    """Latent frame 0 is pixel frame 0, latent frame j the mean of pixel frames 4j−3 … 4j, each cell the mean of
    its 8×8 patch; then the clip's maximum is 1 and an all-zero clip stays zero."""
    from icml.methods.attribute_motion.flow import latent_grid_mask

    mask = torch.zeros(2, 9, 16, 16)
    mask[0, 0, :8, :8] = 1.0  # frame 0, top-left cell
    mask[0, 1:3, 8:, 8:] = 0.5  # two of the four frames of latent frame 1, bottom-right cell
    mask[0, 5:9, :4, 8:] = 1.0  # a quarter of the top-right cell in all four frames of latent frame 2
    grid = latent_grid_mask(mask, temporal=4, spatial=8)
    expected = torch.zeros(2, 3, 2, 2)
    expected[0, 0, 0, 0] = 1.0
    expected[0, 1, 1, 1] = 0.25
    expected[0, 2, 0, 1] = 0.5
    assert grid.shape == (2, 3, 2, 2)
    assert torch.equal(grid, expected)  # every value is a dyadic fraction: exact in float32


def test_latent_loss_is_the_flow_matching_loss_by_hand(space):
    """The Wan path's masked loss equals Σ M (v_θ(x_σ, 1000σ, text) − (ε − z))² built by hand: z the VAE mean
    normalised with latents_mean/std, x_σ = (1 − σ)z + σε at σ = t* = 0.75 and timestep 750 (the forward process
    at a given σ; the pipeline's flow shift only changes which σ its sampler visits), the transformer called
    directly on the UMT5 embedding of the caption at the pipeline's 512 tokens."""
    from icml.methods.attribute_motion.model import masked_fm_loss, timesteps_of

    gen = torch.Generator().manual_seed(3)
    videos = torch.rand(2, 9, 16, 16, 3, generator=gen) * 2 - 1
    x0 = space.encode(videos)
    vae = space.pipe.vae
    z = vae.encode(videos.permute(0, 4, 1, 2, 3)).latent_dist.mean
    mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
    z = (z - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    assert x0.shape == (2, 4, 3, 2, 2) and torch.allclose(x0, z, atol=0, rtol=0)
    eps = torch.randn(x0.shape, generator=gen)
    mask = torch.rand(2, 9, 16, 16, generator=gen)
    weights = space.loss_mask(mask)
    labels = torch.tensor([12, 21])
    t = timesteps_of(torch.tensor([0.75, 0.75]))
    loss = masked_fm_loss(space.denoise, x0, eps, t, space.condition(labels), weights)
    assert torch.equal(t, torch.tensor([750.0, 750.0]))
    x_t = 0.25 * x0 + 0.75 * eps
    embeds = torch.cat([space.pipe.encode_prompt(c, do_classifier_free_guidance=False, max_sequence_length=512)[0]
                        for c in ("a square moving in a circle", "")])  # prompt 12 = orbit × square
    v = space.pipe.transformer(hidden_states=x_t, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
    by_hand = (weights * (v - (eps - x0)) ** 2).sum((1, 2, 3, 4))
    scale = float(by_hand.detach().abs().max())
    assert torch.allclose(loss, by_hand, rtol=0, atol=16 * torch.finfo(torch.float32).eps * scale)


def test_generation_is_the_pipelines_own_call_from_shared_noise(space):
    """`WanSpace.generate` is WanPipeline.__call__ on the captions (its own prompt path, negative prompt "") from
    the seed's latent noise: bit-identical to calling the pipeline directly; another transformer changes it."""
    import copy

    from icml.cli.threads import single_thread
    from icml.data.videos import NULL_PROMPT

    videos = space.generate(torch.tensor([12, NULL_PROMPT]), 9, 16, steps=2, cfg_scale=5.0, seed=4)
    noise = torch.randn((2, 4, 3, 2, 2), generator=torch.Generator().manual_seed(4))
    with single_thread():  # as generate runs clips this small: the same float summation order
        direct = space.pipe(prompt=["a square moving in a circle", ""], negative_prompt=["", ""], height=16, width=16,
                            num_frames=9, num_inference_steps=2, guidance_scale=5.0, latents=noise,
                            output_type="pt").frames
    assert videos.shape == (2, 9, 16, 16, 3)
    assert torch.equal(videos, (direct.permute(0, 1, 3, 4, 2) * 2 - 1).clamp(-1, 1))
    other = copy.deepcopy(space.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    changed = space.with_model(other).generate(torch.tensor([12, NULL_PROMPT]), 9, 16, steps=2, cfg_scale=5.0, seed=4)
    assert (changed - videos).abs().max() > 1e-3


def test_paper_preset_without_a_wan_pipeline_is_one_line(tmp_path, wan_dir):
    code_no_model = invoke("attribute-motion", "train", "--preset", "paper", "--runs-dir", tmp_path)
    assert code_no_model.code == 2 and "pass --model DIR" in code_no_model.err and "Traceback" not in code_no_model.err
    unet = tmp_path / "unet-pipeline"
    unet.mkdir()
    (unet / "model_index.json").write_text('{"_class_name": "MotionPipeline", "unet": ["x", "UNet2DModel"]}')
    for folder, needle in ((tmp_path / "empty", "model_index.json is missing"),
                           (unet, "describes a MotionPipeline, not a WanPipeline")):
        folder.mkdir(exist_ok=True)
        result = invoke("attribute-motion", "train", *WAN_TINY, "--model", folder, "--runs-dir", tmp_path)
        assert result.code == 2 and needle in result.err and "Traceback" not in result.err
        assert len(result.err.strip().splitlines()) == 1
    bad_frames = invoke("attribute-motion", "train", *WAN_TINY, "--set", "clips.frames=8", "--model", wan_dir,
                        "--runs-dir", tmp_path)
    assert bad_frames.code == 2 and "use --set clips.frames=9" in bad_frames.err
    paper_size = invoke("attribute-motion", "train", "--preset", "paper", "--model", wan_dir, "--runs-dir", tmp_path)
    assert paper_size.code == 2 and "pass --data DIR" in paper_size.err and "GiB" in paper_size.err


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory, wan_dir) -> Path:
    runs = tmp_path_factory.mktemp("wan-runs")
    result = invoke("attribute-motion", "train", *WAN_TINY, "--model", wan_dir, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    path = Path(result.json()["run_dir"])
    for argv in (("eval", path), ("report", path, "--format", "html", "--out", runs / "r.html")):
        result = invoke("attribute-motion", *argv, "--runs-dir", runs)
        assert result.code == 0, result.err
    return path


def test_wan_pipeline_runs_train_eval_report_with_the_spec_metrics(wan_run):
    frame = pd.read_parquet(wan_run / "metrics.parquet")
    evaluated = frame[frame["phase"] == "eval"]
    assert SPEC_METRICS <= set(evaluated["metric"])
    assert "loss" not in set(frame["metric"])  # the given pipeline is the base: no pretraining
    assert not (wan_run / "checkpoints" / "base").exists()  # read from --model, never copied
    assert set(evaluated.loc[evaluated["metric"] == "finetune_s", "variant"]) == {"motive", "full"}
    assert np.isfinite(evaluated.loc[evaluated["metric"] == "fm_loss_heldout", "value"]).all()
    features = list((wan_run / "checkpoints" / "features" / "motive").glob("*/fastfood.npy"))
    assert features and np.load(features[0]).shape == (30 + 2, 32)
    assert (wan_run.parent.parent / "r.html").exists()
