"""The parts of a model family that tigon replaces, one module each: what the part's switch plans on a model
instance (every check first, then the changes, patch_handle.py) and the lines ``Patch.replaced`` reports for it.

- norms.py: RMSNorm / LayerNorm modules, and the decoder layers' residual joins beside them (``rms_norm``,
  ``layer_norm``);
- mlp.py: gated MLPs (``mlp``); experts.py: MoE experts (``mlp``);
- attention.py: the attention's rotary, shared-cast projections, the fused attention node (``rope``,
  ``fused_attention``);
- loss_head.py: the CausalLM loss (``fused_linear_cross_entropy``, ``cross_entropy``);
- vision.py: a vision-language model's vision side (``vision_attention`` and the switches above);
- graphs.py (``cuda_graphs``), sliding_window.py (``sliding_window``), recompute.py (``recompute_norms``).

The engine (engine.py) holds the table of parts (``PARTS``) and walks it; a part never calls the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One part of a family that a switch turns on: where the family has it, how to plan it on a model
    instance, and the lines a class patch reports for it. Instance and class patching both read the table."""

    switch: str | None  # None: the loss, which two switches choose between
    present: object  # (family, classes) -> bool
    plan: object  # (plan, model, family, classes, switches) -> None
    lines: object  # (family, classes, switches) -> list[str]

    def on(self, family, classes, switches) -> bool:
        return (self.switch is None or switches[self.switch]) and self.present(family, classes)
