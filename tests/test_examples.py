"""The example scripts (examples/) run end to end with ``--tiny`` on the CPU (two gloo ranks for the torchrun
ones), and what they save is a stock transformers checkpoint of the tiny model's shape.

The scripts run without ``TRITON_INTERPRET`` in their environment (the test set-up's is removed): on a machine
without a GPU each script turns Triton's interpreter on itself (examples/common.py), as its docstring promises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600
TINY_ARGS = ["--tiny", "--seq", "16", "--steps", "2", "--batch", "2"]


def _run(script, out, *, ranks=None, extra=()):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    launcher = [sys.executable] if ranks is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port())]
    cmd = [*launcher, str(EXAMPLES / script), *TINY_ARGS, "--out", str(out), *extra]
    done = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _check_checkpoint(folder):
    """A plain transformers load of the saved model: the tiny Llama's keys and shapes, finite weights."""
    import transformers

    sys.path.insert(0, str(EXAMPLES))
    try:
        from common import TINY
    finally:
        sys.path.remove(str(EXAMPLES))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.device("meta"):
        stock = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    got = {k: tuple(v.shape) for k, v in loaded.state_dict().items()}
    assert got == {k: tuple(v.shape) for k, v in stock.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in loaded.state_dict().values())


@pytest.mark.parametrize("script, ranks", [
    ("train.py", None), ("train_trainer.py", None), ("dpo_trl.py", None),
    ("train_fsdp2.py", 2), ("train_tensor_parallel.py", 2),
])
def test_example_trains_and_saves_a_stock_checkpoint(tmp_path, script, ranks):
    if script == "dpo_trl.py":
        pytest.importorskip("trl", reason="examples/dpo_trl.py trains with TRL, which is not installed")
        pytest.importorskip("datasets", reason="examples/dpo_trl.py builds its data set with datasets, not installed")
    out = tmp_path / "trained"
    stdout = _run(script, out, ranks=ranks)
    assert "fused linear cross-entropy" in stdout  # Patch.replaced was printed: the model ran patched
    if script != "dpo_trl.py":
        assert "step 2" in stdout or "'loss'" in stdout
    _check_checkpoint(out)


def test_lora_example_trains_inside_the_nodes_and_saves_a_merged_checkpoint(tmp_path):
    """examples/sft_lora_trl.py: TRL's SFTTrainer with a LoRA peft_config, the patch after it (the adapters in the
    attention and MLP nodes, TRL's head kept), the long-context switches and keep_attention on, and the merged
    model saved as a stock checkpoint. (Its --qlora loads the base through bitsandbytes, as
    tests/patching/test_qlora_peft.py does.)"""
    pytest.importorskip("trl", reason="examples/sft_lora_trl.py trains with TRL, which is not installed")
    pytest.importorskip("peft", reason="examples/sft_lora_trl.py trains LoRA adapters with PEFT, not installed")
    out = tmp_path / "merged"
    stdout = _run("sft_lora_trl.py", out, extra=("--long", "--keep-attention", "--merge"))
    assert "LoRA adapters (r=16) of q_proj/k_proj/v_proj/o_proj run inside the attention node" in stdout
    assert "LoRA adapters (r=16) of gate_proj/up_proj/down_proj run inside the MLP node" in stdout
    assert "TRL's fused LM head" in stdout and "tiled_mlp" in stdout and "(keep_attention)" in stdout
    assert "'loss'" in stdout
    _check_checkpoint(out)


def test_kubernetes_job_runs_an_example():
    import yaml

    job = yaml.safe_load((EXAMPLES / "kubernetes" / "train-fsdp2-job.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    script = next(part for part in container["command"] if part.endswith(".py"))
    assert (ROOT / script).is_file()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--nproc_per_node" in container["command"]


def test_kubernetes_job_warms_the_triton_cache_of_its_training_container():
    """The init container runs `tigon warmup` for the training's model, batch and length, into a node-local
    emptyDir that the training container reads as its Triton cache at the same path."""
    import yaml

    from tigon.cli import build_parser

    spec = yaml.safe_load((EXAMPLES / "kubernetes" / "train-fsdp2-job.yaml").read_text())["spec"]["template"]["spec"]
    (init,), train = spec["initContainers"], spec["containers"][0]
    assert init["image"] == train["image"] and init["command"][:2] == ["tigon", "warmup"]
    warm = build_parser().parse_args(init["command"][1:])
    training = dict(zip(train["args"][::2], train["args"][1::2], strict=True))
    assert warm.model == training["--model"] and warm.autocast and warm.dtype == "bf16"  # as train_fsdp2.py trains
    assert warm.seq == [int(training["--seq"])] and warm.batch == int(training["--batch"])

    def cache_mount(container):
        env = {item["name"]: item.get("value") for item in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        return env["TRITON_CACHE_DIR"], mounts[env["TRITON_CACHE_DIR"]]

    assert cache_mount(init) == cache_mount(train)
    volume = next(v for v in spec["volumes"] if v["name"] == cache_mount(train)[1])
    assert "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory"
