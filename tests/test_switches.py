"""The engine's switches (defaults.Switches): each documented environment variable sets its field as before."""

from __future__ import annotations

import pytest

from omlx_jobs.defaults import Switches
from omlx_jobs.worker.engine.config import EngineConfig


def test_unset_variables_keep_the_defaults() -> None:
    assert Switches.from_env({}) == Switches()
    s = Switches()
    assert s.cascade and s.ragged_decode and s.cascade_prefix_kernel and s.cpu_prefill
    assert (s.cascade_fused_prefill, s.cascade_fused_decode, s.cascade_compile) == ("auto", False, "auto")


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("OMLX_JOBS_CASCADE", "0", "cascade", False),
        ("OMLX_JOBS_CASCADE", "1", "cascade", True),
        ("OMLX_JOBS_RAGGED_DECODE", "0", "ragged_decode", False),
        ("OMLX_JOBS_CASCADE_PREFIX_KERNEL", "0", "cascade_prefix_kernel", False),
        ("OMLX_JOBS_CPU_PREFILL", "0", "cpu_prefill", False),
        ("OMLX_JOBS_CPU_PREFILL", "yes", "cpu_prefill", True),  # anything but 0 leaves it on, as before
        ("OMLX_JOBS_CASCADE_FUSED_PREFILL", "0", "cascade_fused_prefill", "never"),
        ("OMLX_JOBS_CASCADE_FUSED_PREFILL", "1", "cascade_fused_prefill", "always"),
        ("OMLX_JOBS_CASCADE_FUSED_PREFILL", "auto", "cascade_fused_prefill", "auto"),
        ("OMLX_JOBS_CASCADE_FUSED_DECODE", "1", "cascade_fused_decode", True),
        ("OMLX_JOBS_CASCADE_FUSED_DECODE", "yes", "cascade_fused_decode", False),  # on only with 1, as before
        ("OMLX_JOBS_CASCADE_COMPILE", "0", "cascade_compile", "never"),
        ("OMLX_JOBS_CASCADE_COMPILE", "1", "cascade_compile", "auto"),
    ],
)
def test_each_variable_sets_its_switch(variable: str, value: str, field: str, expected: object) -> None:
    assert getattr(Switches.from_env({variable: value}), field) == expected


def test_a_config_reads_the_environment_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMLX_JOBS_CPU_PREFILL", "0")
    config = EngineConfig()
    monkeypatch.delenv("OMLX_JOBS_CPU_PREFILL")
    assert config.switches.cpu_prefill is False and EngineConfig().switches.cpu_prefill is True
    assert EngineConfig(switches=Switches(cascade=False)).switches.cascade is False
