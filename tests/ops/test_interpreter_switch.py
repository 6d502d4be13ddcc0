"""Triton's interpreter switched on after ``triton.language`` was imported (a script that imports bitsandbytes,
through PEFT or transformers' quantizers, before it sets ``TRITON_INTERPRET=1``): tigon's kernels still run, their
calls of Triton's standard library (``tl.sum``, ``tl.max``) interpreted too. In a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path (no GPU)")

SCRIPT = textwrap.dedent('''
    import os
    import triton.language as tl              # as bitsandbytes imports it, the interpreter still off
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tigon.ops import rms_norm

    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    x.requires_grad_()
    y = rms_norm(x, w, 1e-6)
    y.sum().backward()
    want = torch.nn.functional.rms_norm(x.detach(), (40,), w, 1e-6)
    print(type(tl.sum).__name__, float((y - want).abs().max()), bool(torch.isfinite(x.grad).all()))
''')


def test_kernels_run_when_triton_language_was_imported_before_the_switch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, err, finite = done.stdout.split()
    assert kind == "InterpretedFunction" and float(err) <= 1e-6 and finite == "True"
