"""Functional level: every kernel as a plain function (API.md, ``tigon.ops``).

Import this only after deciding on the interpreter: without a GPU, set ``TRITON_INTERPRET=1``
before the first import, since Triton reads it when the kernels below are defined.
"""

from tigon._interpreter import apply_interpreter_fixes as _apply_interpreter_fixes
from tigon.ops.cross_entropy import cross_entropy
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from tigon.ops.fused_linear_jsd import fused_linear_jsd
from tigon.ops.fused_linear_logprobs import fused_linear_logprobs, fused_linear_token_stats
from tigon.ops.glu import geglu, swiglu
from tigon.ops.jsd import jsd
from tigon.ops.kl_div import kl_div
from tigon.ops.layer_norm import layer_norm
from tigon.ops.moe_glu import moe_glu
from tigon.ops.mrope import mrope
from tigon.ops.norm_joins import post_norm_join, sandwich_norm_join
from tigon.ops.rms_norm import add_rms_norm, rms_norm
from tigon.ops.rope import rope
from tigon.ops.tvd import tvd
from tigon.ops.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

__all__ = [
    "add_rms_norm", "cross_entropy", "fused_linear_cross_entropy", "fused_linear_jsd",
    "fused_linear_logprobs", "fused_linear_token_stats", "geglu", "jsd",
    "kl_div", "layer_norm", "moe_glu", "mrope", "post_norm_join", "rms_norm", "rope", "sandwich_norm_join",
    "swiglu",
    "tvd", "vocab_parallel_cross_entropy",
]

# Under TRITON_INTERPRET=1 only (a no-op otherwise, and applied once): the interpreter's fixes that the
# CLI and the test set-up apply, for a script that turns the interpreter on itself (tigon._interpreter:
# Triton 3.6's loops with runtime bounds under NumPy >= 2.4, bf16 rounded to nearest-even).
_apply_interpreter_fixes()
