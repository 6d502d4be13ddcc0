"""Vision-language rows of the end-to-end benchmark (benchmarks/e2e.py): the model and its batches.

    python benchmarks/e2e.py --models qwen2_5_vl --providers stock tigon liger
    python benchmarks/e2e.py --models qwen2_5_vl --device cpu --tiny --seq 64 --warmup 1 --steps 1   # smoke

Qwen2.5-VL-3B-shaped (published config: text 36 layers, H=2048, 16/2 heads, V=151936, tied embeddings;
vision tower 32 blocks of 1280 with windowed attention, a 2x2 patch merger), random weights, fp32 master
weights under bf16 autocast as the text rows. Every sequence holds one image of 28 x 28 patches of 14
pixels (a 392 x 392 image: 784 patches, 196 image tokens after the merge), laid out as the processor
lays it out (``<|vision_start|>``, the image tokens, ``<|vision_end|>``), then random text to the
sequence length; the labels ignore the image. Tokens/s counts every position of the sequences (image
tokens included); the vision tower's 784 patches per image come on top.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class VlmSpec:
    model_type: str
    label: str
    config: object
    vocab_size: int


# Qwen2.5-VL-3B-Instruct's config.json (rope scaling in its M-RoPE form; the weights are random).
QWEN2_5_VL_3B_TEXT = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
QWEN2_5_VL_3B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu", in_channels=3,
)
QWEN_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                   vision_end_token_id=151653)
TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
TINY_TOKENS = dict(image_token_id=511, video_token_id=510, vision_start_token_id=509, vision_end_token_id=508)
IMAGE_GRID = 28  # patches per side of each image (the merge makes it 14 x 14 = 196 tokens)
TINY_IMAGE_GRID = 4

SPECS = {"qwen2_5_vl"}
# Stock at batch 4 x 2048 does not fit with 3.75B parameters' fp32 weights and AdamW states in 80 GB.
BATCH = {"qwen2_5_vl": 2}


def model_spec(model_type: str, *, tiny: bool = False) -> VlmSpec:
    import transformers

    text, vision, tokens = (TINY_TEXT, TINY_VISION, TINY_TOKENS) if tiny else (
        QWEN2_5_VL_3B_TEXT, QWEN2_5_VL_3B_VISION, QWEN_TOKENS)
    config = transformers.Qwen2_5_VLConfig(text_config=copy.deepcopy(text), vision_config=dict(vision),
                                           tie_word_embeddings=True, **tokens)
    label = "tiny Qwen2.5-VL" if tiny else "Qwen2.5-VL-3B-shaped (1 image of 196 tokens a sequence)"
    return VlmSpec(model_type, label, config, text["vocab_size"])


def build_model(config, *, device, attention: str = "sdpa"):
    import torch
    import transformers

    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=attention)
    return model.train()


def batches(spec: VlmSpec, count: int, batch: int, seq: int, *, device, generator, tiny: bool = False) -> list[dict]:
    """``count`` batches of ``batch`` sequences of ``seq`` tokens, one image each (see the docstring)."""
    import torch
    import transformers

    config = spec.config
    grid = TINY_IMAGE_GRID if tiny else IMAGE_GRID
    vision = config.vision_config
    image_tokens = grid * grid // vision.spatial_merge_size ** 2
    if seq < image_tokens + 3:
        raise ValueError(f"--seq {seq} is shorter than an image ({image_tokens + 2} tokens) and one text token")
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    prefix = torch.tensor([config.vision_start_token_id] + [config.image_token_id] * image_tokens
                          + [config.vision_end_token_id], device=device)
    takes_types = "mm_token_type_ids" in inspect.signature(
        transformers.Qwen2_5_VLForConditionalGeneration.forward).parameters
    low = min(config.vision_end_token_id, config.vision_start_token_id, config.image_token_id, config.video_token_id)
    out = []
    for _ in range(count):
        text = torch.randint(low, (batch, seq - len(prefix)), device=device, generator=generator)
        ids = torch.cat([prefix.expand(batch, -1), text], dim=1)
        labels = ids.clone()
        labels[:, : len(prefix)] = -100
        inputs = {
            "input_ids": ids, "labels": labels,
            "pixel_values": torch.randn(batch * grid * grid, features, device=device, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * batch, device=device),
        }
        if takes_types:
            inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
        out.append(inputs)
    return out
