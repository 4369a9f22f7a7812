"""An arm64 Debian root on an x86 machine, and the commands that build it and run a
fellow in it (``simulations/arm64.py`` runs them).

Theory of operation. The kernel hands aarch64 programs to ``qemu-aarch64-static`` through
binfmt_misc, so a Debian root made by ``debootstrap --arch=arm64`` runs under ``chroot``
as if this were an arm64 machine: its Python, pip and the aarch64 wheels pip installs
(torch among them) are the ones a Raspberry Pi 4 on a 64-bit OS gets. Debian registers
the emulator with the ``F`` flag (opened once, at registration); a registration without
it makes the kernel look the interpreter up inside the chroot, so then the root carries a
copy of the emulator at the registered path.

Everything here is pure: paths and argument lists, so a test checks them in
milliseconds; the slow steps (minutes under emulation) are cached by the runner, each
behind a marker file in the root.

Where the wheels come from: the host's pip downloads them from the package registry for
the aarch64 platform (``--platform manylinux_2_X_aarch64 --only-binary=:all:``), which is
fast here, into a wheelhouse the root sees through a bind mount; the root's pip then
installs the package's wheel from that wheelhouse with ``--no-index``. The root has no
compiler, so a dependency without an aarch64 wheel fails the install instead of being
built from source: the same check a Pi's ``pip install`` makes.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DEBIAN_SUITE = "bookworm"  # Python 3.11, as the x86 fellows and the Docker image
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH_VERSION = "2.13.0"
PYTHON_TAG = "311"
# the Debian packages the root needs beyond debootstrap's minimal set
ROOT_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
HOST_PACKAGES = ("qemu-user-static", "binfmt-support", "debootstrap")
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
QEMU_STATIC = Path("/usr/bin/qemu-aarch64-static")
VENV_IN_ROOT = PurePosixPath("/opt/p2pswarm/venv")
WHEELS_IN_ROOT = PurePosixPath("/mnt/p2pswarm-wheels")
# Bookworm's glibc is 2.36: any manylinux tag up to it installs there
MANYLINUX_MINORS = range(17, 37)
# The Pi 4's core (no dot-product instructions) unless told otherwise; qemu's names, and
# the main ID register each reports (r0p3 A72, r4p1 A76 and N1; qemu's own for max)
MIDR_EL1 = {"cortex-a72": 0x410FD083, "cortex-a76": 0x414FD0B1, "neoverse-n1": 0x414FD0C1,
            "max": 0x000F0510}
CPU_MODELS = tuple(MIDR_EL1)
DEFAULT_CACHE = Path.home() / ".cache" / "p2pswarm-arm64"
# what the run checks: the shipped trained model (byte tokens), whose greedy text walks
# through the vocabulary where a random model's repeats one token; a few tokens keep it
# minutes under emulation
DEFAULT_MODEL = "demo-llama"
DEFAULT_TOKENS = 24
DEFAULT_PROMPT_IDS = (256, *b"Once upon a time")
MAX_TOKENS = 256
WEIGHTS_DTYPES = ("f32", "int8", "int4")
_MOUNT_SAFE = re.compile(r"^[A-Za-z0-9._/+-]+$")


@dataclass(frozen=True, slots=True)
class Arm64Options:
    """What one run of ``simulations/arm64.py`` does."""

    cache: Path  # the root, the wheelhouse and the logs live under it
    root: Path  # the arm64 Debian root
    model: str
    weights_dtype: str
    tokens: int
    prompt_ids: tuple[int, ...]
    cpu: str  # qemu's CPU model for the aarch64 fellow
    probe_only: bool  # build the root and probe its kernels; start no swarm
    keep: bool  # keep the fellows' homes and logs
    as_json: bool

    @property
    def wheelhouse(self) -> Path:
        return self.cache / "wheels"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simulations/arm64.py",
        description="An aarch64 fellow under emulation beside two x86 fellows: greedy "
                    "tokens of a quantized load against one x86 process.")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help=f"where the root and wheels are kept (default {DEFAULT_CACHE})")
    p.add_argument("--root", type=Path, default=None,
                   help="the arm64 Debian root (default CACHE/root)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a built-in model with weights (default {DEFAULT_MODEL})")
    p.add_argument("--weights-dtype", default="int8",
                   help=f"the load's weights: {', '.join(WEIGHTS_DTYPES)} (default int8)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"greedy tokens to compare (default {DEFAULT_TOKENS})")
    p.add_argument("--prompt-ids", default=",".join(map(str, DEFAULT_PROMPT_IDS)),
                   help="the prompt's token ids, comma-separated")
    p.add_argument("--cpu", default="cortex-a72",
                   help=f"qemu CPU model: {', '.join(CPU_MODELS)} (default cortex-a72, a Pi 4)")
    p.add_argument("--probe-only", action="store_true",
                   help="build the root and probe its quantized kernels; no swarm")
    p.add_argument("--keep", action="store_true", help="keep the fellows' homes and logs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


class OptionError(ValueError):
    """A bad argument: one line that says what is wrong and how to fix it."""


def parse_options(argv: Sequence[str]) -> Arm64Options:
    """The options of ``argv``; ``OptionError`` (one line) for a value out of range.
    argparse itself still exits 2 on an unknown flag."""
    args = parser().parse_args(list(argv))
    if args.weights_dtype not in WEIGHTS_DTYPES:
        raise OptionError(f"--weights-dtype {args.weights_dtype}: use one of "
                          f"{', '.join(WEIGHTS_DTYPES)}")
    if not 1 <= args.tokens <= MAX_TOKENS:
        raise OptionError(f"--tokens {args.tokens}: use 1 to {MAX_TOKENS} (e.g. --tokens 16)")
    if args.cpu not in CPU_MODELS:
        raise OptionError(f"--cpu {args.cpu}: use one of {', '.join(CPU_MODELS)}")
    try:
        prompt = tuple(int(x) for x in str(args.prompt_ids).split(",") if x.strip())
    except ValueError:
        raise OptionError(f"--prompt-ids {args.prompt_ids}: comma-separated integers, "
                          "e.g. --prompt-ids 256,72,101") from None
    if not prompt or len(prompt) > 64 or any(not 0 <= t < 1 << 20 for t in prompt):
        raise OptionError(f"--prompt-ids {args.prompt_ids}: 1 to 64 token ids, each "
                          "0 or more, e.g. --prompt-ids 256,72,101")
    cache = args.cache.expanduser().absolute()
    root = (args.root or cache / "root").expanduser().absolute()
    for path in (cache, root):
        if not _MOUNT_SAFE.match(str(path)):  # it goes into mount and chroot arguments
            raise OptionError(f"--root/--cache {path}: use a path of letters, digits "
                              "and ._/+- only")
    if root == Path("/"):
        raise OptionError("--root /: the arm64 root must be its own directory")
    return Arm64Options(cache=cache, root=root, model=args.model,
                        weights_dtype=args.weights_dtype, tokens=args.tokens,
                        prompt_ids=prompt, cpu=args.cpu, probe_only=args.probe_only,
                        keep=args.keep, as_json=args.json)


# --- the host ------------------------------------------------------------------------

def binfmt_mount_command() -> list[str]:
    return ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_DIR)]


def host_packages_command() -> list[str]:
    return ["apt-get", "install", "-y", "-q", "--no-install-recommends", *HOST_PACKAGES]


def interpreter_path(registration: str) -> PurePosixPath | None:
    """The interpreter a binfmt_misc registration (its file's text) names, or None."""
    for line in registration.splitlines():
        if line.startswith("interpreter "):
            return PurePosixPath(line.split(" ", 1)[1].strip())
    return None


def needs_interpreter_in_root(registration: str) -> bool:
    """Without the ``F`` (fix binary) flag the kernel opens the interpreter at exec time,
    from inside the chroot: the root must hold it at the same path."""
    for line in registration.splitlines():
        if line.startswith("flags:"):
            return "F" not in line.split(":", 1)[1]
    return True


# --- building the root ---------------------------------------------------------------

def debootstrap_command(root: Path, suite: str = DEBIAN_SUITE,
                        mirror: str = DEBIAN_MIRROR) -> list[str]:
    return ["nice", "-n", "10", "debootstrap", "--arch=arm64",
            f"--include={','.join(ROOT_PACKAGES)}", suite, str(root), mirror]


def platform_flags() -> list[str]:
    flags = []
    for minor in MANYLINUX_MINORS:
        flags += ["--platform", f"manylinux_2_{minor}_aarch64"]
    return flags + ["--platform", "manylinux2014_aarch64", "--platform", "linux_aarch64"]


def requirements(dependencies: Sequence[str], torch_version: str = TORCH_VERSION) -> list[str]:
    """The package's dependencies, torch pinned to the x86 fellows' version."""
    out = []
    for dep in dependencies:
        name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].strip()
        out.append(f"torch=={torch_version}" if name == "torch" else dep)
    return out


def download_command(python: str, wheelhouse: Path, wanted: Sequence[str]) -> list[str]:
    """The host's pip fetching aarch64 wheels of ``wanted`` and their dependencies."""
    return [python, "-m", "pip", "download", "--only-binary=:all:", *platform_flags(),
            "--python-version", PYTHON_TAG[0] + "." + PYTHON_TAG[1:], "--implementation",
            "cp", "--abi", f"cp{PYTHON_TAG}", "--abi", "abi3", "--abi", "none",
            "-d", str(wheelhouse), *wanted]


def wheel_command(python: str, source: Path, out: Path) -> list[str]:
    return [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
            str(out), str(source)]


def in_root(root: Path, *argv: str, cpu: str = "max") -> list[str]:
    """``argv`` run inside the root, under qemu's ``cpu`` model."""
    return ["env", "-i", f"QEMU_CPU={cpu}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8", "HOME=/root", "chroot", str(root), *argv]


def venv_command(root: Path) -> list[str]:
    return ["nice", "-n", "10", *in_root(root, "python3", "-m", "venv", str(VENV_IN_ROOT))]


def pip_install_command(root: Path, wheel_name: str) -> list[str]:
    """The root's pip installing the package's wheel and its dependencies, from the
    wheelhouse only."""
    pip = str(VENV_IN_ROOT / "bin" / "pip")
    return ["nice", "-n", "10", *in_root(
        root, pip, "install", "--no-index", "--find-links", str(WHEELS_IN_ROOT),
        "--no-compile", str(WHEELS_IN_ROOT / wheel_name))]


def reinstall_package_command(root: Path, wheel_name: str) -> list[str]:
    """Only the package again (its dependencies stay): a new wheel of the same version."""
    pip = str(VENV_IN_ROOT / "bin" / "pip")
    return ["nice", "-n", "10", *in_root(
        root, pip, "install", "--no-index", "--no-deps", "--force-reinstall", "--no-compile",
        str(WHEELS_IN_ROOT / wheel_name))]


@dataclass(frozen=True, slots=True)
class Mount:
    """One mount the root needs while something runs in it."""

    target: Path
    argv: tuple[str, ...]


def mounts(root: Path, wheelhouse: Path) -> list[Mount]:
    """/proc (psutil, torch's CPU count), /dev (urandom) and the wheelhouse, in the order
    to mount them (unmount in reverse). Plain binds, not recursive ones: unmounting a
    recursive bind of /dev can reach the host's own submounts where mounts propagate.
    /sys is not the host's: see ``cpu_sysfs``."""
    return [
        Mount(root / "proc", ("mount", "-t", "proc", "proc", str(root / "proc"))),
        Mount(root / "dev", ("mount", "--bind", "/dev", str(root / "dev"))),
        Mount(root / WHEELS_IN_ROOT.relative_to("/"),
              ("mount", "--bind", str(wheelhouse), str(root / WHEELS_IN_ROOT.relative_to("/")))),
    ]


def cpu_sysfs(cpu: str, n_cpus: int) -> dict[str, str]:
    """Files for the root's own /sys/devices/system/cpu (paths relative to the root): the
    CPUs and each one's MIDR_EL1, as an arm64 kernel shows them. The host's /sys is an x86
    one; torch's oneDNN (xbyak_aarch64) reads MIDR_EL1 from there at import and crashes
    (SIGSEGV under qemu) when it is missing."""
    base = "sys/devices/system/cpu"
    span = "0" if n_cpus == 1 else f"0-{n_cpus - 1}"
    files = {f"{base}/{name}": span + "\n" for name in ("online", "possible", "present")}
    for i in range(n_cpus):
        files[f"{base}/cpu{i}/regs/identification/midr_el1"] = f"0x{MIDR_EL1[cpu]:016x}\n"
    return files


# --- running in the root ------------------------------------------------------------

def path_in_root(root: Path, host_path: Path) -> PurePosixPath:
    """Where ``host_path`` (under ``root``) is seen from inside the chroot."""
    return PurePosixPath("/") / host_path.relative_to(root).as_posix()


def join_command(root: Path, namespace: str, *, listen: str, name: str, home: Path,
                 seeds: Sequence[str], preset: str, cpu: str, threads: int = 1,
                 cpu_memory: str = "4GB") -> list[str]:
    """The aarch64 fellow: ``p2pswarm join`` in network namespace ``namespace``, chrooted
    into ``root``, with its home ``home`` (a host path under the root). The token comes
    in the environment (``P2PSWARM_TOKEN``), which ``env`` passes through below."""
    python = str(VENV_IN_ROOT / "bin" / "python")
    inner = ["ip", "netns", "exec", namespace, "env", f"QEMU_CPU={cpu}",
             f"OMP_NUM_THREADS={threads}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
             "LANG=C.UTF-8", "HOME=/root", "chroot", str(root), python, "-m", "p2pswarm.cli",
             "join", *seeds, "--listen", listen, "--name", name, "--preset", preset,
             "--home", str(path_in_root(root, home)), "--cpu-memory", cpu_memory,
             "--http", "off", "--log-level", "info"]
    return inner


def host_join_command(python: str, namespace: str, *, listen: str, name: str, home: Path,
                      seeds: Sequence[str], preset: str, priority: int,
                      cpu_memory: str = "4GB") -> list[str]:
    """An x86 fellow in network namespace ``namespace``, from this checkout's package."""
    return ["ip", "netns", "exec", namespace, python, "-m", "p2pswarm.cli", "join", *seeds,
            "--listen", listen, "--name", name, "--preset", preset, "--home", str(home),
            "--leader-priority", str(priority), "--cpu-memory", cpu_memory,
            "--http", "off", "--log-level", "info"]


def probe_command(root: Path, cpu: str) -> list[str]:
    python = str(VENV_IN_ROOT / "bin" / "python")
    return ["nice", "-n", "10", *in_root(root, python, "-m", "p2pswarm.sim.kernel_probe",
                                         "--json", cpu=cpu)]


__all__ = ["CPU_MODELS", "DEBIAN_MIRROR", "DEBIAN_SUITE", "DEFAULT_CACHE", "DEFAULT_MODEL",
           "HOST_PACKAGES", "MIDR_EL1", "ROOT_PACKAGES", "TORCH_VERSION", "VENV_IN_ROOT",
           "WEIGHTS_DTYPES", "WHEELS_IN_ROOT",
           "Arm64Options", "Mount", "OptionError", "binfmt_mount_command",
           "cpu_sysfs", "debootstrap_command", "download_command", "host_join_command",
           "host_packages_command", "in_root", "interpreter_path", "join_command", "mounts",
           "needs_interpreter_in_root", "parse_options", "parser", "path_in_root",
           "pip_install_command", "platform_flags", "probe_command",
           "reinstall_package_command", "requirements", "venv_command", "wheel_command"]
