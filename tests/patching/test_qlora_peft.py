"""tigon.patch on QLoRA models as users make them: ``from_pretrained(..., quantization_config=
BitsAndBytesConfig(load_in_4bit=True, ...))``, ``peft.prepare_model_for_kbit_training``, ``get_peft_model``.
The attention's and the MLP's adapters run inside tigon's nodes over the bitsandbytes 4-bit bases (nf4 and
fp4, with and without double quant, bare ``Linear4bit`` where a projection has no adapter), and the loss and
every adapter gradient equal stock PEFT + bitsandbytes' (fp32 compute, on the CPU under the interpreter);
``Patch.replaced`` names the 4-bit bases; revert gives the stock model back. bf16 compute under autocast on
the CPU within bf16 rounding; on the GPU against an fp32-compute reference.

The attention node runs in fp16/bf16 on the GPU only (fused_attention.DEVICES, its dtypes): these tests add the
CPU and fp32, as tests/patching/test_lora_peft.py does."""

import pytest
import torch

import tigon
from tests.helpers import DEVICE, node_names
from tests.patching.tiny import assert_grads_close, batch, grads, rel, tiny_model
from tests.patching.tiny_lora import node_in_fp32_here, quantized, save_tiny_llama, step
from tigon.patching import fused_attention

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _node_in_fp32_on_this_device(monkeypatch):
    node_in_fp32_here(monkeypatch)


@pytest.fixture
def node_calls(monkeypatch):
    calls = []
    apply = fused_attention.APPLY_NODE

    def counting(*args):
        calls.append(args)
        return apply(*args)

    monkeypatch.setattr(fused_attention, "APPLY_NODE", counting)
    return calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def lora(model, r, targets, seed=1, **kwargs):
    torch.manual_seed(seed)  # the adapters' init: the same draw for stock and patched
    config = peft.LoraConfig(r=r, target_modules=targets, init_lora_weights=False, **{"lora_alpha": 2 * r, **kwargs})
    return peft.get_peft_model(model, config)


def assert_matches(patched, stock, seed=0):
    loss, got = step(patched, seed)
    loss_stock, want = step(stock, seed)
    assert rel(loss, loss_stock) <= 1e-5
    assert_grads_close(got, want, 1e-4)
    return got


CASES = {  # rank, targets, quant type, double quant, prepare_model_for_kbit_training
    "r16-all-nf4-double-quant": (16, ALL, "nf4", True, True),
    "r1-subset-fp4": (1, ["q_proj", "v_proj", "up_proj"], "fp4", False, False),
}


@pytest.mark.parametrize("case", CASES)
def test_qlora_adapters_inside_the_nodes_match_peft_bitsandbytes(case, checkpoint, node_calls):
    r, targets, quant_type, nested, kbit_prepare = CASES[case]
    stock = lora(quantized(checkpoint, quant_type, nested, kbit_prepare=kbit_prepare), r, targets)
    patched = lora(quantized(checkpoint, quant_type, nested, kbit_prepare=kbit_prepare), r, targets)
    assert type(patched.get_base_model().model.layers[0].self_attn.q_proj).__module__ == "peft.tuners.lora.bnb"
    handle = tigon.patch(patched)
    got = assert_matches(patched, stock)
    layers = patched.get_base_model().config.num_hidden_layers
    # (with prepare_model_for_kbit_training's reentrant checkpointing the forward runs without grad, the
    # stock attention; the backward's recomputation runs the node)
    assert len(node_calls) == layers
    assert len(got) == 2 * len(targets) * layers
    bases = f"bases bitsandbytes 4-bit {quant_type}, compute float32" + (", double quant" if nested else "")
    for node, names in (("attention", ATTENTION), ("MLP", ["gate_proj", "up_proj", "down_proj"])):
        fused = "/".join(t for t in names if t in targets)
        assert f"LoRA adapters (r={r}) of {fused} run inside the {node} node; {bases} ({layers} modules)" \
            in handle.replaced, handle.replaced
    assert not any("PEFT's forward" in line or "bitsandbytes' forward" in line for line in handle.replaced)


def test_qlora_nodes_save_no_dequantized_weight(checkpoint, node_calls):
    """What the attention and MLP nodes keep for the backward holds no dequantized weight (a 2-D float tensor
    of a projection's shape, or of q/k/v's stacked one): the packed weights stay the parameters, dequantized
    again in the backward."""
    patched = lora(quantized(checkpoint, kbit_prepare=False), 4, ALL)
    tigon.patch(patched)
    layers = patched.get_base_model().model.layers
    shapes = {tuple(p.get_base_layer().weight.quant_state.shape) for layer in layers
              for p in (*(getattr(layer.self_attn, n) for n in ATTENTION),
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)}
    config = patched.get_base_model().config
    head_dim = config.head_dim
    shapes.add(((config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim, config.hidden_size))
    saved = []
    ids, labels = batch(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = patched(input_ids=ids, labels=labels).loss
    assert len(node_calls) == len(layers) and "_LoraGatedMLPFunctionBackward" in node_names(loss)
    weights = [tuple(t.shape) for t in saved if t.is_floating_point() and tuple(t.shape) in shapes]
    assert weights == [], weights
    loss.backward()


def test_qlora_patched_before_wrapping_and_reverted(checkpoint, node_calls):
    """Patching the quantized model first, then get_peft_model: the same training step; revert puts the stock
    modules back (the MLP a LlamaMLP around the same PEFT layers), and the step is still stock's."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    stock = lora(quantized(checkpoint), 4, ALL)
    base = quantized(checkpoint)
    handle = tigon.patch(base)
    assert "q_proj/k_proj/v_proj/o_proj: bitsandbytes 4-bit nf4, compute float32, double quant bases run inside " \
        "the attention node (2 modules)" in handle.replaced
    patched = lora(base, 4, ALL)
    assert_matches(patched, stock)
    assert node_calls
    handle.revert()
    mlp = patched.get_base_model().model.layers[0].mlp
    assert type(mlp) is LlamaMLP and type(mlp.up_proj).__module__ == "peft.tuners.lora.bnb"
    calls = len(node_calls)
    assert_matches(patched, stock, seed=1)
    assert len(node_calls) == calls


def test_qlora_mismatched_compute_dtype_keeps_peft_forward(checkpoint, node_calls):
    """bf16 compute on the fp32 model without autocast (bitsandbytes rounds the input to bf16 and casts its
    output back: not the nodes' product): neither node runs; the step is stock's within bf16 rounding (tigon's
    fp32 rotary and GLU around PEFT's forwards differ from stock's in the last fp32 bits, which the next
    bf16 rounding of an input can turn into one bf16 step)."""
    stock = lora(quantized(checkpoint, compute=torch.bfloat16, kbit_prepare=False), 2, ALL)
    patched = lora(quantized(checkpoint, compute=torch.bfloat16, kbit_prepare=False), 2, ALL)
    tigon.patch(patched)
    ids, labels = batch(0)
    loss = patched(input_ids=ids, labels=labels).loss
    assert "_LoraGatedMLPFunctionBackward" not in node_names(loss) and not node_calls
    loss.backward()
    loss_stock, want = step(stock)
    assert rel(loss, loss_stock) <= 1e-3
    assert_grads_close(grads(patched), want, 1e-2)


def bf16_against_fp32(checkpoint, ids, labels, node_calls, device_type):
    """The patched model and stock PEFT + bitsandbytes, with bf16 compute under bf16 autocast (QLoRA's usual
    setting: fp32 norms and adapters), each against the same quantized model with fp32 compute and no
    autocast (two bf16 runs compared with each other carry both their roundings). Every adapter gradient of
    the nodes within 3e-2 of the reference's and no further from it than 1.5 times stock's bf16 error (plus
    1e-3): the nodes round no more often than PEFT's separate products; the loss within 1e-2."""
    results = []
    for compute, patch in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)):
        model = lora(quantized(checkpoint, compute=compute), 16, ALL, lora_alpha=8, use_rslora=True)
        if patch:
            tigon.patch(model)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=compute == torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), grads(model)))
    assert node_calls
    (loss, got), (loss_stock, want), (loss_ref, ref) = results
    assert got.keys() == want.keys() == ref.keys()
    for name in ref:
        err, err_stock = rel(got[name], ref[name]), rel(want[name], ref[name])
        assert err <= 3e-2, f"grad of {name}: relative error {err:.2e} to fp32 > 3e-02 (stock's: {err_stock:.2e})"
        assert err <= 1.5 * err_stock + 1e-3, f"grad of {name}: error {err:.2e} to fp32, stock's {err_stock:.2e}"
    assert rel(loss, loss_ref) <= 1e-2


def test_qlora_bf16_compute_under_autocast(tmp_path, node_calls):
    """(Weights drawn with transformers' initializer_range 0.02 and the adapters scaled by 8/√16, as
    test_lora_peft's GPU test draws them: with the tiny models' 0.2 the attention's softmax saturates and bf16's
    roundings dominate stock PEFT's own gradients, 0.1 from fp32.)"""
    torch.manual_seed(0)
    tiny_model("llama", initializer_range=0.02).save_pretrained(tmp_path)
    bf16_against_fp32(tmp_path, *batch(0), node_calls, DEVICE.type)


@pytest.mark.gpu
def test_gpu_bf16_qlora_matches_peft_bitsandbytes(tmp_path, node_calls):
    """On the GPU at a real-ish shape (4 × 512 tokens: bitsandbytes dequantizes and calls F.linear past 1536
    rows, as the nodes do), nf4 with double quant, r = 16 on every projection (:func:`bf16_against_fp32`).
    Weights drawn with transformers' initializer_range 0.02 (test_lora_peft's GPU test says why)."""
    torch.manual_seed(0)
    tiny_model("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
               head_dim=64, num_hidden_layers=2, initializer_range=0.02).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 160, (4, 512), generator=gen).cuda()
    bf16_against_fp32(tmp_path, ids, ids, node_calls, "cuda")
