"""Tiny random vision-language models, one per VLM row, and an image batch laid out as each processor
lays it out: image placeholder tokens in ``input_ids`` (as many as the vision tower gives features),
``pixel_values`` and the side inputs the model needs (Qwen's ``image_grid_thw``, Gemma-3's and
PaliGemma's ``token_type_ids``, Mllama's aspect ratios and cross-attention mask).

Text side as tiny.py's (2 layers, hidden 32, vocab 160, ``initializer_range=0.2``); vision towers of
2 layers, hidden 32, a few patches of a tiny image. Special token ids sit at the top of the vocabulary.
"""

from __future__ import annotations

import copy

import torch
import transformers

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import COMMON

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
        vision.update(embed_dim=32, mlp_ratio=1.5, hidden_size=32)
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
    raise KeyError(model_type)


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


IMAGES = {"qwen2_vl": _qwen_images, "qwen2_5_vl": _qwen_images, "qwen3_vl": _qwen_images}
CONFIGS = dict.fromkeys(IMAGES)


def tiny_vlm_config(model_type):
    config = _config(model_type)
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = "eager"
    return config


def tiny_vlm(model_type):
    """A tiny random VLM (ForConditionalGeneration) in train mode."""
    config = tiny_vlm_config(model_type)
    cls = transformers.AutoModelForImageTextToText._model_mapping[type(config)]
    return cls(config).train()


def vlm_batch(model_type, config, seed=0, *, batch_size=2, ignored=2, device=None):
    """One image per sequence, before SEQ_TEXT text tokens; labels -100 on the image and a few others."""
    gen = torch.Generator().manual_seed(seed)
    inputs, prefix = IMAGES[model_type](config, batch_size, gen)
    text = torch.randint(3, TEXT_TOKENS, (batch_size, SEQ_TEXT), generator=gen)
    ids = torch.cat([torch.tensor([prefix] * batch_size), text], dim=1)
    labels = ids.clone()
    labels[:, : len(prefix)] = -100
    flat = labels[:, len(prefix):].reshape(-1)
    drop = torch.randperm(flat.numel(), generator=gen)[:ignored]
    labels[:, len(prefix):].reshape(-1)  # noqa: B018 - (view check)
    rows, cols = drop // SEQ_TEXT, drop % SEQ_TEXT + len(prefix)
    labels[rows, cols] = -100
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), **inputs}
    return {k: v.to(device or DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}


def stock_and_patched_vlm(model_type, **switches):
    torch.manual_seed(0)
    stock = tiny_vlm(model_type).to(DEVICE)
    patched = copy.deepcopy(stock)
    handle = tigon.patch(patched, **switches)
    return stock, patched, handle
