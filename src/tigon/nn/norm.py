"""Norm modules: thin wrappers over tigon.ops with transformers' parameter names and init."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from tigon.ops.layer_norm import layer_norm
from tigon.ops.rms_norm import CASTINGS, rms_norm


def _check_size(hidden_size) -> int:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral):
        raise TypeError(f"hidden_size must be an int, got {type(hidden_size).__name__}")
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
    return int(hidden_size)


def _check_real(value, name: str):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _check_input(hidden_states, weight) -> None:
    """The input's last dim against the module's hidden_size, named as the caller knows them (the
    op's own check can only say that the weight does not fit the input)."""
    if (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() > 0 and weight.dim() == 1
            and hidden_states.shape[-1] != weight.shape[0]):
        raise ValueError(
            f"hidden_states has last dim {hidden_states.shape[-1]} (shape {tuple(hidden_states.shape)}), "
            f"which does not match hidden_size {weight.shape[0]}"
        )


class RMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm`` (casting="llama") and ``GemmaRMSNorm`` (casting="gemma", offset=1).

    ``weight`` starts at ones, or at zeros when ``offset=1.0`` (Gemma stores ``w`` and scales by
    ``1 + w``), so a fresh module is the identity scale either way and checkpoints load unchanged.

    ``autocast_output`` (default False; ``tigon.patch`` sets it on the norms of a decoder layer whose
    output goes only into linear projections): under ``torch.autocast`` the output comes in the
    autocast dtype, the copy those projections would make of it anyway. Stock, the norm writes fp32
    (its input is the fp32 residual stream) and every projection reads that and casts it; in the
    backward each projection's bf16 input gradient is cast to fp32 and they are summed in fp32. Here
    the norm writes the bf16 copy itself and takes its gradient in bf16, summed in bf16 as autograd
    sums any bf16 activation's: the same forward values bitwise, the norm's input gradient within
    bf16 rounding of the stock one, and per norm one cast kernel and one fp32 write less forward, one
    cast kernel and half the gradient bytes backward.
    """

    autocast_output = False

    def __init__(self, hidden_size, eps=1e-6, *, offset=0.0, casting="llama", device=None, dtype=None):
        super().__init__()
        hidden_size = _check_size(hidden_size)
        _check_real(eps, "eps")
        _check_real(offset, "offset")
        if casting not in CASTINGS:
            raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
        init = torch.zeros if offset == 1.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = float(offset)
        self.casting = casting

    @property
    def eps(self) -> float:
        """The epsilon, under the name Gemma's and OLMo's norms give it (Llama's: ``variance_epsilon``).
        Both names read and write the one value the forward uses, as code that tunes a model's norms
        (transformers' test utilities set ``eps`` on every ``*RMSNorm``) expects of either module."""
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        self.variance_epsilon = value

    def output_dtype(self, hidden_states):
        """The ``out_dtype`` this norm gives ``rms_norm`` for this input: the autocast dtype where
        ``autocast_output`` applies, else None (the norm's own)."""
        if self.autocast_output:
            device_type = hidden_states.device.type
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
        return None

    def forward(self, hidden_states):
        _check_input(hidden_states, self.weight)
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting=self.casting,
            out_dtype=self.output_dtype(hidden_states),
        )

    def extra_repr(self) -> str:
        size, eps = self.weight.shape[0], self.variance_epsilon
        return f"{size}, eps={eps}, offset={self.offset}, casting={self.casting!r}"


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm(hidden_size, eps, bias=bias)`` over the last dim.

    Parameters ``weight`` (ones) and ``bias`` (zeros; registered as None when ``bias=False``), so
    ``state_dict`` keys and initial values are torch's. ``normalized_shape``, ``eps`` and
    ``elementwise_affine`` are kept as torch names them, for code that reads them.
    """

    def __init__(self, hidden_size, eps=1e-5, *, bias=True, device=None, dtype=None):
        super().__init__()
        hidden_size = _check_size(hidden_size)
        _check_real(eps, "eps")
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.elementwise_affine = True
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @property
    def variance_epsilon(self) -> float:
        """The epsilon, under the name Cohere's layer norms give it (torch's: ``eps``); reading and
        writing either name is the same."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, hidden_states):
        _check_input(hidden_states, self.weight)
        return layer_norm(hidden_states, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"
