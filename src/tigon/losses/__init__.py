"""Post-training losses over the LM head, without ever holding the ``[tokens, V]`` logits (API.md).

Every loss in tigon, and where it lives:

=================  ==========================================  =====================================
group              functions                                   module
=================  ==========================================  =====================================
preference         ``dpo_loss``, ``orpo_loss``, ``cpo_loss``,  :mod:`tigon.losses.preference`
                   ``simpo_loss``
unpaired           ``kto_loss``                                :mod:`tigon.losses.kto`
RL                 ``grpo_loss``                               :mod:`tigon.losses.grpo`
class forms        ``DPOLoss``, ``ORPOLoss``, ``CPOLoss``,     :mod:`tigon.losses.modules`
                   ``SimPOLoss``, ``KTOLoss``, ``GRPOLoss``
output             ``LossOutput``                              :mod:`tigon.losses._output`
distillation       ``kl_div``, ``jsd``, ``fused_linear_jsd``,  :mod:`tigon.ops.kl_div`,
                   ``tvd``                                     :mod:`tigon.ops.jsd`,
                                                               :mod:`tigon.ops.fused_linear_jsd`,
                                                               :mod:`tigon.ops.tvd`
                                                               (importable from ``tigon.ops`` too)
supervised         ``cross_entropy``,                          :mod:`tigon.ops.cross_entropy`,
                   ``fused_linear_cross_entropy``              :mod:`tigon.ops.fused_linear_cross_entropy`
                                                               (in ``tigon.ops`` only)
=================  ==========================================  =====================================

The preference, unpaired and RL losses take the policy's last hidden states ``input`` (R, T, H),
the head ``linear_weight`` (V, H) (and ``linear_bias``) and shifted next-token ids ``target``
(R, T), and compute token log-probabilities as :func:`tigon.ops.fused_linear_logprobs` does;
each loss is one formula, a few fp32 torch ops on the (R, T) log-probs. In eager mode with
gradients, :mod:`tigon.losses._single_pass` makes loss and gradients in one pass over row chunks
(one matmul of logits, then dX and dW: three in all, the backward only scales them); under
torch.compile or without gradients the head's two passes run (four matmuls with gradients).
``config=`` (a :class:`~tigon.losses._single_pass.SinglePassConfig`) sets the chunking. They return a
:class:`LossOutput`: ``.loss`` (fp32 scalar with gradient) and detached fp32 metrics.
:mod:`tigon.losses.reference` holds their plain-torch references (logits held whole), which the
tests and the benchmarks import.
"""

from tigon.losses import distillation
from tigon.losses._output import LossOutput
from tigon.losses.distillation import fused_linear_jsd, jsd, kl_div, tvd
from tigon.losses.grpo import grpo_loss
from tigon.losses.kto import kto_loss
from tigon.losses.modules import CPOLoss, DPOLoss, GRPOLoss, KTOLoss, ORPOLoss, SimPOLoss
from tigon.losses.preference import cpo_loss, dpo_loss, orpo_loss, simpo_loss

__all__ = [
    "CPOLoss", "DPOLoss", "GRPOLoss", "KTOLoss", "LossOutput", "ORPOLoss", "SimPOLoss", "cpo_loss",
    "distillation", "dpo_loss", "fused_linear_jsd", "grpo_loss", "jsd", "kl_div", "kto_loss", "orpo_loss",
    "simpo_loss", "tvd",
]
