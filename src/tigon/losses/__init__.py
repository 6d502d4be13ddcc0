"""Reserved for the chunked fused-linear preference and RL losses (DPO, ORPO, CPO, SimPO, KTO, GRPO).

None is built yet, and no open issue asks for them. The distillation losses are in ``tigon.ops``:
``kl_div``, ``jsd`` and ``fused_linear_jsd``.
"""
