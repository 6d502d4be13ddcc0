"""Benchmark specs, one module per op; ``SPECS`` maps an op name to its :class:`Spec`."""

from __future__ import annotations

import importlib

# One module per op (an op's variants, such as add_rms_norm, share its module); each defines a tuple
# SPECS. Listed here so that a missing module is an error, not a silence.
SPEC_MODULES = (
    "rms_norm", "layer_norm", "rope", "mrope", "glu", "moe_glu", "mlp", "distill", "cross_entropy", "logprobs",
    "losses",
)


def load_specs(names=None):
    specs = {}
    for module_name in SPEC_MODULES:
        for spec in importlib.import_module(f"tigon.bench.specs.{module_name}").SPECS:
            if names is None or spec.name in names:
                specs[spec.name] = spec
    return specs
