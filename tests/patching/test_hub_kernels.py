"""Models whose layers run Hugging Face Hub kernels: from transformers 5.25, ``from_pretrained`` calls the
``kernels`` library's ``kernelize`` by default (``use_kernels``), which on a CUDA device binds Liger-Kernel's
RMSNorm from kernels-community/liger-kernels on every RMSNorm instance, and ``model.train()`` kernelizes again.

The Hub cannot be reached here, so the kernel is a layer of this file, served by a repository object of the
``kernels`` API (``load()`` returns the layer class); everything else is the real ``kernels`` library and the
real transformers: their mapping, ``kernelize``, ``from_pretrained(use_kernels=True)`` and ``train()``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import tigon
from tests.helpers import DEVICE
from tests.patching.test_engine import _loss_and_grads_match
from tests.patching.tiny import tiny_model
from tigon.nn import RMSNorm
from tigon.patching.sites import check_plain, hub_kernel

kernels = pytest.importorskip("kernels")

# transformers marks its classes for kernelize only where the installed kernels is in its supported range: 5.25
# (CI's first pass, the GPU check's top part) with kernels 0.19; 5.17 asks for 0.16 and runs without marks.
needs_marks = pytest.mark.skipif(
    not transformers.utils.is_kernels_available(),
    reason=f"transformers {transformers.__version__} does not use the installed kernels {kernels.__version__} "
    "(another version range): its classes carry no Hub kernel marks")

CALLS = {"norm": 0}


class HubRMSNorm(nn.Module):
    """The stand-in for a Hub RMSNorm kernel: LlamaRMSNorm's function, counting its calls. A kernels layer is
    stateless (no ``__init__``, no members) and takes the module's attributes through ``self``."""

    def forward(self, hidden_states):
        CALLS["norm"] += 1
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class LocalRepository:
    """A repository of the ``kernels`` API serving one layer class from this process."""

    layer_name = "HubRMSNorm"

    def load(self):
        return HubRMSNorm

    def __hash__(self):
        return hash(self.layer_name)

    def __eq__(self, other):
        return isinstance(other, LocalRepository)

    def __str__(self):
        return "`tests/hub-rmsnorm` (layer `HubRMSNorm`)"


def _mapping():
    from kernels import Mode

    repo = LocalRepository()
    return {"RMSNorm": {DEVICE.type: {Mode.TRAINING: repo, Mode.INFERENCE: repo}}}


def _norms(model):
    return [module for module in model.modules() if type(module).__name__ == "LlamaRMSNorm"]


@needs_marks
def test_patch_takes_the_place_of_norms_that_run_a_hub_kernel():
    from kernels import Mode

    torch.manual_seed(0)
    stock = tiny_model("llama").to(DEVICE)
    model = tiny_model("llama").to(DEVICE)
    model.load_state_dict(stock.state_dict())
    with kernels.use_kernel_mapping(_mapping(), inherit_mapping=False):
        kernels.kernelize(model, mode=Mode.TRAINING, device=DEVICE.type)
        norms = _norms(model)
        assert norms and all(hub_kernel(norm) is not None for norm in norms)
        CALLS["norm"] = 0
        model(input_ids=torch.tensor([[3, 4, 5]], device=DEVICE))
        assert CALLS["norm"] == len(norms)  # the Hub kernel runs before the patch

        patch = tigon.patch(model)
        assert type(model.model.norm) is RMSNorm
        assert any("Hub kernel `tests/hub-rmsnorm`" in line and f"({len(norms)} modules)" in line
                   for line in patch.replaced)
        CALLS["norm"] = 0
        _loss_and_grads_match(stock, model)  # tigon's norms, exact against the stock model
        assert CALLS["norm"] == 0

        kernels.kernelize(model, mode=Mode.TRAINING, device=DEVICE.type)  # what model.train() does from 5.25
        assert type(model.model.norm) is RMSNorm
        model(input_ids=torch.tensor([[3, 4, 5]], device=DEVICE))
        assert CALLS["norm"] == 0

        patch.revert()
        assert _norms(model) == norms and all(hub_kernel(norm) is not None for norm in norms)
        model(input_ids=torch.tensor([[3, 4, 5]], device=DEVICE))
        assert CALLS["norm"] == len(norms)  # the Hub kernel again, as before the patch


@needs_marks
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a CUDA device transformers adds its own mapping, whose kernels "
                    "come from the Hub (the GPU machine has no network); the same path on the CPU runs in CI")
def test_from_pretrained_with_hub_kernels_patches_and_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("USE_HUB_KERNELS", "1")  # transformers' default (scripts/gpu-check.sh turns it off)
    torch.manual_seed(0)
    stock = tiny_model("llama")
    stock.save_pretrained(tmp_path)
    with kernels.use_kernel_mapping(_mapping(), inherit_mapping=False):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
        assert hub_kernel(loaded.model.norm) is not None, (
            f"transformers {transformers.__version__}'s from_pretrained(use_kernels=True) did not kernelize")
        tigon.patch(loaded)
        patched = tigon.AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
        for model in (loaded, patched):
            model.train()  # kernelizes again, for training
            assert type(model.model.norm) is RMSNorm
            CALLS["norm"] = 0
            _loss_and_grads_match(stock, model)
            assert CALLS["norm"] == 0
            stock.zero_grad()


def test_a_hub_kernel_where_tigon_would_set_the_forward_on_the_instance_is_refused():
    from kernels import Mode, use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("RMSNorm")
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            return hidden_states * self.weight

    block = Block().to(DEVICE)
    with kernels.use_kernel_mapping(_mapping(), inherit_mapping=False):
        kernels.kernelize(block, mode=Mode.TRAINING, device=DEVICE.type)
    assert hub_kernel(block) is not None
    check_plain(block, Block, "block", replaced_whole=True)  # a module that tigon's takes the place of: accepted
    with pytest.raises(ValueError, match=r"block runs the Hub kernel .*use_kernels=False"):
        check_plain(block, Block, "block")
    block.forward = lambda x: x  # a wrapper of another library: not a Hub kernel
    assert hub_kernel(block) is None
    with pytest.raises(ValueError, match="a hook wrapper"):
        check_plain(block, Block, "block", replaced_whole=True)
