"""``tigon.patch_trl()``: TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) computing with
tigon's fused log-prob op, against TRL's own ``ChunkedLogProbFunction`` (its torch fallback on the
CPU, its Triton kernel on CUDA).

Three levels: the head function alone on random inputs (all five outputs and the gradients to the
hidden states, weight and bias); a tiny model's fused forward (TRL's masking of -100 labels, its
compact and full-position paths, ``cast_lm_head_to_fp32``); and TRL's SFT, DPO, KTO and GRPO trainers
training a tiny Llama, whose logged losses, metrics and final weights must not change. Then the
patch itself: revert, heads added before and after the call, and a TRL whose head differs.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tigon
from tests.helpers import DEVICE, ON_GPU, free_port
from tests.patching.tiny import SEQ, VOCAB, rel, tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
trl_utils = importlib.import_module("trl.trainer.utils")
trl_kernels = importlib.import_module("trl.kernels.chunked_logprob")
from tigon.patching import trl as tigon_trl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRL_HEAD = trl_kernels.ChunkedLogProbFunction
ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
OPTIONAL = ALL_OUTPUTS[1:]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# Trainers: fp32, a constant learning rate; the same bound as tests/patching/test_frameworks.py.
STEPS = 2
BATCH = 2
TRAIN_TOLERANCE = 1e-4
SKIPPED_LOGS = ("epoch", "learning_rate", "step", "train_", "time")  # bookkeeping, wall clock


@pytest.fixture
def patched():
    handle = tigon.patch_trl()
    yield handle
    handle.revert()


# --------------------------------------------------------------------------- the head function alone


def _head_inputs(dtype, *, bias, tokens=40, hidden=32, vocab=VOCAB, scale=1.0, weight_dtype=None):
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(tokens, hidden, generator=gen) * scale).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(DEVICE, weight_dtype or dtype).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.5).to(DEVICE, weight_dtype or dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(DEVICE)
    with torch.no_grad():  # every other target the most likely token, so that is_top1 is not all False
        logits = h.float() @ w.float().T + (0 if b is None else b.float())
        targets[::2] = logits.argmax(-1)[::2]
    grads = torch.randn(2, tokens, generator=gen).to(DEVICE)
    return h, w, b, targets, grads


def _run_head(head, inputs, options, outputs, chunk_size=64):
    """Every output and the gradients of ``Σ g1·log_probs + g2·entropy`` to hidden, weight, bias.
    ``chunk_size``: TRL's vocabulary tile (64: three tiles of the tiny vocabulary, so that TRL's
    running statistics merge across tiles)."""
    h, w, b, targets, grads = inputs
    params = [x for x in (h, w, b) if x is not None]
    out = head.apply(h, w, b, targets, options["temperature"], chunk_size, options["softcap"],
                     options["logit_scale"], outputs)
    loss = (out[0] * grads[0]).sum()
    if out[1] is not None:
        loss = loss + (out[1] * grads[1]).sum()
    return out, torch.autograd.grad(loss, params)


OPTIONS = {
    "plain": dict(temperature=1.0, softcap=None, logit_scale=1.0),
    "temperature": dict(temperature=0.7, softcap=None, logit_scale=1.0),
    # a softcap at the logits' scale, so that tanh is far from linear (not saturated: ties)
    "softcap_scale": dict(temperature=1.3, softcap=2.0, logit_scale=0.5),
    "scale": dict(temperature=1.0, softcap=None, logit_scale=0.25),
}


@pytest.mark.parametrize(("dtype", "option"), [(torch.float32, option) for option in OPTIONS]
                         + [(torch.bfloat16, "softcap_scale")], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("outputs", [ALL_OUTPUTS, ("log_probs",)], ids=["all", "log_probs"])
def test_head_matches_trl(dtype, option, outputs):
    inputs = _head_inputs(dtype, bias=option != "plain", scale=2.0)
    want, want_grads = _run_head(TRL_HEAD, inputs, OPTIONS[option], outputs)
    got, got_grads = _run_head(tigon_trl.TigonLogProbHead, inputs, OPTIONS[option], outputs)
    _assert_outputs_match(got, want, dtype)
    if want[4] is not None:
        assert want[4].any() and not want[4].all()
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=False):
        assert g.dtype == w.dtype, name
        assert rel(g, w) <= TOLERANCE[dtype], (name, rel(g, w))


def _assert_outputs_match(got, want, dtype, what=""):
    assert len(got) == len(want) == 5
    for name, g, w in zip(ALL_OUTPUTS, got, want, strict=True):
        if w is None:
            assert g is None, f"{what}{name}: tigon computed a field TRL leaves None"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (what + name, g.shape, w.shape, g.dtype, w.dtype)
        assert g.requires_grad == w.requires_grad, what + name
        if name == "is_top1":
            # bf16 logits: TRL rounds them to bf16 before the argmax, tigon does not; near-ties may differ
            mismatch = (g != w).float().mean().item()
            assert mismatch <= (0.0 if dtype == torch.float32 else 0.1), (what + name, mismatch)
        else:
            assert rel(g, w) <= TOLERANCE[dtype], (what + name, rel(g, w))


def test_head_weight_of_another_dtype_is_cast_as_trl_does():
    """Without autocast TRL multiplies in the hidden states' dtype; a bf16 head under fp32 hidden
    states is upcast, and its gradient comes back in bf16."""
    inputs = _head_inputs(torch.float32, bias=True, weight_dtype=torch.bfloat16)
    want, want_grads = _run_head(TRL_HEAD, inputs, OPTIONS["temperature"], ALL_OUTPUTS)
    got, got_grads = _run_head(tigon_trl.TigonLogProbHead, inputs, OPTIONS["temperature"], ALL_OUTPUTS)
    _assert_outputs_match(got, want, torch.float32)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        assert rel(g, w) <= TOLERANCE[torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32]


def test_head_is_top1_on_a_tie_counts_the_first_token():
    """Two vocabulary rows equal, the most likely for every token: the target is top-1 only when it is
    the first of the two (``argmax``'s first maximum, as TRL defines it). Integer values keep the tie
    exact in any matmul."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randint(-1, 2, (4, 8), generator=gen).float()
    h[:, 0] = 2
    w = torch.randint(-1, 2, (VOCAB, 8), generator=gen).float()
    w[:, 0] = 0
    w[3] = w[7] = torch.tensor([9.0, 0, 0, 0, 0, 0, 0, 0])
    targets = torch.tensor([3, 7, 3, 7])
    args = (h.to(DEVICE), w.to(DEVICE), None, targets.to(DEVICE), 1.0, 64, None, 1.0, ("is_top1",))
    want = TRL_HEAD.apply(*args)[4]
    got = tigon_trl.TigonLogProbHead.apply(*args)[4]
    assert want.tolist() == [True, False, True, False]
    assert got.dtype == torch.bool and got.tolist() == want.tolist()


# ------------------------------------------------------------------------- a tiny model's fused head


def _fused_run(model, ids, labels, *, outputs=ALL_OUTPUTS, autocast=False):
    """The fused forward's five fields and the gradients of ``Σ g·log_probs + Σ g'·entropy``."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    gen = torch.Generator().manual_seed(9)
    weights = torch.randn(2, *out.log_probs.shape, generator=gen).to(DEVICE)
    loss = out.loss + (out.log_probs * weights[0]).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * weights[1]).sum()
    loss.backward()
    fields = [getattr(out, name) for name in ALL_OUTPUTS]
    return out.loss.detach(), fields, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _labels(batch=3, masked_row=False):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    labels[0, -2:] = -100  # padding
    if masked_row:
        labels[1] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def _assert_fused_match(got, want, dtype=torch.float32, what=""):
    assert rel(got[0], want[0]) <= TOLERANCE[dtype], (what + "loss", rel(got[0], want[0]))
    _assert_outputs_match(got[1], want[1], dtype, what)
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        assert rel(got[2][name], g) <= TOLERANCE[dtype], (what + name, rel(got[2][name], g))


@pytest.mark.parametrize("compact", [False, True], ids=["all_positions", "compact"])
def test_fused_forward_matches_trl(compact, monkeypatch):
    """A Gemma-2-like model (final-logit softcap) with temperature; -100 labels give zeros. On the CPU
    TRL scores every position with its label clamped to 0; ``compact`` forces the CUDA path (only
    labelled positions, one row with none), with TRL's own function still on its torch fallback (on
    CUDA, its Triton kernels on either path)."""
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    torch.manual_seed(0)
    model = tiny_model("gemma2").to(DEVICE)
    trl.trainer.utils.add_fused_lm_head(model, temperature=0.8, outputs=ALL_OUTPUTS)
    ids, labels = _labels(masked_row=compact)
    want = _fused_run(model, ids, labels)
    with tigon.patch_trl():
        got = _fused_run(model, ids, labels)
    _assert_fused_match(got, want)
    mask = labels[:, 1:] != -100
    for name, field in zip(ALL_OUTPUTS, got[1], strict=True):
        assert not field[~mask].any(), f"{name} is not zero where the label is -100"


def test_fused_forward_all_labels_masked(monkeypatch):
    """The compact path with no label at all (an all-prompt microbatch): zero tokens reach the head,
    and the loss is still a differentiable zero, as with TRL's function."""
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    trl.trainer.utils.add_fused_lm_head(model, outputs=ALL_OUTPUTS)
    ids, labels = _labels()
    labels[:] = -100
    want = _fused_run(model, ids, labels)
    with tigon.patch_trl():
        got = _fused_run(model, ids, labels)
    assert got[0].item() == 0 and want[0].item() == 0
    _assert_outputs_match(got[1], want[1], torch.float32)
    assert got[2].keys() == want[2].keys() and all(not g.any() for g in got[2].values())


def test_fused_forward_cast_lm_head_to_fp32_under_autocast():
    """GRPO's ``cast_lm_head_to_fp32``: the head's weight in fp32, the hidden states cast to fp32
    and autocast off around the head, the backbone in bf16 autocast."""
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    trl.trainer.utils.add_fused_lm_head(model, temperature=0.9, cast_lm_head_to_fp32=True,
                                        outputs=("log_probs", "entropy"))
    ids, labels = _labels()
    want = _fused_run(model, ids, labels, autocast=True)
    with tigon.patch_trl():
        got = _fused_run(model, ids, labels, autocast=True)
    # the head is exact in fp32; the backbone's gradients (bf16 autocast) carry its bf16 rounding
    assert rel(got[0], want[0]) <= 1e-5
    for g, w in zip(got[1][:2], want[1][:2], strict=True):
        assert g.dtype == w.dtype == torch.float32 and rel(g, w) <= 1e-4
    for name, g in want[2].items():
        assert rel(got[2][name], g) <= (1e-4 if name == "lm_head.weight" else 3e-2), name


def test_fused_forward_under_autocast_matches_trl():
    """bf16 autocast around the whole forward, the head included (TRL's default)."""
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    trl.trainer.utils.add_fused_lm_head(model, outputs=ALL_OUTPUTS)
    ids, labels = _labels()
    want = _fused_run(model, ids, labels, autocast=True)
    with tigon.patch_trl():
        got = _fused_run(model, ids, labels, autocast=True)
    _assert_fused_match(got, want, torch.bfloat16)


# ----------------------------------------------------------------------------------- the trainers


def _word_tokenizer():
    from tests.patching.test_frameworks import _word_tokenizer

    return _word_tokenizer()


def _words(gen, n):
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=gen))


def _args(config_cls, out_dir, **extra):
    return config_cls(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=DEVICE.type == "cpu", bf16=False, fp16=False, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False, **extra,
    )


def _train(make_trainer, model, out_dir):
    trainer = make_trainer(model, out_dir)
    trainer.train()
    logs = [{k: v for k, v in entry.items() if isinstance(v, float) and not k.startswith(SKIPPED_LOGS)}
            for entry in trainer.state.log_history if "loss" in entry]
    return logs, {name: p.detach().clone() for name, p in model.named_parameters()}


def _check_trainer(make_trainer, tmp_path, *, with_backbone=False):
    """TRL's trainer on a tiny Llama, stock, then with patch_trl (and tigon.patch on the backbone):
    the same logged losses and metrics (gradient norm, entropy, token accuracy, rewards, …) every
    step, the same final weights."""
    torch.manual_seed(0)
    stock = tiny_model("llama").to(DEVICE)
    candidate = copy.deepcopy(stock)
    initial = {name: p.detach().clone() for name, p in stock.named_parameters()}
    if with_backbone:
        tigon.patch(candidate)
    want, want_state = _train(make_trainer, stock, tmp_path / "stock")
    with tigon.patch_trl():
        got, got_state = _train(make_trainer, candidate, tmp_path / "tigon")
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), step
        for key, value in w.items():
            assert abs(g[key] - value) <= TRAIN_TOLERANCE * max(abs(value), 1.0), (step, key, g[key], value)
    for name, w in want_state.items():
        assert rel(got_state[name], w) <= TRAIN_TOLERANCE, name
    assert rel(want_state["lm_head.weight"], initial["lm_head.weight"]) > 1e-3  # training moved the head
    return want


def test_sft_trainer(tmp_path):
    gen = torch.Generator().manual_seed(11)
    rows = [{"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=gen).tolist()} for _ in range(STEPS * BATCH)]

    def make(model, out_dir):
        return trl.SFTTrainer(model=model, args=_args(trl.SFTConfig, out_dir, max_length=SEQ),
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())

    logs = _check_trainer(make, tmp_path, with_backbone=True)
    assert "mean_token_accuracy" in logs[0] and "entropy" in logs[0]


def test_dpo_trainer(tmp_path):
    gen = torch.Generator().manual_seed(3)
    rows = [{"prompt": _words(gen, 4), "chosen": _words(gen, 5), "rejected": _words(gen, 5)}
            for _ in range(STEPS * BATCH)]

    def make(model, out_dir):
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=_args(trl.DPOConfig, out_dir),
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())

    _check_trainer(make, tmp_path)


def test_kto_trainer(tmp_path):
    gen = torch.Generator().manual_seed(4)
    rows = [{"prompt": _words(gen, 4), "completion": _words(gen, 5), "label": i % 2 == 0}
            for i in range(STEPS * BATCH)]

    def make(model, out_dir):
        return trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=_args(trl.KTOConfig, out_dir),
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())

    _check_trainer(make, tmp_path)


def test_grpo_trainer(tmp_path):
    """GRPO generates with the tiny model (4 tokens a completion, sampled with the trainer's seed) and
    scores its completions with a toy reward; beta > 0 adds the reference model's log-probs (a second
    fused head, built by the trainer after patch_trl)."""
    gen = torch.Generator().manual_seed(6)
    rows = [{"prompt": _words(gen, 4)} for _ in range(STEPS * BATCH)]

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    initial = tmp_path / "initial"

    def make(model, out_dir):
        # TRL builds GRPO's reference model from the policy's path: the tiny model's initial weights
        if not initial.exists():
            model.save_pretrained(initial)
        model.config._name_or_path = str(initial)
        args = _args(trl.GRPOConfig, out_dir, num_generations=2, max_completion_length=4, beta=0.1,
                     temperature=0.9)
        return trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                               train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())

    _check_trainer(make, tmp_path, with_backbone=True)


def test_zero3_head(tmp_path):
    """DeepSpeed ZeRO-3 (one process, tests/patching/trl_zero3_worker.py): the head's weight gathered
    by TRL around the call; the same losses, outputs and weights with TRL's function and tigon's, with
    separate and with tied embeddings."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "results.pt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "patching" / "trl_zero3_worker.py"), str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = torch.load(out)
    for suffix in ("", "_tied"):
        want, got = runs["trl" + suffix], runs["tigon" + suffix]
        for g, w in zip(got["losses"], want["losses"], strict=True):
            assert abs(g - w) <= TRAIN_TOLERANCE * abs(w), suffix
        for step_got, step_want in zip(got["fields"], want["fields"], strict=True):
            _assert_outputs_match([step_got[n] for n in ALL_OUTPUTS], [step_want[n] for n in ALL_OUTPUTS],
                                  torch.float32, f"zero3{suffix} ")
        for name, w in want["state"].items():
            assert rel(got["state"][name], w) <= TRAIN_TOLERANCE, (suffix, name)
    assert "lm_head.weight" not in runs["trl_tied"]["state"]  # tied: the head's weight is the embedding's


# ------------------------------------------------------------------------------------ the patch itself


def test_revert_restores_trl_and_heads_before_and_after(monkeypatch):
    """A head added before patch_trl and one added after both compute with tigon while it is on,
    and with TRL's function again after revert."""
    calls = []
    apply = tigon_trl.TigonLogProbHead.apply
    monkeypatch.setattr(tigon_trl.TigonLogProbHead, "apply",
                        staticmethod(lambda *a, **k: calls.append(1) or apply(*a, **k)))
    torch.manual_seed(0)
    before, after = tiny_model("llama").to(DEVICE), tiny_model("llama").to(DEVICE)
    ids, labels = _labels()
    trl_utils.add_fused_lm_head(before)
    handle = tigon.patch_trl()
    try:
        assert vars(trl_utils)["_ChunkedLogProbFunction"] is tigon_trl.TigonLogProbHead
        assert len(handle.replaced) == 1 and handle.active
        assert not tigon.patch_trl().active  # patching twice is a no-op
        trl_utils.add_fused_lm_head(after)
        before(input_ids=ids, labels=labels, fused_lm_head=True)
        after(input_ids=ids, labels=labels, fused_lm_head=True)
        assert len(calls) == 2
    finally:
        handle.revert()
    assert vars(trl_utils)["_ChunkedLogProbFunction"] is TRL_HEAD
    before(input_ids=ids, labels=labels, fused_lm_head=True)
    assert len(calls) == 2
    handle.revert()  # twice: a no-op
    assert vars(trl_utils)["_ChunkedLogProbFunction"] is TRL_HEAD


def _changed_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
    """add_fused_lm_head as a later TRL might write it: the outputs in another order."""
    def _fused_forward(self, *args, labels=None, **kwargs):
        hidden_states, weight, bias, compact, mask = args
        with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):  # noqa: F821
            per_token = _ChunkedLogProbFunction.apply(  # noqa: F821
                hidden_states, weight, bias, labels, temperature, 1, None, 1.0, outputs)
        log_probs, is_top1, entropy, log_sum_sq_probs, mean_logits = per_token
        return log_probs

    return _fused_forward


def test_unrecognised_head_raises_and_patches_nothing(monkeypatch):
    monkeypatch.setattr(trl_utils, "add_fused_lm_head", _changed_head)
    with pytest.raises(ValueError, match="not the one tigon recognises") as err:
        tigon.patch_trl()
    assert "log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token" in str(err.value)
    assert vars(trl_utils)["_ChunkedLogProbFunction"] is TRL_HEAD


def test_changed_output_definition_raises(monkeypatch):
    """A TRL whose mean_logits were over the unscaled logits, say: the transform differs."""
    def _torch_transform(z, logit_scale, softcap, inv_t, HAS_SOFTCAP):
        if HAS_SOFTCAP:
            z = softcap * torch.tanh(z / softcap)
        return z * logit_scale * inv_t

    monkeypatch.setattr(trl_kernels, "_torch_transform", _torch_transform)
    with pytest.raises(ValueError, match="_torch_transform lacks"):
        tigon.patch_trl()
    assert vars(trl_utils)["_ChunkedLogProbFunction"] is TRL_HEAD


def test_head_replaced_by_someone_else_raises(monkeypatch):
    class Other:
        apply = staticmethod(TRL_HEAD.apply)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Other)
    with pytest.raises(ValueError, match="not TRL's ChunkedLogProbFunction"):
        tigon.patch_trl()
    assert vars(trl_utils)["_ChunkedLogProbFunction"] is Other


def test_recognition_sees_through_decorators(monkeypatch):
    import functools

    original = trl_utils.add_fused_lm_head

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(trl_utils, "add_fused_lm_head", wrapped)
    with tigon.patch_trl() as handle:
        assert handle.active


# -------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_matches_trl_triton_kernel_on_cuda(dtype):
    """On CUDA TRL's function runs its Triton kernels and its cuBLAS tiles in the compute dtype."""
    assert ON_GPU and trl_kernels._use_triton(DEVICE)
    inputs = _head_inputs(dtype, bias=True, tokens=5000, hidden=256, vocab=40000, scale=2.0)
    # TRL's own tiles: two token tiles (4096 a tile), two vocabulary tiles
    want, want_grads = _run_head(TRL_HEAD, inputs, OPTIONS["softcap_scale"], ALL_OUTPUTS,
                                 chunk_size=trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)
    got, got_grads = _run_head(tigon_trl.TigonLogProbHead, inputs, OPTIONS["softcap_scale"], ALL_OUTPUTS)
    # TRL multiplies in token tiles of 4096, tigon in class chunks over all tokens: cuBLAS sums in
    # another order, and at this scale the softcap saturates (2·tanh(4) ≈ 1.9987), so the largest
    # logits of a row can tie to within that rounding. is_top1 may differ there, and only there.
    flipped = (got[4] != want[4]).nonzero().flatten()
    assert _top_gap(inputs, OPTIONS["softcap_scale"], flipped).max().item() <= 1e-5 if len(flipped) else True
    _assert_outputs_match(got[:4] + (want[4],), want, dtype)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
        assert rel(g, w) <= TOLERANCE[dtype], (name, rel(g, w))


def _top_gap(inputs, options, rows):
    """For these tokens, the float64 gap between the largest scaled logit and the target's."""
    h, w, b, targets, _ = inputs
    z = (h[rows].double() @ w.double().T + b.double()) * options["logit_scale"]
    z = options["softcap"] * torch.tanh(z / options["softcap"]) / options["temperature"]
    return z.max(-1).values - z.gather(-1, targets[rows, None]).squeeze(-1)
