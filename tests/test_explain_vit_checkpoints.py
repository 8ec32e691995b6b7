"""explain-vit's `--model`: the family it accepts (model_type vit — ViT, and DeiT in ViT format) loads through
`model.load` to the logits transformers' own ViTForImageClassification and ViTImageProcessor give; every
checkpoint it cannot load faithfully is refused from its headers, in one line, before anything is created."""
from __future__ import annotations

import numpy as np
import pytest
import torch

SIZE, PATCH = 8, 4


def tiny_vit_config(**overrides):
    from transformers import ViTConfig

    settings = dict(image_size=SIZE, patch_size=PATCH, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, num_labels=3, id2label={0: "cat", 1: "dog", 2: "owl"},
                    label2id={"cat": 0, "dog": 1, "owl": 2})
    return ViTConfig(**(settings | overrides))


def save_classifier(path, processor: bool):
    from transformers import ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    ViTForImageClassification(tiny_vit_config()).save_pretrained(path)
    if processor:  # not ViT's 0.5 / 0.5, so a loader that ignored the file would be caught
        ViTImageProcessor(size={"height": SIZE, "width": SIZE}, image_mean=[0.4, 0.5, 0.6],
                          image_std=[0.2, 0.3, 0.25]).save_pretrained(path)
    return path


@pytest.mark.parametrize("processor", [True, False], ids=["with_processor", "processor_fallback"])
def test_a_vit_classifier_gives_transformers_logits(tmp_path, processor):
    """At the neutral setting (the checkpoint's own input size, no patching) the loaded classifier's logits on
    [0, 1] pixels are ViTForImageClassification.from_pretrained's on what ViTImageProcessor makes of the same
    8-bit image — the checkpoint's processor, or ViTImageProcessor's defaults when it has none."""
    from transformers import ViTForImageClassification, ViTImageProcessor

    from icml.methods.explain_vit.config import check_model
    from icml.methods.explain_vit.model import load

    path = save_classifier(tmp_path / "vit", processor)
    check_model(str(path))  # accepted: no exception
    classifier = load(path)
    images = np.random.default_rng(0).integers(0, 256, (4, SIZE, SIZE, 3), dtype=np.uint8)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        ours = classifier.logits(classifier.normalise(pixels))
        reference_processor = (ViTImageProcessor.from_pretrained(path) if processor
                               else ViTImageProcessor(size={"height": SIZE, "width": SIZE}))
        inputs = reference_processor(list(images), return_tensors="pt").pixel_values
        theirs = ViTForImageClassification.from_pretrained(path, local_files_only=True).eval()(pixel_values=inputs).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert classifier.classes == ["cat", "dog", "owl"] and (classifier.size, classifier.patch) == (SIZE, PATCH)


def unloadable_checkpoints(tmp_path):
    """(folder, words its refusal must name): each would load today with random or wrong parts."""
    from transformers import DeiTConfig, DeiTForImageClassification, ViTForImageClassification, ViTModel

    torch.manual_seed(0)
    DeiTForImageClassification(DeiTConfig(image_size=SIZE, patch_size=PATCH, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, num_labels=3)
                               ).save_pretrained(tmp_path / "deit")
    ViTModel(tiny_vit_config()).save_pretrained(tmp_path / "backbone")
    ViTForImageClassification(tiny_vit_config(num_channels=1)).save_pretrained(tmp_path / "grey")
    save_classifier(tmp_path / "bad_processor", processor=True)
    (tmp_path / "bad_processor" / "preprocessor_config.json").write_text('{"image_mean": [0.5, 0.5')
    return [(tmp_path / "deit", "DeiT format"), (tmp_path / "backbone", "no image-classification head"),
            (tmp_path / "grey", "1-channel"), (tmp_path / "bad_processor", "preprocessor_config.json")]


def test_unloadable_checkpoints_are_refused_before_a_run(icml, tmp_path):
    """model_type deit (weights under deit.*: ViTForImageClassification would start from random ones), a
    ViTModel without a head (a random classifier), grey-scale input and a malformed preprocessor_config.json
    (it used to fall back to 0.5 / 0.5 silently): one line, exit 2, no run directory."""
    for path, needle in unloadable_checkpoints(tmp_path):
        result = icml("explain-vit", "train", "--preset", "smoke", "--model", path)
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert result.code == 2 and len(lines) == 1 and needle in lines[0], (path.name, result.err)
        assert lines[0].startswith("icml: error: ") and " — " in lines[0]
        assert not (tmp_path / "runs").exists(), path.name


def test_the_loader_never_falls_back_from_a_malformed_processor(tmp_path):
    from icml.methods.explain_vit.model import load

    path = save_classifier(tmp_path / "vit", processor=True)
    (path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="preprocessor_config.json cannot be read"):
        load(path)


def test_explain_with_a_bad_model_creates_no_output_folder(icml, tmp_path):
    from PIL import Image
    from transformers import ViTModel

    ViTModel(tiny_vit_config()).save_pretrained(tmp_path / "backbone")
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((SIZE, SIZE, 3), dtype=np.uint8)).save(image)
    result = icml("explain-vit", "explain", "--model", tmp_path / "backbone", "--image", image,
                  "--out", tmp_path / "maps")
    assert result.code == 2 and "no image-classification head" in result.err, result.err
    assert not (tmp_path / "maps").exists()
