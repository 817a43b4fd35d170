"""Vision-language folders (Qwen2-VL, Qwen2.5-VL, LLaVA): ``clmerge merge`` merges the language tower, keeps the vision
tower and its projector from the base and copies the processor files unchanged; the result loads with
``AutoModelForImageTextToText`` (nothing missing, unexpected or mismatched) and generates from an image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from checkpoint_helpers import folder_state
from typer.testing import CliRunner
from vlm_helpers import vlm_family

from clmerge.cli import app
from clmerge.merging.towers import VISION_PREFIXES

KINDS = ["qwen2_vl", "qwen2_5_vl", "llava"]
PROCESSOR_FILES = ["chat_template.jinja", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
                   "tokenizer_config.json"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {k: vlm_family(root / k, k) for k in KINDS}


def _merge(tmp, paths, name="out", **extra):
    recipe = {"method": "weight_average", "base": str(paths[0]), "models": [{"model": str(p)} for p in paths[1:]],
              **extra}
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["merge", str(tmp / f"{name}.yaml"), "--out", str(tmp / name)])
    return res, tmp / name


def _image():
    return (np.random.default_rng(0).random((56, 56, 3)) * 255).astype("uint8")


def _inputs(kind, out):
    import transformers as tf

    if kind == "llava":
        proc = tf.AutoProcessor.from_pretrained(out)
        return proc(text=["w1 <image> w2"], images=[_image()], return_tensors="pt")
    ip, tok = tf.AutoImageProcessor.from_pretrained(out), tf.AutoTokenizer.from_pretrained(out)
    pix = ip(images=[_image()], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod()) // 4  # merge_size 2: 4 patches per image token
    text = "w1 <|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|> w2"
    return {**tok([text], return_tensors="pt"), **pix}


@pytest.mark.parametrize("kind", KINDS)
def test_language_merged_vision_kept_processor_copied_and_it_loads_and_generates(families, tmp_path, kind):
    import transformers as tf

    paths = families[kind]
    res, out = _merge(tmp_path, paths)
    assert res.exit_code == 0, res.output
    got, base, experts = folder_state(out), folder_state(paths[0]), [folder_state(p) for p in paths[1:]]
    vision = [k for k in base if k.startswith(VISION_PREFIXES)]
    assert vision and len(vision) < len(base)
    for k, v in got.items():
        if k in vision:
            assert torch.equal(v, base[k]), k  # the vision tower and the projector: the base's
        else:
            assert torch.allclose(v, (experts[0][k] + experts[1][k]) / 2, atol=1e-6), k  # merged
    for name in PROCESSOR_FILES:  # unchanged, byte for byte
        assert (out / name).exists() == (paths[0] / name).exists(), name
        if (paths[0] / name).exists():
            assert (out / name).read_bytes() == (paths[0] / name).read_bytes(), name
    model, info = tf.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert type(model).__name__ == type(tf.AutoModelForImageTextToText.from_config(model.config)).__name__
    inputs = _inputs(kind, out)
    with torch.no_grad():
        gen = model.eval().generate(**inputs, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 3


def test_the_dry_run_names_the_kept_tower_and_towers_vision_merge_merges_everything(families, tmp_path):
    paths = families["llava"]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"method": "weight_average", "base": str(paths[0]),
                                                     "models": [{"model": str(p)} for p in paths[1:]]}))
    res = CliRunner().invoke(app, ["merge", str(tmp_path / "r.yaml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "vision kept from the base" in res.output and "vision_tower." in res.output
    res, out = _merge(tmp_path, paths, "all", towers={"vision": "merge"})
    assert res.exit_code == 0, res.output
    got, experts = folder_state(out), [folder_state(p) for p in paths[1:]]
    k = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert torch.allclose(got[k], (experts[0][k] + experts[1][k]) / 2, atol=1e-6)


def test_towers_on_a_text_model_is_refused_in_one_line(tmp_path):
    import transformers as tf
    from checkpoint_helpers import llama_config, save_variants

    paths = save_variants(tmp_path, llama_config(), ["base", "e0"], auto=tf.AutoModelForCausalLM)
    res, out = _merge(tmp_path, paths, towers={"vision": "base"})
    assert res.exit_code == 3, res.output
    assert "towers: the inputs have no vision-tower keys" in res.output and not out.exists()


def test_the_docs_towers_recipe_validates():
    from pathlib import Path

    from clmerge.merging.recipes import recipe_of

    doc = (Path(__file__).resolve().parents[2] / "docs" / "merging_checkpoints.md").read_text()
    section = doc.split("## Vision-language models", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in section.split("```yaml\n")[1:]]
    recipe = recipe_of(yaml.safe_load(block.split("```")[0]))
    assert recipe.towers == {"language": "merge", "vision": "base"} and recipe.method == "ties"
