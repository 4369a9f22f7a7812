"""Benchmarks: a short real run on the CPU, the cache per hardware, the estimate flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pswarm.bench import BenchmarkCache, benchmarks_for, measure
from p2pswarm.cards import (
    ESTIMATED_FLOPS,
    Benchmark,
    Card,
    benchmarks_from_dict,
    benchmarks_to_dict,
    estimate,
    fingerprint,
)
from p2pswarm.cli.cards import quantized_linear
from p2pswarm.errors import ConfigError

CPU = Card(index=0, kind="cpu", name="Test CPU", uuid="cpu-test", total_bytes=16 * 10**9,
           free_bytes=8 * 10**9)
GPU = Card(index=0, kind="cuda", name="RTX 3090", uuid="GPU-aaaa", total_bytes=24 * 2**30,
           free_bytes=20 * 2**30)


def test_short_cpu_benchmark_measures_both_numbers() -> None:
    result = measure(CPU, seconds=0.1, quantized=quantized_linear)
    assert result.measured and result.dtype == "f32"
    assert result.flops > 1e6 and result.mem_bandwidth > 1e6
    assert result.fingerprint == fingerprint(CPU)
    assert result.seconds < 5
    # tokens/s of the reference linear in each serving weights dtype, through models.quant
    rates = dict(result.dtype_tokens_per_s)
    assert set(rates) == {"f16", "int8", "int4"} and all(r > 0 for r in rates.values())
    assert Benchmark.from_dict(result.to_dict()) == result
    # without the runtime's quantised linear handed in, f16 alone
    assert [d for d, _ in measure(CPU, seconds=0.1).dtype_tokens_per_s] == ["f16"]


def test_measure_refuses_a_silly_duration() -> None:
    with pytest.raises(ConfigError, match="--seconds"):
        measure(CPU, seconds=0)


def test_fingerprint_is_per_hardware() -> None:
    assert fingerprint(CPU) == fingerprint(Card(0, "cpu", "Test CPU", "cpu-test",
                                                16 * 10**9, 1))  # free memory is not hardware
    assert fingerprint(CPU) != fingerprint(GPU)
    assert len(fingerprint(GPU)) == 16


def test_never_benchmarked_gets_a_flagged_estimate() -> None:
    guess = estimate(GPU)
    assert not guess.measured and guess.flops == ESTIMATED_FLOPS["cuda"]


def test_cache_measures_on_demand_and_reuses(tmp_path: Path) -> None:
    calls: list[str] = []

    def fake_measure(card: Card, seconds: float) -> Benchmark:
        calls.append(card.key)
        return Benchmark(flops=1e12, mem_bandwidth=5e11, dtype="f16", measured=True,
                         fingerprint=fingerprint(card), seconds=seconds)

    cache = BenchmarkCache(tmp_path)
    cold = benchmarks_for([GPU, CPU], cache, measure_fn=fake_measure)
    assert not cold["cuda:0"].measured and calls == []  # nothing measured unless asked
    fresh = benchmarks_for([GPU], cache, rerun=True, seconds=0.5, measure_fn=fake_measure)
    assert fresh["cuda:0"].measured and calls == ["cuda:0"]
    stored = json.loads((tmp_path / "benchmarks.json").read_text())
    assert fingerprint(GPU) in stored["benchmarks"]
    warm = benchmarks_for([GPU, CPU], cache, measure_fn=fake_measure)
    assert warm["cuda:0"] == fresh["cuda:0"] and not warm["cpu:0"].measured
    assert calls == ["cuda:0"]


def test_a_broken_cache_file_says_how_to_fix(tmp_path: Path) -> None:
    (tmp_path / "benchmarks.json").write_text("{not json")
    with pytest.raises(ConfigError, match="p2pswarm bench"):
        BenchmarkCache(tmp_path).load()


def test_gossip_form_round_trips() -> None:
    benches = {"cuda:0": estimate(GPU), "cpu:0": Benchmark(2e11, 2e10, "f32", True, "ab", 2.0)}
    assert benchmarks_from_dict(benchmarks_to_dict(benches)) == benches
