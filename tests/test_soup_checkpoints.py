"""soup's `--model`: each family it accepts (vit_mae, vit) loads through `vit.load_stock` to the encoder
features (and, for ViTMAE, decoder outputs) transformers' own classes give on the same pixels; a stock that
cannot cook the asked ingredients is refused from its headers, in one line, before a run exists."""
from __future__ import annotations

import pytest
import torch

SIZE, PATCH = 8, 4
SHAPE = dict(image_size=SIZE, patch_size=PATCH, num_channels=3, hidden_size=32, num_hidden_layers=1,
             num_attention_heads=2, intermediate_size=64)
MAE_DECODER = dict(decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                   decoder_intermediate_size=32)


def pixels(n: int = 4) -> torch.Tensor:
    """[0, 1] images, as soup feeds them (no processor: soup reads none)."""
    return torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def cfg_for(model, ingredients: str):
    from icml.methods.soup.config import preset

    cfg = preset("smoke")
    cfg.model, cfg.ingredients = str(model), ingredients
    return cfg


def test_a_vit_mae_stock_gives_transformers_features_and_reconstructions(tmp_path):
    """The neutral setting: z = CLS with every patch kept equals ViTMAEModel.from_pretrained at mask_ratio 0
    (its own random shuffle: the CLS output does not depend on the token order); with the MAE mask and noise
    fixed, the stock's decoder outputs equal ViTMAEForPreTraining.from_pretrained's (the decoder was loaded)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining, ViTMAEModel

    from icml.methods.soup.config import check_model
    from icml.methods.soup.vit import cls_features, encoder_of, has_decoder, load_stock

    torch.manual_seed(0)
    path = tmp_path / "mae"
    ViTMAEForPreTraining(ViTMAEConfig(**SHAPE, **MAE_DECODER)).save_pretrained(path)
    check_model(cfg_for(path, "mae,mmcr"))  # accepted with mae ingredients: no exception
    stock = load_stock(str(path)).eval()
    assert has_decoder(stock)
    images = pixels()
    with torch.no_grad():
        ours = cls_features(encoder_of(stock), images)
        encoder = ViTMAEModel.from_pretrained(path, local_files_only=True, mask_ratio=0.0).eval()
        torch.testing.assert_close(ours, encoder(pixel_values=images).last_hidden_state[:, 0], atol=1e-5, rtol=1e-5)
        noise = torch.rand(len(images), (SIZE // PATCH) ** 2, generator=torch.Generator().manual_seed(1))
        reference = ViTMAEForPreTraining.from_pretrained(path, local_files_only=True).eval()
        torch.testing.assert_close(stock(pixel_values=images, noise=noise).logits,
                                   reference(pixel_values=images, noise=noise).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["ViTModel", "ViTForImageClassification"])
def test_a_plain_vit_stock_gives_transformers_features(tmp_path, architecture):
    """A model_type vit checkpoint, backbone alone or with a classification head: z equals the CLS output of
    transformers' own forward of that checkpoint."""
    import transformers
    from transformers import ViTConfig

    from icml.methods.soup.config import check_model
    from icml.methods.soup.vit import cls_features, encoder_of, has_decoder, load_stock

    torch.manual_seed(0)
    path = tmp_path / architecture
    model_class = getattr(transformers, architecture)
    model_class(ViTConfig(**SHAPE)).save_pretrained(path)
    check_model(cfg_for(path, "mmcr,lejepa"))  # accepted without mae ingredients
    stock = load_stock(str(path)).eval()
    assert not has_decoder(stock)
    images = pixels()
    with torch.no_grad():
        reference = model_class.from_pretrained(path, local_files_only=True).eval()
        backbone = reference if architecture == "ViTModel" else reference.vit
        theirs = backbone(pixel_values=images).last_hidden_state[:, 0]
        torch.testing.assert_close(cls_features(encoder_of(stock), images), theirs, atol=1e-5, rtol=1e-5)


def test_a_stock_without_mae_decoder_refuses_mae_before_a_run(icml, tmp_path):
    """A ViTMAEModel (encoder alone) would load as ViTMAEForPreTraining with a random decoder and cook mae
    ingredients from it; a plain ViT has no decoder at all: one line, exit 2, no run directory."""
    from transformers import ViTConfig, ViTMAEConfig, ViTMAEModel, ViTModel

    torch.manual_seed(0)
    ViTMAEModel(ViTMAEConfig(**SHAPE, **MAE_DECODER)).save_pretrained(tmp_path / "encoder")
    ViTModel(ViTConfig(**SHAPE)).save_pretrained(tmp_path / "plain")
    for name, needle in (("encoder", "ViTMAEModel (the encoder alone)"), ("plain", "plain ViT")):
        result = icml("soup", "train", "--preset", "smoke", "--set", "ingredients=mae,mmcr",
                      "--model", tmp_path / name)
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert result.code == 2 and len(lines) == 1 and needle in lines[0], (name, result.err)
        assert "no MAE decoder" in lines[0] and "ingredients=mocov3,mmcr,lejepa" in lines[0]
        assert not (tmp_path / "runs").exists(), name
        from icml.methods.soup.config import check_model

        check_model(cfg_for(tmp_path / name, "mmcr"))  # without mae ingredients the encoder is enough
