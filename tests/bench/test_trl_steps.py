"""``benchmarks/trl_steps.py`` without a GPU: the longest-length search, and one tiny DPO and GRPO step
run in-process for TRL's head and tigon's, whose losses, gradient norms and entropies must agree."""

import pytest

from tests.helpers import DEVICE

pytest.importorskip("trl")
pytest.importorskip("datasets")
from benchmarks import trl_steps  # noqa: E402


@pytest.mark.parametrize("limit", [0, 16384, 16385, 20000, 57344, 59392, 60000, 100000, 131072, 200000])
@pytest.mark.parametrize("start", [16384, 57344, 131072])
def test_search_longest_finds_the_largest_fitting_multiple(limit, start):
    probed = []

    def probe(length):
        probed.append(length)
        return length <= limit

    longest, first_fail = trl_steps.search_longest(probe, start=start, minimum=16384, maximum=131072,
                                                   coarse=4096, fine=1024)
    want = 0 if limit < 16384 else min(limit, 131072) // 1024 * 1024
    assert longest == want, (longest, probed)
    if limit >= 131072:
        assert first_fail is None
    else:
        assert first_fail == (16384 if want == 0 else want + 1024)
    assert len(probed) == len(set(probed)) and len(probed) <= 12, probed
    assert all(16384 <= p <= 131072 and p % 1024 == 0 for p in probed)


def test_search_from_near_trl_figure_is_short():
    """From the default start, TRL's published 59,392 is found in four probes."""
    probed = []
    longest, _ = trl_steps.search_longest(lambda n: probed.append(n) or n <= 59392, start=trl_steps.LONGEST_START,
                                          minimum=16384, maximum=131072, coarse=4096, fine=1024)
    assert longest == 59392 and len(probed) == 4, probed


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_tiny_step_agrees_between_providers(trainer, padded):
    job = dict(model="llama", trainer=trainer, device=DEVICE.type, tiny=True, weights="fp32", attention="sdpa",
               patch_ref=True, checkpointing=False, rows=4, prompt=4, completion=8, warmup=0, steps=2, padded=padded)
    rows = [trl_steps.run_job({**job, "provider": p}) for p in ("trl", "tigon")]
    if trainer == "dpo":
        width = rows[0]["batch_shapes"]["input_ids"][1]
        assert rows[0]["batch_shapes"]["input_ids"] == [4, width] and rows[0]["tokens_per_step"] == 4 * width
        assert width <= 12 if padded else width == 12  # padded: to the longest row
    else:
        assert rows[0]["batch_shapes"]["completion_ids"] == [4, 8] and len(rows[0]["entropies"]) == 2
        assert rows[0]["tokens_per_step"] == 4 * 12
    real = rows[0]["real_tokens_per_step"]
    assert real < rows[0]["tokens_per_step"] if padded else real == rows[0]["tokens_per_step"]
    assert rows[1]["real_tokens_per_step"] == real  # the same batch for both providers
    trl_steps.add_agreement(rows)
    assert rows[1]["agrees"], rows[1]
    assert rows[1]["grad_norm_diff"] <= 1e-3  # fp32 weights: tighter than the bf16 bound
