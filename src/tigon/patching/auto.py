"""``tigon.AutoModelForCausalLM``: transformers' auto class, returning the model already patched."""

from __future__ import annotations

from tigon.patching.engine import SWITCHES, patch


def _split_switches(kwargs):
    switches = {name: kwargs.pop(name) for name in list(kwargs) if name in SWITCHES}
    return switches, kwargs


class AutoModelForCausalLM:
    """``from_pretrained`` / ``from_config`` as in transformers, then ``tigon.patch(model, **switches)``.

    The switch keywords (``rope``, ``rms_norm``, ``layer_norm``, ``mlp``, ``cross_entropy``,
    ``fused_linear_cross_entropy``, ``cuda_graphs``) are taken out of the keyword arguments; the rest go to
    transformers unchanged. The model is built stock and then patched in place (its parameters and
    state-dict keys are unchanged, so loading is transformers' own).
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("use tigon.AutoModelForCausalLM.from_pretrained(...) or .from_config(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        import transformers

        switches, kwargs = _split_switches(kwargs)
        auto = transformers.AutoModelForCausalLM
        model = auto.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        patch(model, **switches)
        return model

    @classmethod
    def from_config(cls, config, *args, **kwargs):
        import transformers

        switches, kwargs = _split_switches(kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, *args, **kwargs)
        patch(model, **switches)
        return model
