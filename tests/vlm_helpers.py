"""Tiny vision-language model folders (Qwen2-VL, LLaVA) with their tokenizer and image processor, for the
tower tests: built with transformers' config classes and save_pretrained, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<image>"]
VOCAB = [f"w{i}" for i in range(90)] + SPECIALS  # the specials are ids 90..97
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def vlm_config(kind: str):
    import transformers as tf

    if kind == "qwen2_vl":
        rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        return tf.Qwen2VLConfig(text_config=dict(model_type="qwen2_vl_text", **_TEXT, rope_parameters=rope,
                                                 bos_token_id=None, eos_token_id=90),
                                vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=14,
                                                   spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
                                image_token_id=95, video_token_id=96, vision_start_token_id=93,
                                vision_end_token_id=94)
    if kind == "qwen2_5_vl":  # windowed vision attention in block 0, full in block 1
        rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        return tf.Qwen2_5_VLConfig(text_config=dict(model_type="qwen2_5_vl_text", **_TEXT, rope_parameters=rope,
                                                    bos_token_id=None, eos_token_id=90),
                                   vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                                      out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
                                   image_token_id=95, video_token_id=96, vision_start_token_id=93,
                                   vision_end_token_id=94)
    if kind == "llava":
        return tf.LlavaConfig(text_config=tf.LlamaConfig(**_TEXT, bos_token_id=None, eos_token_id=90),
                              vision_config=tf.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                                                num_hidden_layers=1, num_attention_heads=2,
                                                                image_size=28, patch_size=14, projection_dim=16),
                              image_token_id=97, image_seq_length=4)
    raise ValueError(kind)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="w0", additional_special_tokens=SPECIALS[1:])


def save_processor(kind: str, folder: Path) -> None:
    """The tokenizer, the image processor and the chat template: a LLaVA processor; for Qwen2(.5)-VL (whose
    processor needs torchvision for its video part) the tokenizer, the image processor and the template."""
    import transformers as tf

    tok = _tokenizer()
    if kind == "llava":
        ip = tf.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1,
                          image_token="<image>", chat_template=TEMPLATE).save_pretrained(folder)
        return
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    tf.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(folder)


def vlm_family(folder: Path, kind: str, n: int = 3) -> list[Path]:
    """``base`` (with its processor files) and ``n - 1`` fine-tuned-like variants (every weight moved)."""
    import transformers as tf
    from checkpoint_helpers import save_variants

    paths = save_variants(folder, vlm_config(kind), ["base"] + [f"e{i}" for i in range(n - 1)],
                          auto=tf.AutoModelForImageTextToText)
    save_processor(kind, paths[0])
    return paths
