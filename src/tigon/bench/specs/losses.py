"""Post-training losses over a Llama-3-8B-sized head: DPO, ORPO, CPO, SimPO, KTO, GRPO.

Preference losses run B = 8 pairs (R = 16 rows) and KTO 16 unpaired rows, GRPO 16 completions, all
of T = 1024 tokens at H = 4096, V = 128256 in bf16, forward and forward + backward. DPO and KTO
carry a reference model (its hidden states and head, run without gradient); GRPO carries old and
reference per-token log-probs (β = 0.04). Every loss is matmul-bound: the policy's head costs
2·N·V·H flops forward and 4·N·V·H more backward (recompute, dX, dW) for N = R·T tokens, the
reference head 2·N·V·H. The bytes are what must move at least: hidden states and heads read, their
gradients written.

Providers: ``tigon`` (the fused head, logits never held whole), ``eager`` (tigon.losses.reference:
plain PyTorch with the [N, V] logits materialised, bf16 matmul then fp32 softmax; the harness adds
its torch.compile), and Liger-Kernel's chunked losses (``liger_kernel.chunked_loss``, 0.8.5) with
options set to compute the same loss. Liger is imported, built and called only inside the timed
provider, so a missing install or a changed signature shows as that provider's error, never stops
the run; options or arguments the installed Liger does not take are left out of its call.
"""

from __future__ import annotations

import inspect

import torch

from tigon.bench.models import MODELS_BY_NAME
from tigon.bench.spec import Case, Spec
from tigon.losses import cpo_loss, dpo_loss, grpo_loss, kto_loss, orpo_loss, reference, simpo_loss

LLAMA = MODELS_BY_NAME["Llama-3-8B"]
PAIRS, TOKENS, GRPO_ROWS = 8, 1024, 16
PROMPT = 256  # leading target positions ignored (the prompt)
IGNORE_INDEX = -100
MODES = ("fwd", "full")

# One option set per loss, passed to all three providers.
OPTIONS = {
    "dpo": {"beta": 0.1, "loss_type": "sigmoid"},
    "orpo": {"beta": 0.1},
    "cpo": {"beta": 0.1, "alpha": 1.0},
    "simpo": {"beta": 2.0, "gamma": 0.5},
    "kto": {"beta": 0.1},
    "grpo": {"beta": 0.04, "epsilon_low": 0.2, "epsilon_high": 0.2, "loss_type": "grpo"},
}
REFERENCE_MODEL = {"dpo", "kto"}


def _inputs(name, rows, tokens, hidden, vocab):
    def make(device, dtype):
        def randn(*shape, requires_grad=False, scale=1.0):
            t = torch.randn(*shape, device=device, dtype=torch.float32) * scale
            return t.to(dtype).requires_grad_(requires_grad)

        target = torch.randint(0, vocab, (rows, tokens), device=device)
        target[:, : min(PROMPT, tokens // 4)] = IGNORE_INDEX
        inputs = {
            "input": randn(rows, tokens, hidden, requires_grad=True),
            "linear_weight": randn(vocab, hidden, requires_grad=True, scale=hidden**-0.5),
            "target": target,
        }
        if name in REFERENCE_MODEL:
            inputs["ref_input"] = randn(rows, tokens, hidden)
            inputs["ref_linear_weight"] = randn(vocab, hidden, scale=hidden**-0.5)
        if name == "kto":
            inputs["preference_labels"] = torch.arange(rows, device=device) % 2 == 0
        if name == "grpo":
            inputs["advantages"] = torch.randn(rows, device=device)
            inputs["old_logps"] = -torch.rand(rows, tokens, device=device) * 5
            inputs["ref_logps"] = inputs["old_logps"] + 0.1 * torch.randn(rows, tokens, device=device)
        return inputs

    return make


def _case(name, rows, tokens, hidden, vocab, elem):
    n = rows * tokens
    activations, head = n * hidden * elem, vocab * hidden * elem
    reference_reads = activations + head if name in REFERENCE_MODEL else 0
    fwd = activations + head + reference_reads
    bwd = activations + head + activations + head  # read both again, write their gradients
    matmul = 2 * n * vocab * hidden
    reference_flops = matmul if name in REFERENCE_MODEL else 0
    return Case(
        f"R={rows} T={tokens} H={hidden} V={vocab}",
        {"R": rows, "T": tokens, "H": hidden, "V": vocab},
        _inputs(name, rows, tokens, hidden, vocab),
        {"fwd": fwd, "bwd": bwd, "full": fwd + bwd},
        flops={"fwd": matmul + reference_flops, "bwd": 3 * matmul, "full": 4 * matmul + reference_flops},
    )


# ------------------------------------------------------------------------------------------ Liger


def _accepted(callable_, keywords: dict) -> dict:
    """The keywords ``callable_`` takes (Liger's signatures moved between releases)."""
    parameters = inspect.signature(callable_).parameters
    return {k: v for k, v in keywords.items() if k in parameters}


def _liger_call(name, module, inputs):
    """Liger's forward for our inputs (its names: ``_input``, ``lin_weight``, ``ref_weight``, …)."""
    renamed = {
        "_input": inputs["input"], "lin_weight": inputs["linear_weight"], "target": inputs["target"],
        "bias": None, "ref_input": inputs.get("ref_input"), "ref_weight": inputs.get("ref_linear_weight"),
        "ref_bias": None,
    }
    if name == "kto":
        renamed["preference_labels"] = inputs["preference_labels"]
    if name == "grpo":
        target = inputs["target"]
        del renamed["target"]
        renamed |= {
            "selected_token_ids": target.clamp(min=0),
            "attention_mask": (target != IGNORE_INDEX).to(torch.int64),
            "advantages": inputs["advantages"],
            "old_per_token_logps": inputs["old_logps"],
            "ref_per_token_logps": inputs["ref_logps"],
            "ref_input": None, "ref_weight": None,
        }
    out = module(**_accepted(module.forward, renamed))
    return out[0] if isinstance(out, tuple) else out


LIGER_CLASSES = {
    "dpo": "LigerFusedLinearDPOLoss", "orpo": "LigerFusedLinearORPOLoss", "cpo": "LigerFusedLinearCPOLoss",
    "simpo": "LigerFusedLinearSimPOLoss", "kto": "LigerFusedLinearKTOLoss", "grpo": "LigerFusedLinearGRPOLoss",
}


def _liger_options(name) -> dict:
    """Liger's constructor keywords computing what OPTIONS computes here."""
    common = {"ignore_index": IGNORE_INDEX, "compiled": True}
    options = dict(OPTIONS[name])
    if name == "dpo":
        # ℓ summed, no NLL term, a reference model
        return common | {"beta": options["beta"], "loss_type": "sigmoid", "compute_nll_loss": False,
                         "use_ref_model": True, "average_log_prob": False}
    if name == "orpo":
        return common | {"beta": options["beta"], "compute_nll_loss": True}
    if name == "cpo":
        return common | {"beta": options["beta"], "alpha": options["alpha"], "label_smoothing": 0.0,
                         "compute_nll_loss": True, "loss_type": "sigmoid", "average_log_prob": False}
    if name == "simpo":
        return common | {"beta": options["beta"], "gamma": options["gamma"], "label_smoothing": 0.0,
                         "compute_nll_loss": False, "alpha": 0.0}
    if name == "kto":
        return common | {"beta": options["beta"], "use_ref_model": True, "average_log_prob": False}
    return {"compiled": True, "beta": options["beta"], "epsilon_low": options["epsilon_low"],
            "epsilon_high": options["epsilon_high"], "loss_type": options["loss_type"], "use_ref_model": True,
            "temperature": 1.0}


def _liger(name):
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError:
        return None
    built = {}

    def call(**inputs):
        if "module" not in built:  # built on the first (untimed) call, inside the harness's error handling
            from liger_kernel import chunked_loss

            cls = getattr(chunked_loss, LIGER_CLASSES[name])
            built["module"] = cls(**_accepted(cls.__init__, _liger_options(name)))
        return _liger_call(name, built["module"], inputs)

    return call


# ------------------------------------------------------------------------------------------ specs

FUNCTIONS = {
    "dpo": (dpo_loss, reference.dpo), "orpo": (orpo_loss, reference.orpo), "cpo": (cpo_loss, reference.cpo),
    "simpo": (simpo_loss, reference.simpo), "kto": (kto_loss, reference.kto), "grpo": (grpo_loss, reference.grpo),
}


def _spec(name):
    function, plain = FUNCTIONS[name]
    options = OPTIONS[name]
    rows = GRPO_ROWS if name == "grpo" else 2 * PAIRS
    return Spec(
        name=f"{name}_loss",
        cases=lambda: [_case(name, rows, TOKENS, LLAMA.hidden, LLAMA.vocab, 2)],
        providers={
            "eager": lambda **inputs: plain(**inputs, **options)["loss"],
            "tigon": lambda **inputs: function(**inputs, **options).loss,
        },
        peers={"liger": lambda: _liger(name)},
        modes=MODES,
        check_case=lambda: _case(name, 4, 16, 64, 500, 4),
    )


SPECS = tuple(_spec(name) for name in FUNCTIONS)
