"""``benchmarks/e2e.py --profile``: the kernel-name classification, the per-step summary, the
"where the time goes" markdown, and (on a CPU-only machine) the whole pipeline with the profiler on.

The names below are modelled on what PyTorch profiler traces on an H100 show (demangled C++ templates,
shortened where the tail does not matter), on what Inductor generates under torch.compile, and on what
Triton calls tigon's and Liger-Kernel's kernels (their Python function names).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmarks import e2e
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

OPS = Path(__file__).resolve().parents[1] / "src" / "tigon" / "ops"

KERNELS = [
    # cuBLAS / CUTLASS
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)", "matmul"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
     "(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("aten::mm", "matmul"),
    # attention (flash and fmha names contain "cutlass", cuDNN's contain "wgmma")
    ("flash_fwd_kernel", "attention"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel"
     "<cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 128, false>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    # norms, rope, activations: tigon's, Liger's and PyTorch's
    ("rms_norm_fwd_kernel", "norm"),
    ("rms_norm_bwd_kernel", "norm"),
    ("partial_rows_sum_kernel", "norm"),  # the norms' dw / db sum over the bands
    ("layer_norm_bwd_kernel", "norm"),
    ("_rms_norm_forward_kernel", "norm"),
    ("_block_rms_norm_backward_kernel", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
     "(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, "
     "c10::BFloat16*)", "norm"),
    ("rope_kernel", "rope"),
    ("_triton_rope", "rope"),
    ("glu_fwd_kernel", "activation/glu"),
    ("glu_bwd_kernel", "activation/glu"),
    ("_swiglu_forward_kernel", "activation/glu"),
    ("_swiglu_backward_kernel", "activation/glu"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel"
     "(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
     "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)", "activation/glu"),
    # bitsandbytes' 4-bit bases (QLoRA): the weight and, with double quant, its absmax dequantized
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, "
     "int, int)", "dequantize"),
    # losses: tigon's, Liger's and PyTorch's
    ("cross_entropy_fwd_kernel", "loss"),
    ("cross_entropy_chunk_stats_kernel", "loss"),
    ("cross_entropy_chunk_grad_kernel", "loss"),
    ("reduction_scales_kernel", "loss"),
    ("scale_rows_kernel", "loss"),
    ("fused_linear_jsd_row_kernel", "loss"),
    ("kl_div_fwd_kernel", "loss"),
    ("liger_cross_entropy_kernel", "loss"),
    ("element_mul_kernel", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, c10::BFloat16 const*, int)", "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>"
     "(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)", "loss"),
    # optimizer: Adam's functor is templated on `false`, which must not read as `lse`
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float const*, "
     "float const*>(...)", "optimizer"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    # copies, casts, fills
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
     "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, "
     "at::native::memory::StoreWithCast<1> >(...)", "copy/cast"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
     "OpaqueType<2u>, unsigned int, 4, 64, 64>(...)", "copy/cast"),
    ("Memcpy DtoD (Device -> Device)", "copy/cast"),
    ("Memset (Device)", "copy/cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "copy/cast"),
    ("aten::_to_copy", "copy/cast"),
    # the remaining elementwise and reduction kernels ("nocast" is not a cast)
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "elementwise/reduce"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
     "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >"
     "(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)", "elementwise/reduce"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
     "float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, "
     "float, float>, unsigned int, float, 4, 4>)", "elementwise/reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)",
     "elementwise/reduce"),
    # Inductor's kernels under torch.compile, whatever ops they fuse
    ("triton_red_fused__to_copy_add_mean_0", "inductor fused"),
    ("triton_poi_fused__to_copy_mul_silu_1", "inductor fused"),
    ("triton_per_fused__log_softmax_nll_loss_forward_2", "inductor fused"),
    # a Triton kernel nobody listed, and the rest
    ("my_custom_fused_kernel", "triton other"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>"
     "(...)", "other"),
    ("void foo<false>(property const*)", "other"),
    ("aten::mul", "other"),
]


@pytest.mark.parametrize("name, category", KERNELS, ids=[f"{c}:{n[:48]}" for n, c in KERNELS])
def test_classify(name, category):
    assert e2e.classify(name) == category


def test_categories_are_data():
    assert e2e.CATEGORIES[-1] == e2e.OTHER
    assert len(set(e2e.CATEGORIES)) == len(e2e.CATEGORIES)
    assert {category for _, category in KERNELS} == set(e2e.CATEGORIES)  # every category is exercised


def test_every_tigon_kernel_has_a_category():
    """Triton names a kernel after its Python function: each of tigon's ``*_kernel`` functions must land
    in a named category (a new op adds its pattern to ``KERNEL_CATEGORIES``)."""
    names = [name for path in sorted(OPS.glob("*.py"))
             for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text())]
    assert "rms_norm_fwd_kernel" in names
    unnamed = {name: e2e.classify(name) for name in names if e2e.classify(name) in ("triton other", "other")}
    assert not unnamed


def test_summarise_profile_per_step():
    long_name = "void at::native::vectorized_elementwise_kernel<4, " + "x" * 500
    kernels = [("nvjet_tst_128x256", 300.0), ("rms_norm_fwd_kernel", 40.0), ("nvjet_tst_128x256", 500.0),
               (long_name, 60.0), ("Memset (Device)", 2.0), ("rms_norm_fwd_kernel", 40.0)]
    summary = e2e.summarise_profile(kernels, steps=2, wall_ms=0.5)
    assert summary["categories"]["matmul"] == pytest.approx(0.4)  # 800 us over 2 steps
    assert summary["categories"]["norm"] == pytest.approx(0.04)
    assert summary["categories"]["copy/cast"] == pytest.approx(0.001)
    assert summary["categories"]["attention"] == 0.0
    assert list(summary["categories"]) == list(e2e.CATEGORIES)
    assert summary["busy_ms"] == pytest.approx(0.471)
    assert summary["busy_fraction"] == pytest.approx(0.471 / 0.5)
    top = summary["top_kernels"]
    assert [k["name"] for k in top][:3] == ["nvjet_tst_128x256", "rms_norm_fwd_kernel", long_name[:160]]
    assert top[0] == {"name": "nvjet_tst_128x256", "category": "matmul", "ms": pytest.approx(0.4), "calls": 1.0}
    assert top[2]["category"] == "elementwise/reduce"  # classified on the whole name, reported cut
    many = [(f"kernel_{i}", float(i)) for i in range(40)]
    assert len(e2e.summarise_profile(many, steps=1, wall_ms=1.0)["top_kernels"]) == e2e.TOP_KERNELS


def test_profiled_kernels_take_device_events_only():
    """On the GPU: kernels, memcpys and memsets, not host events nor the annotations mirrored on the GPU."""

    def event(name, device, start, end, annotation=False, self_cpu=0.0):
        return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end),
                               is_user_annotation=annotation, is_async=False, self_cpu_time_total=self_cpu)

    events = [event("aten::mm", DeviceType.CPU, 0, 50, self_cpu=30.0), event("nvjet_tst_x", DeviceType.CUDA, 10, 40),
              event("Memset (Device)", DeviceType.CUDA, 41, 42),
              event("Optimizer.step#AdamW.step", DeviceType.CUDA, 0, 100, annotation=True)]
    prof = SimpleNamespace(events=lambda: events)
    assert e2e.profiled_kernels(prof, cuda=True) == [("nvjet_tst_x", 30), ("Memset (Device)", 1)]
    assert e2e.profiled_kernels(prof, cuda=False) == [("aten::mm", 30.0)]


def test_idle_gaps_between_kernels():
    """Gaps longer than IDLE_GAP_US between GPU events (overlaps merged, host events and annotations
    ignored), summed per step, the longest first with the kernels on either side and the host events
    that ran through them (those spanning a whole phase left out)."""

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end),
                               is_user_annotation=annotation)

    events = [
        event("a", DeviceType.CUDA, 0, 100),
        event("b", DeviceType.CUDA, 50, 120),  # overlaps a: no gap, and the span now ends at 120
        event("c", DeviceType.CUDA, 130, 200),  # 10 us after b: below the threshold
        event("d", DeviceType.CUDA, 500, 600),  # 300 us idle before it
        event("host", DeviceType.CPU, 200, 500),
        event("guards", DeviceType.CPU, 210, 300),  # 90 of the 300 us: 30%, listed after "host"
        event("tiny", DeviceType.CPU, 400, 410),  # 10 us: not what the GPU waited on
        event("whole step", DeviceType.CPU, 0, 20_000),  # spans a phase: never listed
        event("Optimizer.step", DeviceType.CUDA, 0, 1000, annotation=True),
        event("e", DeviceType.CUDA, 650, 700),  # 50 us idle before it
    ]
    idle = e2e.idle_gaps(SimpleNamespace(events=lambda: events), steps=2)
    assert idle["gaps"] == 1.0 and idle["idle_ms"] == pytest.approx((300 + 50) / 1e3 / 2)
    assert [(g["us"], g["after"], g["before"]) for g in idle["longest"]] == [(300, "c", "d"), (50, "d", "e")]
    assert idle["longest"][0]["host"] == [{"name": "host", "us": 300.0}, {"name": "guards", "us": 90.0}]
    assert idle["longest"][1]["host"] == []


def _profile(categories: dict, busy: float, wall: float, top: str) -> dict:
    return {"steps": 2, "busy_ms": busy, "wall_ms": wall, "busy_fraction": busy / wall, "activity": "cuda",
            "profiled_wall_ms": wall * 1.1,
            "categories": {**dict.fromkeys(e2e.CATEGORIES, 0.0), **categories},
            "top_kernels": [{"name": top, "category": "matmul", "ms": 75.0, "calls": 112.0}]}


def _fake_result() -> dict:
    base = {"model": "llama", "batch": 4, "seq": 2048, "vocab": 128256, "label": "Llama-3.2-1B-shaped",
            "profile_steps": 2, "params": 10**9, "wall_s": 9.0, "warmup": 3, "steps": 5, "peak_bytes": 40 * 2**30,
            "activation_bytes": 20 * 2**30, "losses": [11.9, 11.8]}
    rows = [
        {**base, "provider": "stock", "tokens_per_s": 40000.0, "median_step_s": 0.205,
         "profile": _profile({"matmul": 75.0, "copy/cast": 48.25, "other": 75.25}, 198.5, 205.0,
                             "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN")},
        {**base, "provider": "tigon", "tokens_per_s": 52000.0, "median_step_s": 0.158,
         "profile": _profile({"matmul": 74.0, "norm": 3.5}, 120.0, 158.0, "sm90_xmma_gemm_a|b")},
        {**base, "provider": "compile", "tokens_per_s": 51000.0, "median_step_s": 0.16,
         "profile_error": "RuntimeError: CUPTI unavailable"},
        {**base, "provider": "liger", "error": "out of memory", "oom": True},
    ]
    e2e.add_loss_agreement(rows)
    return {"kind": "throughput", "rows": rows, "device": "NVIDIA H100 80GB HBM3", "date": "2025-01-01",
            "versions": {"torch": "2.11"}, "settings": {"steps": 5, "warmup": 3, "skipped": {}}}


def test_profile_markdown():
    result = _fake_result()
    text = e2e.markdown(result)
    section = text[text.index("## Where the time goes (ms of GPU time per step)"):]
    assert "### Llama-3.2-1B-shaped (V=128256), batch 4 x 2048" in section
    assert "| ms per step | stock | tigon | torch.compile(model) | Liger-Kernel |" in section
    assert "| matmul | 75.0 | 74.0 | — | — |" in section
    assert "| norm | 0.0 | 3.5 | — | — |" in section
    assert "| copy/cast | 48.2 | 0.0 | — | — |" in section
    assert "| attention |" not in section  # categories no provider used are left out
    table = section[section.index("| ms per step"):].split("\n\n")[0]
    rows = [line.split(" |")[0] for line in table.splitlines()]
    assert rows[2:] == ["| matmul", "| norm", "| copy/cast", "| other", "| **GPU busy**", "| step wall",
                        "| busy / wall"]  # in KERNEL_CATEGORIES order, then the totals
    assert "| **GPU busy** | **198.5** | **120.0** | — | — |" in section
    assert "| busy / wall | 0.97 | 0.76 | — | — |" in section
    assert "Profile failed: compile (RuntimeError: CUPTI unavailable)." in section
    assert "| 75.00 | 112 | matmul | `nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN` |" in section
    assert "`sm90_xmma_gemm_a/b`" in section  # a pipe would split the table cell
    assert "Top kernels" not in e2e.markdown(result, top_kernels=False)
    assert text.index("| model | provider | tokens/s |") < text.index("## Where the time goes")


def test_no_profile_section_without_profiles():
    result = _fake_result()
    for row in result["rows"]:
        row.pop("profile", None)
        row.pop("profile_error", None)
    assert "Where the time goes" not in e2e.markdown(result)


def test_profile_results_are_saved(tmp_path):
    paths = e2e.save(_fake_result(), tmp_path)
    saved = json.loads(paths[0].read_text())
    assert saved["rows"][0]["profile"]["categories"]["matmul"] == 75.0
    assert "Top kernels, llama, stock:" in paths[1].read_text()


def test_profile_flag_reaches_the_jobs():
    assert not any(job["profile_steps"] for job in e2e.jobs_for(e2e.parse_args(["--models", "qwen2"])))
    args = e2e.parse_args(["--models", "qwen2", "--providers", "stock", "tigon", "--profile"])
    assert [(j["provider"], j["profile_steps"]) for j in e2e.jobs_for(args)] == [
        ("stock", e2e.PROFILE_STEPS), ("tigon", e2e.PROFILE_STEPS)]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--longest-context", "--profile"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke test of the GPU benchmark")
def test_profile_pipeline_on_cpu(tmp_path, capsys):
    """One tiny tigon job through the worker with the profiler on (operators' self CPU time)."""
    argv = ["--device", "cpu", "--tiny", "--models", "llama", "--providers", "tigon", "--batch", "1",
            "--seq", "16", "--warmup", "0", "--steps", "1", "--profile", "--out", str(tmp_path)]
    assert e2e.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("| busy / wall |")  # the profile is printed last
    assert "Top kernels" not in printed
    (row,) = json.loads(next(tmp_path.glob("e2e-cpu-*.json")).read_text())["rows"]
    assert "error" not in row and "profile_error" not in row, (row.get("error"), row.get("profile_error"))
    profile = row["profile"]
    assert profile["activity"] == "cpu" and profile["steps"] == e2e.PROFILE_STEPS
    assert sum(profile["categories"].values()) == pytest.approx(profile["busy_ms"])
    assert profile["categories"]["matmul"] > 0 and profile["categories"]["optimizer"] > 0
    assert 0 < len(profile["top_kernels"]) <= e2e.TOP_KERNELS
    assert profile["wall_ms"] == pytest.approx(row["median_step_s"] * 1e3)
    assert len(row["losses"]) == 1  # the profiled steps are not among the timed ones
    assert "Top kernels, llama, tigon:" in next(tmp_path.glob("e2e-cpu-*.md")).read_text()
