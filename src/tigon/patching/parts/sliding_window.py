"""The ``sliding_window`` part (on by default): in a model whose config gives layers a sliding window, sdpa
attends over the band in row blocks (band_attention.py), the plain sliding-window mask is never built (a
``BandMask`` makes each block's rectangle; any other pattern's dense mask is built by row blocks,
causal_mask.py). Both are marks on the model's config, carried by its copies (interface_marks.py)."""

from __future__ import annotations

from tigon.patching import band_attention, causal_mask
from tigon.patching.interface_marks import carried
from tigon.patching.parts import Part

LINE = ("sdpa attention of sliding-window layers -> row blocks of the band, their masks made a block at a time "
        "(band_attention.py)")


def plan_sliding_window(plan, model, family=None, classes=None, switches=None):
    if band_attention.has_sliding_layers(model.config) and not band_attention.marked(model.config):
        mark, *carry = carried(model, band_attention.MarkConfig(model.config))
        plan.add(mark, LINE)
        for change in (*carry, *carried(model, causal_mask.by_rows_mark(model.config))):
            plan.add(change)


# a class patch cannot tell whether its models' configs have sliding layers: each model's own patch (at
# post_init) reports it
SLIDING_WINDOW = Part("sliding_window", lambda f, c: c.attention is not None, plan_sliding_window,
                      lambda f, c, s: [])
