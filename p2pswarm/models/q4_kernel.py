"""The native 4-bit matrix-vector kernel (``q4_gemv.c``): built on first use, loaded by ctypes.

Decode multiplies a few rows of activations by every weight once, so it is as fast as the
weight's bytes are few, if the kernel reads the packed 4-bit codes directly and vectorises.
PyTorch's wheels carry no such kernel for AVX2 or for aarch64, so the package ships one in
portable C and builds it with the system compiler (``$CC``, else ``cc``) for this CPU
(``-march=native``). The library is cached per user (``$XDG_CACHE_HOME/p2pswarm/kernels``,
else ``~/.cache/p2pswarm/kernels``) under a name keyed by the source, the compiler's version
and the CPU, written to a temporary file and renamed into place, so fellows starting at once
on one machine never load a half-written one; one that does not load is built again. Where
no compiler is found or the build fails, ``native()`` is None and the 4-bit linear keeps its
other kernel (one log line, never an error).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("p2pswarm.models")

SOURCE = Path(__file__).with_name("q4_gemv.c")
ABI_VERSION = 1  # q4_gemv.c's Q4_ABI_VERSION
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
GROUP_SIZES = (32, 64)
MAX_ROWS = 8  # q4_gemv.c's Q4_MAX_ROWS
# a thread wakes for no less than this many packed bytes: below it the wake-up costs more
# than the work (a time slice on a loaded machine)
MIN_CHUNK_BYTES = 64 * 1024
BUILD_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Q4Kernel:
    """The loaded library and where it came from."""

    library: ctypes.CDLL
    path: Path
    built: bool  # compiled by this load, not found in the cache

    @property
    def code(self) -> str:
        """Which of the C file's paths was compiled: "avx2" or "portable"."""
        name: bytes = self.library.q4_path()
        return name.decode()

    def gemv(self, packed: torch.Tensor, groups: int, in_features: int, group_size: int,
             x: torch.Tensor, threads: int) -> torch.Tensor:
        """``x`` (rows, in) float32 contiguous times the packed weight: (rows, groups * g)."""
        import torch  # here: the CLI hands this module its environment before torch loads

        rows = x.shape[0]
        # the C side trusts these: a wrong one would read past a buffer
        if (packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.device.type
                != "cpu" or packed.numel() != groups * in_features * (group_size // 2 + 4)
                or x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu"
                or x.shape != (rows, in_features) or not 1 <= rows <= MAX_ROWS
                or group_size not in GROUP_SIZES):
            raise ValueError(f"q4_gemv: {tuple(packed.shape)} {packed.dtype} weight, "
                             f"{tuple(x.shape)} {x.dtype} input, {groups} groups of "
                             f"{group_size}, {in_features} inputs do not match")
        y = torch.empty(rows, groups * group_size)
        status = self.library.q4_gemv(packed.data_ptr(), groups, in_features, group_size,
                                      x.data_ptr(), rows, y.data_ptr(), threads,
                                      MIN_CHUNK_BYTES)
        if status != 0:
            raise ValueError(f"q4_gemv refused {rows} rows in groups of {group_size}")
        return y


# ``CC`` and ``XDG_CACHE_HOME`` as the CLI hands them in (``use_environment``); the
# defaults where nothing was handed in (a library user, a test)
_environ: dict[str, str] = {}


def use_environment(environ: Mapping[str, str]) -> None:
    """Build with ``environ``'s ``CC`` and cache under its ``XDG_CACHE_HOME``."""
    global _environ
    _environ = {k: environ[k] for k in ("CC", "XDG_CACHE_HOME") if environ.get(k)}
    native.cache_clear()


def cache_dir() -> Path:
    base = _environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2pswarm" / "kernels"


def compiler() -> list[str]:
    """The C compiler's command: ``CC`` as a shell would split it, else ``cc``."""
    value = _environ.get("CC") or "cc"
    try:
        return shlex.split(value)
    except ValueError:  # unbalanced quotes: take it as one program's name
        return [value]


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and the CPU's model and features."""
    wanted = ("model name", "flags", "features", "cpu part", "cpu implementer", "isa")
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in wanted and key not in seen:
                    seen[key] = value.strip()
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(),
                      *(f"{k}={v}" for k, v in sorted(seen.items()))])


def _compiler_version(cc: list[str]) -> str | None:
    try:
        done = subprocess.run([*cc, "--version"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout else None


def library_name(source: bytes, version: str, flags: tuple[str, ...] = FLAGS) -> str:
    key = hashlib.sha256()
    for part in (source, version.encode(), _cpu_signature().encode(), " ".join(flags).encode()):
        key.update(hashlib.sha256(part).digest())
    return f"q4_gemv-{platform.machine()}-{key.hexdigest()[:24]}.so"


def _open(path: Path) -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(path))
        library.q4_abi_version.restype = ctypes.c_int
        if library.q4_abi_version() != ABI_VERSION:
            return None
    except (OSError, AttributeError):
        return None
    library.q4_path.restype = ctypes.c_char_p
    library.q4_gemv.restype = ctypes.c_int
    library.q4_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,
                                ctypes.c_int64]
    return library


def _build(cc: list[str], flags: tuple[str, ...], target: Path) -> str | None:
    """Compiles into ``target`` atomically; None, or why not."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([*cc, *flags, "-o", temp, str(SOURCE)], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout or f"exit status {done.returncode}").splitlines()
            return lines[0] if lines else f"exit status {done.returncode}"
        os.replace(temp, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def load(directory: Path | None = None, defines: tuple[str, ...] = ()) -> Q4Kernel | None:
    """The kernel from the cache, built there first if missing or broken; None (logged
    once per call) where it cannot be built. ``defines`` (``-DQ4_PORTABLE``: the portable
    C on any CPU) are for tests."""
    flags = (*FLAGS, *defines)
    cc = compiler()
    version = _compiler_version(cc)
    if version is None:
        log.info("4-bit native kernel off: no working C compiler (%s); using %s",
                 " ".join(cc), "fbgemm's bag kernel or the reference")
        return None
    try:
        target = (directory or cache_dir()) / library_name(SOURCE.read_bytes(), version, flags)
        if target.exists():
            library = _open(target)
            if library is not None:
                return Q4Kernel(library, target, built=False)
            target.unlink(missing_ok=True)  # stale or corrupt: build it again
        failed = _build(cc, flags, target)
    except (OSError, RuntimeError) as e:  # RuntimeError: no home directory to cache in
        failed = str(e)
    if failed is None:
        library = _open(target)
        if library is not None:
            return Q4Kernel(library, target, built=True)
        failed = "the built library does not load"
    log.info("4-bit native kernel off: building it failed (%s); using fbgemm's bag kernel "
             "or the reference", failed)
    return None


@functools.cache
def native() -> Q4Kernel | None:
    """The process's kernel, loaded once (None where it cannot be built)."""
    kernel = load()
    if kernel is not None:
        log.info("4-bit native kernel: %s path, %s %s", kernel.code,
                 "built into" if kernel.built else "found in", kernel.path)
    return kernel
