"""Tiny random vision-language models, one per VLM row, and an image batch laid out as each processor
lays it out: image placeholder tokens in ``input_ids`` (as many as the vision tower gives features),
``pixel_values`` and the side inputs the model needs (Qwen's ``image_grid_thw``, Gemma-3's and
PaliGemma's ``token_type_ids``, Mllama's aspect ratios and cross-attention mask).

Text side as tiny.py's (2 layers, hidden 32, vocab 160, ``initializer_range=0.2``); vision towers of
2 layers, hidden 32, a few patches of a tiny image. Special token ids sit at the top of the vocabulary.
"""

from __future__ import annotations

import copy
import inspect

import torch
import transformers

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import COMMON, rel

VOCAB = COMMON["vocab_size"]
IMAGE, VISION_START, VISION_END, BOI, EOI = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4, VOCAB - 5
TEXT_TOKENS = VOCAB - 8  # ordinary tokens are drawn below this
SEQ_TEXT = 10  # text tokens after the image
INIT = {"initializer_range": 0.2}
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, **INIT)
TEXT = {k: v for k, v in COMMON.items()}


def _qwen_vision(**extra):
    return dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=2,
                spatial_merge_size=2, in_channels=3, out_hidden_size=32, initializer_range=0.2, **extra)


def _qwen_text(**extra):
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}
    text.pop("head_dim")
    return {**text, **extra}


QWEN_TOKENS = dict(image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                   video_token_id=VOCAB - 6)


def _config(model_type):
    if model_type == "qwen2_vl":
        vision = _qwen_vision()
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=32)
        return transformers.Qwen2VLConfig(text_config=_qwen_text(), vision_config=vision, **QWEN_TOKENS)
    if model_type == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=_qwen_text(), vision_config=_qwen_vision(window_size=16, fullatt_block_indexes=[1]),
            **QWEN_TOKENS)
    if model_type == "qwen3_vl":
        text = _qwen_text(head_dim=8)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = _qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **QWEN_TOKENS)
    if model_type == "gemma3":
        text = {**TEXT, "final_logit_softcapping": 2.0, "sliding_window": 8, "query_pre_attn_scalar": 8}
        return transformers.Gemma3Config(
            text_config=text, vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=IMAGE,
            boi_token_index=BOI, eoi_token_index=EOI, **INIT)
    if model_type == "llava":
        vision = {**SIGLIP, "model_type": "clip_vision_model", "projection_dim": 32}
        return transformers.LlavaConfig(
            text_config={**TEXT, "model_type": "llama"}, vision_config=vision, image_token_index=IMAGE,
            vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=16, **INIT)
    if model_type == "paligemma":
        # PaliGemma-2's text side (Gemma-2): its final-logit softcapping is the VLM forward's quirk
        text = {**TEXT, "model_type": "gemma2", "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8,
                "sliding_window": 8}
        return transformers.PaliGemmaConfig(text_config=text, vision_config={**SIGLIP, "projection_dim": 32},
                                             image_token_index=IMAGE, projection_dim=32, **INIT)
    if model_type == "smolvlm":
        return transformers.SmolVLMConfig(text_config={**TEXT, "model_type": "llama"}, vision_config=SIGLIP,
                                          scale_factor=2, image_token_id=IMAGE, **INIT)
    if model_type == "internvl":
        vision = {**SIGLIP, "norm_type": "rms_norm", "image_size": [16, 16], "patch_size": [4, 4]}
        return transformers.InternVLConfig(text_config={**TEXT, "model_type": "qwen2"}, vision_config=vision,
                                           image_token_id=IMAGE, downsample_ratio=0.5, vision_feature_layer=-1,
                                           image_seq_length=4, **INIT)
    if model_type == "mllama":
        text = {k: v for k, v in TEXT.items() if k != "head_dim"}
        text.update(cross_attention_layers=[1], pad_token_id=0)
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_global_layers=1,
                      attention_heads=4, image_size=16, patch_size=4, max_num_tiles=1, intermediate_layers_indices=[0],
                      vision_output_dim=64, supported_aspect_ratios=[[1, 1]], **INIT)
        return transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=MLLAMA_IMAGE)
    raise KeyError(model_type)


# Mllama's image token is the first id past the text vocabulary (its embedding has 8 rows more).
MLLAMA_IMAGE = VOCAB


def _mllama_images(config, batch_size, gen):
    # one image of one tile per sequence, cross-attended by every text token after the image token
    pixel_values = torch.randn(batch_size, 1, 1, 3, 16, 16, generator=gen)
    extra = {
        "pixel_values": pixel_values,
        "aspect_ratio_ids": torch.ones(batch_size, 1, dtype=torch.long),
        "aspect_ratio_mask": torch.ones(batch_size, 1, 1, dtype=torch.long),
        "cross_attention_mask": lambda ids: torch.ones(ids.shape[0], ids.shape[1], 1, 1, dtype=torch.long),
    }
    return extra, [MLLAMA_IMAGE]


# A SigLIP/CLIP-style tower: a 16 x 16 image in 4 x 4 patches (16 patches).
SIGLIP = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=4, **INIT)


# model_type -> how many grid patches along each side (Qwen: grid 4 x 4 -> 4 image tokens after the merge)
GRID = 4


def _qwen_images(config, batch_size, gen):
    vision = config.vision_config
    patches = GRID * GRID
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixel_values = torch.randn(batch_size * patches, features, generator=gen)
    grid = torch.tensor([[1, GRID, GRID]] * batch_size)
    tokens = patches // vision.spatial_merge_size ** 2
    prefix = [VISION_START] + [IMAGE] * tokens + [VISION_END]
    return {"pixel_values": pixel_values, "image_grid_thw": grid}, prefix


def _square_images(tokens, *, boi=False, token_types=False, images_dim=False):
    def images(config, batch_size, gen):
        pixel_values = torch.randn(batch_size, 3, 16, 16, generator=gen)
        if images_dim:  # SmolVLM: [B, images, C, H, W]
            pixel_values = pixel_values[:, None]
        prefix = [BOI] + [IMAGE] * tokens + [EOI] if boi else [IMAGE] * tokens
        extra = {"pixel_values": pixel_values}
        if token_types:  # Gemma-3: 1 on image tokens; PaliGemma: 0 on the prefix (image), 1 on the suffix
            image = token_types == "image"
            extra["token_type_ids"] = lambda ids: (ids == IMAGE).long() if image else (ids != IMAGE).long()
        return extra, prefix

    return images


IMAGES = {
    "qwen2_vl": _qwen_images, "qwen2_5_vl": _qwen_images, "qwen3_vl": _qwen_images,
    "gemma3": _square_images(4, boi=True, token_types="image"),
    "llava": _square_images(16),
    "paligemma": _square_images(16, token_types="suffix"),
    "smolvlm": _square_images(4, images_dim=True),
    "internvl": _square_images(4),
    "mllama": _mllama_images,
}
CONFIGS = dict.fromkeys(IMAGES)


def tiny_vlm_config(model_type, attention="eager"):
    config = _config(model_type)
    config._attn_implementation = attention
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attention
    return config


def tiny_vlm(model_type, attention="eager"):
    """A tiny random VLM (ForConditionalGeneration) in train mode, every part with ``attention``."""
    config = tiny_vlm_config(model_type, attention)
    cls = transformers.AutoModelForImageTextToText._model_mapping[type(config)]
    return cls(config).train()


def _forward_parameters(model_type):
    cls = transformers.AutoModelForImageTextToText._model_mapping[type(_config(model_type))]
    return inspect.signature(cls.forward).parameters


def vlm_batch(model_type, config, seed=0, *, batch_size=2, ignored=2, device=None):
    """One image per sequence, before SEQ_TEXT text tokens; labels -100 on the image and a few others."""
    gen = torch.Generator().manual_seed(seed)
    inputs, prefix = IMAGES[model_type](config, batch_size, gen)
    text = torch.randint(3, TEXT_TOKENS, (batch_size, SEQ_TEXT), generator=gen)
    ids = torch.cat([torch.tensor([prefix] * batch_size), text], dim=1)
    labels = ids.clone()
    labels[:, : len(prefix)] = -100
    drop = torch.randperm(batch_size * SEQ_TEXT, generator=gen)[:ignored]
    rows, cols = drop // SEQ_TEXT, drop % SEQ_TEXT + len(prefix)
    labels[rows, cols] = -100
    inputs = {k: v(ids) if callable(v) else v for k, v in inputs.items()}
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), **inputs}
    if model_type.startswith("qwen") and "mm_token_type_ids" in _forward_parameters(model_type):
        inputs["mm_token_type_ids"] = (ids == IMAGE).int()  # what the processor returns beside input_ids (5.2x)
    return {k: v.to(device or DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}


def stock_and_patched_vlm(model_type, **switches):
    torch.manual_seed(0)
    stock = tiny_vlm(model_type).to(DEVICE)
    patched = copy.deepcopy(stock)
    handle = tigon.patch(patched, **switches)
    return stock, patched, handle


# Attention is invariant to a key bias (it shifts every score of a query's row by one constant), so its
# gradient is zero up to rounding on both sides: compared against the largest gradient, not its own.
ZERO_GRAD_SUFFIX = "k_proj.bias"


def assert_vlm_grads_close(got: dict, want: dict, tolerance=1e-4):
    assert got.keys() == want.keys(), f"parameters with gradients differ: {got.keys() ^ want.keys()}"
    scale = max(g.double().norm().item() for g in want.values())
    for name, g in want.items():
        if name.endswith(ZERO_GRAD_SUFFIX):
            err = (got[name].double() - g.double()).norm().item() / scale
        else:
            err = rel(got[name], g)
        assert err <= tolerance, f"grad of {name}: relative error {err:.2e} > {tolerance:.0e}"
