"""The native 4-bit kernel (models/q4_gemv.c through models/q4_kernel.py): the reference's
numbers (dequantize, then F.linear) within float rounding, for shapes that are and are not
whole groups, at 1 to 8 rows, fused or not; the other kernels where it cannot be built;
and a library built once, then found in the cache."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from p2pswarm.models import q4_kernel
from p2pswarm.models.q4_kernel import Q4Kernel
from p2pswarm.models.quant import DequantWorkspace, Int4Linear, fuse

# (out, in, group): whole groups, padded outputs, a tiny input, a wide one
SHAPES = [(96, 128, 32), (100, 70, 32), (33, 5, 64), (200, 300, 64), (64, 1024, 32)]
# float32 sums in another order than F.linear's: a few units in the last place of the
# output's scale
TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="session")
def kernel(cache: Path) -> Q4Kernel:
    built = q4_kernel.load(cache)
    if built is None:
        pytest.skip("no C compiler here: the native kernel is off (the fallback is tested)")
    return built


@pytest.fixture(scope="session")
def portable(cache: Path, kernel: Q4Kernel) -> Q4Kernel:
    built = q4_kernel.load(cache, defines=("-DQ4_PORTABLE", "-DQ4_PORTABLE_HALF"))
    assert built is not None and built.code == "portable"
    return built


def _layer(out_f: int, in_f: int, group: int, kernel: str, seed: int = 0,
           workspace: DequantWorkspace | None = None
           ) -> tuple[Int4Linear, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_f, in_f, generator=g) * 0.05
    b = torch.randn(out_f, generator=g)
    workspace = workspace or DequantWorkspace(out_f * in_f, torch.float32, torch.device("cpu"))
    return Int4Linear.from_float(weight, b, workspace, group, kernel), b


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= TOLERANCE * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gives_the_dequantized_linear(kernel: Q4Kernel, portable: Q4Kernel,
                                                 shape: tuple[int, int, int]) -> None:
    out_f, in_f, group = shape
    layer, _ = _layer(out_f, in_f, group, "fbgemm")
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8):
        x = torch.randn(rows, in_f, generator=g)
        # the padding outputs too (fbgemm's rows of zeros do not unpack to exact zeros)
        want = F.linear(x, layer._unpacked(out_features=layer.groups * group))
        for built in (kernel, portable):
            for threads in (1, 2, 3):
                y = built.gemv(layer.packed, layer.groups, in_f, group, x, threads)
                assert _close(y, want), (built.code, rows, threads)


def test_threads_and_batches_do_not_change_a_rows_numbers(kernel: Q4Kernel) -> None:
    """A group is one thread's whatever the split, and a row takes the same operations
    whatever shares its batch: bit for bit the same."""
    layer, _ = _layer(1024, 1024, 32, "fbgemm")  # 32 groups of 20 KiB: several chunks
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(2))
    one = kernel.gemv(layer.packed, layer.groups, 1024, 32, x, 1)
    for threads in (2, 4):
        assert torch.equal(kernel.gemv(layer.packed, layer.groups, 1024, 32, x, threads), one)
    for r in range(8):
        assert torch.equal(kernel.gemv(layer.packed, layer.groups, 1024, 32, x[r:r + 1], 2),
                           one[r:r + 1])


def test_the_kernel_refuses_what_does_not_match(kernel: Q4Kernel) -> None:
    layer, _ = _layer(64, 32, 32, "fbgemm")
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="do not match"):
        kernel.gemv(layer.packed, layer.groups + 1, 32, 32, x, 1)  # would read past it
    with pytest.raises(ValueError, match="do not match"):
        kernel.gemv(layer.packed, layer.groups, 32, 32, torch.randn(9, 32), 1)
    with pytest.raises(ValueError, match="do not match"):
        kernel.gemv(layer.packed, layer.groups, 32, 32, x.double(), 1)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_a_native_linear_decodes_natively_and_prefills_by_unpacking(
        kernel: Q4Kernel, shape: tuple[int, int, int]) -> None:
    if q4_kernel.native() is None:
        pytest.skip("the process's kernel did not build")
    out_f, in_f, group = shape
    layer, bias = _layer(out_f, in_f, group, "native")
    assert layer.kernel == "native"
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows in (1, 3, 8, 40):
            x = torch.randn(1, rows, in_f, generator=g)
            want = F.linear(x, layer._unpacked(), bias)
            got = layer(x)
            assert got.shape == (1, rows, out_f) and _close(got, want), rows
            if rows <= 8:  # each row alone gives its batch's numbers
                alone = torch.cat([layer(x[:, r:r + 1]) for r in range(rows)], dim=1)
                assert torch.equal(alone, got)


def test_fused_native_linears_give_their_parts_numbers(kernel: Q4Kernel) -> None:
    if q4_kernel.native() is None:
        pytest.skip("the process's kernel did not build")
    workspace = DequantWorkspace(96 * 96, torch.float32, torch.device("cpu"))
    parts = [_layer(out_f, 96, 32, "native", i, workspace)[0]
             for i, out_f in enumerate((64, 32, 96))]
    fused = fuse(parts)
    assert isinstance(fused, Int4Linear) and fused.kernel == "native"
    assert fused.packed.numel() == sum(p.packed.numel() for p in parts)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for rows in (1, 3, 8, 40):
            x = torch.randn(1, rows, 96, generator=g)
            assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1)), rows


def test_without_a_compiler_the_other_kernels_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2pswarm.models")
    for cc in ("false", str(tmp_path / "no-such-cc")):
        monkeypatch.setattr(q4_kernel, "_environ", {"CC": cc})
        assert q4_kernel.load(tmp_path) is None
    assert len([r for r in caplog.records if "native kernel off" in r.message]) == 2
    monkeypatch.setattr(q4_kernel, "_environ", {})
    q4_kernel.use_environment({"CC": f"cc -include {tmp_path}/no-such-header.h",  # it fails
                               "HOME": "/elsewhere"})
    assert q4_kernel.compiler()[-1].endswith("no-such-header.h")
    if q4_kernel._compiler_version(q4_kernel.compiler()) is not None:
        assert q4_kernel.load(tmp_path) is None
        assert "building it failed" in caplog.records[-1].message
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".build-")] == []

    # a layer asking for the native kernel takes fbgemm's (or the reference) instead, with
    # the same numbers within 4-bit float rounding
    monkeypatch.setattr(q4_kernel, "native", lambda: None)
    layer, bias = _layer(100, 70, 32, "native")
    assert layer.kernel in ("fbgemm", "reference")
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(5))
    assert _close(layer(x), F.linear(x, layer._unpacked(), bias))


def test_a_second_load_uses_the_cached_library_and_a_broken_one_is_rebuilt(
        tmp_path: Path, cache: Path, kernel: Q4Kernel) -> None:
    first = q4_kernel.load(cache)  # the fixture built it
    assert first is not None and not first.built and first.path == kernel.path
    # the name is keyed by the source, compiler and CPU: another key, another file
    assert q4_kernel.library_name(b"other source", "cc 1") != first.path.name
    # a broken file under that name (never loaded: a loaded one is kept by the loader)
    other = tmp_path / "other"
    other.mkdir()
    (other / first.path.name).write_bytes(b"not a library")  # a truncated copy, say
    third = q4_kernel.load(other)
    assert third is not None and third.built and third.path == other / first.path.name
    assert [p.name for p in other.iterdir()] == [first.path.name]
