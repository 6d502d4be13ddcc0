"""torch.compile of patched PEFT LoRA and QLoRA models, forward and backward, on the CPU under the interpreter.

``torch.compile(model, fullgraph=True)`` of the whole ``PeftModel`` (TRL's ``torch_compile=True`` compiles the
model Trainer trains): Dynamo traces it in one graph, with no break in tigon's code, PEFT's or bitsandbytes',
and the ``aot_eager`` backend (AOTAutograd over fake tensors, the graphs then run eagerly: the interpreter runs
the kernels) gives the eager model's loss and adapter gradients within 1e-6 (fp32). The graphs are read to show
what ran:

- the MLP node (:func:`tigon.nn.lora_mlp.lora_gated_mlp`) is traced as its autograd Function
  (``autograd_function_apply``, made from ``lora_mlp.py``), with tigon's GLU kernel in its forward and its
  backward body, and for QLoRA bitsandbytes' ``dequantize_4bit`` in both (the packed weight read again in the
  backward); none of the MLP's projections is called in the graph (no PEFT forward ran there);
- the attention node is eager only (``tigon.patching.fused_attention`` declines it while Dynamo traces:
  ``Patch.replaced``'s attention line says "in eager training"), so q/k/v/o run PEFT's forwards in the
  compiled graph (over 4-bit bases bitsandbytes' own product: its autograd Function where the input
  requires grad), which Dynamo traces with the rest. On the CPU the eager attention runs its own forward too
  (the node's devices: fused_attention.DEVICES), so eager and compiled make the same products; the QLoRA
  test runs the node eagerly in fp32 on the CPU (tiny_lora.node_in_fp32_here), and the compiled model still
  does not call it.

The adapters are read at every call (:func:`tigon.nn.lora.lora_projection`); under torch.compile Dynamo
guards on what that reads, so ``disable_adapter()`` recompiles and the compiled model computes the base alone
as the eager one does. QLoRA's usual bf16 compute under autocast: one MLP compiled with ``fullgraph=True``
(:func:`test_compiled_qlora_mlp_bf16_compute_under_autocast`). GPU: :func:`test_gpu_inductor_lora_and_qlora`
compiles with Inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import batch, grads, rel, tiny_model
from tests.patching.tiny_lora import (
    base_model,
    count_node_calls,
    lora,
    node_in_fp32_here,
    quantized,
    save_tiny_llama,
)

peft = pytest.importorskip("peft")

MLP_NODE_SOURCE = "tigon/nn/lora_mlp.py"
# a step of the node against PEFT's products (fp32): the API's fp32 gradient tolerance
FP32_TOLERANCE = 1e-4
# the aot_eager tests: the interpreter's path (test_compile_cpu.py's); on a GPU the Inductor test below
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path; the GPU test "
                                      "compiles with Inductor")


class Capture:
    """A Dynamo backend that keeps the graphs it is given and compiles them with ``aot_eager``."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)


def autograd_functions(gm):
    """``(stack trace, forward body targets, backward body targets)`` of each autograd Function in ``gm``."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target) == "autograd_function_apply":
            bodies = [getattr(gm, arg.target) for arg in node.args[:2]]
            out.append((node.meta.get("stack_trace", ""),
                        *({str(n.target) for n in body.graph.nodes if n.op == "call_function"} for body in bodies)))
    return out


def projection_calls(gm, part):
    """The ``F.linear`` calls of ``gm`` made by a module under a ``part`` (``"mlp"``, ``"self_attn"``) module."""
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target is torch._C._nn.linear
            and any(f".{part}." in path for path, _ in node.meta.get("nn_module_stack", {}).values())]


def step(model):
    """One forward and backward of ``model`` (a compiled one: of the module it wraps): the loss and gradients."""
    ids, labels = batch(0)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    module = getattr(model, "_orig_mod", model)
    out = loss.detach(), grads(module)
    module.zero_grad(set_to_none=True)
    return out


def assert_equal_steps(got, want, tolerance=1e-6):
    (loss, got_grads), (loss_want, want_grads) = got, want
    assert rel(loss, loss_want) <= tolerance, (loss.item(), loss_want.item())
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, g in want_grads.items():
        assert rel(got_grads[name], g) <= tolerance, name


def compiled_step(model):
    """The model compiled whole (``fullgraph=True``), one step: its result and the graphs Dynamo made."""
    torch._dynamo.reset()
    counters.clear()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    return compiled, capture, step(compiled)


def assert_mlp_node_traced(gm, layers, quantized_bases):
    mlp_nodes = [(fwd, bwd) for trace, fwd, bwd in autograd_functions(gm) if MLP_NODE_SOURCE in trace]
    assert len(mlp_nodes) == layers
    for fwd, bwd in mlp_nodes:
        assert "tigon.glu.default" in fwd and "tigon.glu_backward_recompute_into.default" in bwd, (fwd, bwd)
        dequantized = "bitsandbytes.dequantize_4bit.default"
        assert (dequantized in fwd and dequantized in bwd) == quantized_bases, (fwd, bwd)
    assert projection_calls(gm, "mlp") == []


@interpreter_only
def test_compiled_lora_model_matches_eager():
    """Adapters on every linear layer: the compiled step equals the eager one; the MLP node is traced, the
    attention's projections are PEFT's in the graph; with adapters disabled the compiled model recompiles and
    its loss is the eager base model's."""
    model = lora(base_model("llama"))
    handle = tigon.patch(model)
    assert "LoRA adapters (r=5) of gate_proj/up_proj/down_proj run inside the MLP node (2 modules)" in handle.replaced
    want = step(model)
    compiled, capture, got = compiled_step(model)
    assert_equal_steps(got, want)
    assert len(capture.graphs) == 1 and not counters["graph_break"]
    (gm,) = capture.graphs
    layers = model.get_base_model().config.num_hidden_layers
    assert_mlp_node_traced(gm, layers, quantized_bases=False)
    # q, k, v, o: the base and the adapter's two products each, PEFT's forward
    assert len(projection_calls(gm, "self_attn")) == 3 * 4 * layers

    assert_equal_steps(step(compiled), want)  # the same graph again
    assert len(capture.graphs) == 1
    ids, labels = batch(1)
    with model.disable_adapter():  # nothing trainable: the loss of the base alone
        base_want = model(input_ids=ids, labels=labels).loss
        base_got = compiled(input_ids=ids, labels=labels).loss
    assert len(capture.graphs) == 2  # the guards saw the switch
    assert rel(base_got, base_want) <= 1e-6 and rel(base_got, model(input_ids=ids, labels=labels).loss) > 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def qlora_model(checkpoint, targets, compute=torch.float32):
    """The checkpoint (fp32) loaded in 4-bit nf4 with double quant and ``compute`` as the compute dtype, LoRA
    r = 4 on ``targets``."""
    model = quantized(checkpoint, compute=compute, kbit_prepare=False)
    torch.manual_seed(1)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, lora_config)


@interpreter_only
def test_compiled_qlora_model_matches_eager(checkpoint, monkeypatch):
    """4-bit bases under every projection, adapters on all but up_proj (a bare ``Linear4bit`` in the node): the
    compiled step equals the eager one that makes the same products, and the eager one that runs the
    attention node (in fp32 on the CPU here) within the fp32 tolerance; the MLP node is traced with
    bitsandbytes' dequantization inside it, the attention's projections run PEFT's and bitsandbytes' forwards
    in the graph.

    Why two eager references: the node makes one product of the stacked q/k/v bases where PEFT makes three,
    and the CPU's fp32 matmul accumulates a wider product in another order, so the two eager steps differ in
    rounding (adapter gradients 1.6e-6 apart on an AVX-512 EPYC, under 1e-6 on other CPUs). The compiled
    graph makes PEFT's products, as the eager step does with the node off the CPU (its default)."""
    pytest.importorskip("bitsandbytes")
    model = qlora_model(checkpoint, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    handle = tigon.patch(model)
    assert ("LoRA adapters (r=4) of gate_proj/down_proj run inside the MLP node; bases bitsandbytes 4-bit nf4, "
            "compute float32, double quant (2 modules)") in handle.replaced, handle.replaced
    calls = count_node_calls(monkeypatch)
    same_products = step(model)
    assert calls == {"attention": 0, "MLP": 2}
    node_in_fp32_here(monkeypatch)
    want = step(model)
    assert calls == {"attention": 2, "MLP": 4}
    assert_equal_steps(want, same_products, tolerance=FP32_TOLERANCE)
    _, capture, got = compiled_step(model)
    assert_equal_steps(got, same_products)
    assert len(capture.graphs) == 1 and not counters["graph_break"]
    assert calls["attention"] == 2  # not called while Dynamo traced
    (gm,) = capture.graphs
    layers = model.get_base_model().config.num_hidden_layers
    assert_mlp_node_traced(gm, layers, quantized_bases=True)
    # q, k, v, o: the adapters' two products each, over bitsandbytes' base product (its MatMul4Bit where the
    # input requires grad: every one but layer 0's q/k/v, whose input is the frozen embedding's)
    assert len(projection_calls(gm, "self_attn")) == 2 * 4 * layers
    others = [trace for trace, _, _ in autograd_functions(gm) if MLP_NODE_SOURCE not in trace]
    assert sum("MatMul4Bit" in trace for trace in others) == 4 * layers - 3
    assert all("MatMul4Bit" in trace or "FusedLinearCrossEntropy" in trace for trace in others)


@interpreter_only
def test_compiled_qlora_mlp_bf16_compute_under_autocast(checkpoint):
    """QLoRA's usual setting, bf16 compute under bf16 autocast over weights quantized from fp32: the MLP node
    dequantizes into the compute dtype rather than the state's (a copy of the state with its dtype set, as
    bitsandbytes' op is handed C), which Dynamo traces too. One MLP, ``fullgraph=True``: the same output and
    gradients as eager, the node in the graph."""
    pytest.importorskip("bitsandbytes")
    model = qlora_model(checkpoint, ["gate_proj", "up_proj", "down_proj"], compute=torch.bfloat16)
    tigon.patch(model)
    mlp = model.get_base_model().model.layers[0].mlp
    weight = mlp.gate_proj.base_layer.weight
    assert weight.quant_state.dtype == torch.float32 and mlp.gate_proj.base_layer.compute_dtype == torch.bfloat16
    x = torch.randn(2, 5, mlp.hidden_size, device=DEVICE, generator=torch.Generator().manual_seed(2))

    def run(module):
        inputs = x.clone().requires_grad_()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = module(inputs)
        y.float().square().sum().backward()
        out = y.detach(), inputs.grad, grads(mlp)
        mlp.zero_grad(set_to_none=True)
        return out

    want = run(mlp)
    torch._dynamo.reset()
    capture = Capture()
    got = run(torch.compile(mlp, backend=capture, fullgraph=True))
    assert rel(got[0], want[0]) <= 1e-6 and rel(got[1], want[1]) <= 1e-6
    assert want[2] and got[2].keys() == want[2].keys() and all(rel(got[2][k], want[2][k]) <= 1e-6 for k in want[2])
    (gm,) = capture.graphs
    (node,) = autograd_functions(gm)
    assert MLP_NODE_SOURCE in node[0] and "bitsandbytes.dequantize_4bit.default" in node[1]


@pytest.mark.gpu
@pytest.mark.parametrize("bases", ["plain", "4-bit"])
def test_gpu_inductor_lora_and_qlora(bases, tmp_path):
    """Inductor on the GPU, fp32 (the attention node runs in fp16/bf16 only; the MLP node in every dtype): the
    compiled step's loss and adapter gradients within 1e-4 of the eager one's (Inductor's own kernels sum in
    their own order), with no graph break."""
    if bases == "plain":
        model = lora(base_model("llama")).to(DEVICE)
    else:
        pytest.importorskip("bitsandbytes")
        torch.manual_seed(0)
        tiny_model("llama").save_pretrained(tmp_path)
        model = qlora_model(tmp_path, "all-linear")
    tigon.patch(model)
    want = step(model)
    torch._dynamo.reset()
    counters.clear()
    got = step(torch.compile(model, fullgraph=True))
    assert not counters["graph_break"]
    assert_equal_steps(got, want, tolerance=1e-4)
