"""Chunked fused-linear losses (distillation, preference, RL): see the open issues; none shipped yet."""
