"""Distillation losses, re-exported here so that :mod:`tigon.losses` shows every loss.

They live in :mod:`tigon.ops` (one file per op, with their kernels) and are importable from there
as before: ``kl_div`` (KL divergence of log-probabilities), ``jsd`` (generalised Jensen-Shannon),
``fused_linear_jsd`` (JSD of student and teacher heads without full logits), ``tvd`` (total
variation distance). These are the same function objects as ``tigon.ops.<name>``.
"""

from tigon.ops.fused_linear_jsd import fused_linear_jsd
from tigon.ops.jsd import jsd
from tigon.ops.kl_div import kl_div
from tigon.ops.tvd import tvd

__all__ = ["fused_linear_jsd", "jsd", "kl_div", "tvd"]
