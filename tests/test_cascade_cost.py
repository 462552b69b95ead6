"""The cost model that decides, per prefix level, reference or copy (worker/attention/cascade_cost.py): pure, no MLX."""

from __future__ import annotations

from omlx_jobs.worker.attention.cascade_cost import (
    DeviceCosts,
    LevelUse,
    copy_cost,
    reference_cost,
    referenced_levels,
    references,
)

# Roughly an H200 with Qwen3-8B's shape today: a referenced level costs ~150 us a layer whatever its length,
# a token read once ~1.4 ns, a row's own token ~1.4 ns (the suffix kernel skips padding).
GPU = DeviceCosts(level_call_s=150e-6, level_token_s=1.4e-9, copy_token_s=1.4e-9, bytes_per_token=147_456)
# The CPU: calls are cheap next to reading keys, and the own suffixes are read padded to the longest.
CPU = DeviceCosts(level_call_s=5e-6, level_token_s=2e-9, copy_token_s=2e-9, padded=True)
# The CPU as calibrate.cpu_costs estimates it for SmolLM2 (9 heads of 64) and the tiny test model (4 of 16).
SMOLLM2 = DeviceCosts(150e-6, 0.0, 46e-9, True, 0, 11.5e-9)
TINY = DeviceCosts(150e-6, 0.0, 5.1e-12, True, 0, 1.3e-12)


def test_short_levels_and_few_sharers_are_copied_long_shared_ones_referenced() -> None:
    # 8 system prompts of 300 tokens, 16 rows each, at batch 128: copies read 16 x 300 tokens more, far below a call.
    assert not references(LevelUse(300, 16), 128, GPU)
    # One 3,000-token preamble for 128 rows: 128 x 3,000 reads against one.
    assert references(LevelUse(3000, 128), 128, GPU)
    # The same length shared by 2 rows of a batch of 8 is copied; by many rows referenced.
    assert not references(LevelUse(3000, 2), 8, GPU)
    assert references(LevelUse(3000, 64), 128, GPU)


def test_the_choice_follows_the_costs_it_is_given() -> None:
    level = LevelUse(300, 16)
    assert reference_cost(level, GPU) > copy_cost(level, 128, GPU)
    # On the CPU the copies are read by all 128 padded rows: the reference wins the same level.
    assert copy_cost(level, 128, CPU) == 128 * 300 * 2e-9
    assert references(level, 128, CPU)
    assert references(level, 128, DeviceCosts.always_reference())
    assert not references(level, 128, DeviceCosts.always_copy())


def test_on_the_cpu_referenced_rows_still_compute_each_token() -> None:
    """Compute-bound: a reference saves only the padded rows' work and the rows' own matrix-vector products."""
    assert reference_cost(LevelUse(300, 8), SMOLLM2) == 150e-6 + 300 * 8 * 11.5e-9
    assert references(LevelUse(300, 8), 64, SMOLLM2)  # 8 system prompts x 8 requests at batch 64
    assert references(LevelUse(2100, 64), 64, SMOLLM2)  # the shared document of 64 questions
    assert not references(LevelUse(75, 4), 32, TINY)  # the tiny model's short levels: cheaper copied


def test_a_live_level_is_referenced_its_call_is_paid() -> None:
    assert not references(LevelUse(300, 1), 128, GPU)
    assert references(LevelUse(300, 1, live=True), 128, GPU)
    assert reference_cost(LevelUse(300, 1, live=True), GPU) == 300 * GPU.level_token_s


def test_copies_past_the_memory_limit_are_referenced() -> None:
    # 2 rows over a 3,000-token level would be copied, but padding the batch of 128 to it takes 56 GB.
    assert references(LevelUse(3000, 2), 128, GPU, limit=8 * 1024**3)
    assert not references(LevelUse(3000, 2), 128, GPU, limit=10**12)
    assert not references(LevelUse(3000, 2), 128, DeviceCosts(150e-6, 1.4e-9, 1.4e-9))  # no byte count: no limit


def test_a_row_references_a_prefix_of_its_chain() -> None:
    system, doc = LevelUse(3000, 128), LevelUse(300, 16)
    assert referenced_levels([system, doc], 128, GPU) == 1  # the preamble referenced, the short document copied
    assert referenced_levels([doc, system], 128, GPU) == 0  # a copied level ends the references
    assert referenced_levels([system, LevelUse(2000, 32)], 128, GPU) == 2
    assert referenced_levels([], 128, GPU) == 0


def test_the_choice_is_a_pure_function() -> None:
    levels = [LevelUse(n, r) for n in (40, 400, 4000) for r in (1, 8, 64)]
    first = [references(lv, 64, GPU) for lv in levels]
    assert first == [references(lv, 64, GPU) for lv in levels]
    assert any(first) and not all(first)


def test_the_calibration_measures_costs_the_model_can_compare() -> None:
    """A tiny shape measured on the CPU (what a GPU runs at start-up): finite, non-negative costs; the CPU itself
    uses its estimated costs."""
    import mlx.core as mx  # MLX only for this test: the rest of the module is pure

    from omlx_jobs.worker.attention import calibrate
    from omlx_jobs.worker.attention.options import CascadeOptions

    costs = calibrate.measure(CascadeOptions(), heads=4, kv_heads=2, dim=16, dtype=mx.float32, batch=4)
    assert all(0.0 <= c < 1.0 for c in (costs.level_call_s, costs.level_token_s, costs.copy_token_s))
    assert costs.padded  # no suffix kernel: mx ops over padded rows
    cpu = calibrate.device_costs(CascadeOptions(), heads=4, kv_heads=2, dim=16, dtype=mx.float32, batch=4, layers=2)
    assert cpu == calibrate.cpu_costs(4, 16, 2 * 2 * 2 * 16 * 4)
