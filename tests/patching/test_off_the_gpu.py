"""A model patched on the CPU without Triton's interpreter: a warning at patch time saying how to run it, and a
ValueError (not Triton's own error) at its first forward. Run in a process without ``TRITON_INTERPRET``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import warnings
    import transformers
    import tigon

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tigon.patch(model)
    print("WARNING:", " | ".join(str(w.message) for w in caught if "tigon" in str(w.message)))
    ids = __import__("torch").randint(3, 64, (1, 5))
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as err:
        print("ERROR:", err)
''')


def test_a_model_patched_on_the_cpu_without_the_interpreter_is_told_how_to_run():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    warning = out.stdout.split("WARNING:", 1)[1].splitlines()[0]
    assert "is on the cpu device" in warning and "model.to('cuda')" in warning and "TRITON_INTERPRET=1" in warning
    assert "ERROR:" in out.stdout and "cuda" in out.stdout.split("ERROR:", 1)[1].lower()
