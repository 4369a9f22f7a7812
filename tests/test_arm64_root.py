"""The arm64 root's commands and options (``p2pswarm.sim.arm64_root``) and the kernel
probe, without emulation: ``simulations/arm64.py`` runs the commands (minutes, as root);
these check what it would run, in milliseconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from p2pswarm.sim import arm64_root as a
from p2pswarm.sim.kernel_probe import probe

REPO = Path(__file__).resolve().parent.parent
ROOT = Path("/var/cache/p2pswarm-arm64/root")
DEBIAN_REGISTRATION = """enabled
interpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P
flags: PF
offset 0
magic 7f454c460201010000000000000000000200b700
"""


def test_defaults_are_a_pi_4_an_int8_load_and_a_root_under_the_cache(tmp_path: Path) -> None:
    opts = a.parse_options(["--cache", str(tmp_path)])
    assert opts.root == tmp_path / "root" and opts.wheelhouse == tmp_path / "wheels"
    assert (opts.weights_dtype, opts.cpu, opts.model) == ("int8", "cortex-a72", "demo-llama")
    assert opts.tokens == a.DEFAULT_TOKENS and opts.prompt_ids == a.DEFAULT_PROMPT_IDS
    assert not (opts.probe_only or opts.keep or opts.as_json)
    other = a.parse_options(["--root", str(tmp_path / "r"), "--weights-dtype", "int4",
                             "--tokens", "8", "--prompt-ids", "1, 2,3", "--cpu", "max",
                             "--probe-only", "--json"])
    assert other.root == tmp_path / "r" and other.prompt_ids == (1, 2, 3)
    assert other.probe_only and other.as_json and other.weights_dtype == "int4"


@pytest.mark.parametrize(("argv", "says"), [
    (["--tokens", "0"], "--tokens 0: use 1 to 256"),
    (["--weights-dtype", "q4"], "--weights-dtype q4: use one of f32, int8, int4"),
    (["--cpu", "cortex-a53"], "--cpu cortex-a53: use one of"),
    (["--prompt-ids", "1,x"], "--prompt-ids 1,x: comma-separated integers"),
    (["--prompt-ids", ","], "1 to 64 token ids"),
    (["--root", "/tmp/a root"], "letters, digits and ._/+- only"),
    (["--root", "/"], "its own directory"),
])
def test_a_bad_option_is_one_line_that_says_how_to_fix_it(argv: list[str], says: str) -> None:
    with pytest.raises(a.OptionError) as raised:
        a.parse_options(argv)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_the_script_answers_a_bad_option_with_one_line_and_status_2() -> None:
    run = subprocess.run([sys.executable, str(REPO / "simulations" / "arm64.py"), "--tokens",
                          "9999"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr == "error: --tokens 9999: use 1 to 256 (e.g. --tokens 16)\n"


def test_the_registration_says_whether_the_root_must_hold_the_emulator() -> None:
    assert a.interpreter_path(DEBIAN_REGISTRATION) == PurePosixPath(
        "/usr/libexec/qemu-binfmt/aarch64-binfmt-P")
    assert not a.needs_interpreter_in_root(DEBIAN_REGISTRATION)  # F: opened at registration
    unfixed = DEBIAN_REGISTRATION.replace("flags: PF", "flags: P")
    assert a.needs_interpreter_in_root(unfixed)  # no F: looked up inside the chroot
    assert a.interpreter_path("enabled\n") is None


def test_the_root_is_debians_arm64_bookworm_with_python() -> None:
    argv = a.debootstrap_command(ROOT)
    assert argv[:3] == ["nice", "-n", "10"] and "debootstrap" in argv
    assert "--arch=arm64" in argv and argv[-3:] == ["bookworm", str(ROOT), a.DEBIAN_MIRROR]
    include = next(x for x in argv if x.startswith("--include="))
    assert {"python3", "python3-venv", "python3-pip"} <= set(include[10:].split(","))
    assert a.host_packages_command()[-3:] == ["qemu-user-static", "binfmt-support",
                                              "debootstrap"]


def test_wheels_are_aarch64_binaries_for_the_roots_python_and_torch_is_pinned() -> None:
    wanted = a.requirements(["trio>=0.22", "torch>=2.5", "mcp>=2", "torchvision>=0.1"])
    assert wanted == ["trio>=0.22", f"torch=={a.TORCH_VERSION}", "mcp>=2", "torchvision>=0.1"]
    argv = a.download_command("/py", Path("/w"), wanted)
    assert argv[:4] == ["/py", "-m", "pip", "download"] and "--only-binary=:all:" in argv
    platforms = [argv[i + 1] for i, x in enumerate(argv) if x == "--platform"]
    assert all(p.endswith("_aarch64") for p in platforms)
    assert "manylinux_2_36_aarch64" in platforms and "manylinux_2_37_aarch64" not in platforms
    assert argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("-d") + 1] == "/w" and argv[-4:] == wanted


def test_the_roots_pip_installs_from_the_wheelhouse_only_under_qemu() -> None:
    argv = a.pip_install_command(ROOT, "p2pswarm-0.1.0-py3-none-any.whl")
    chroot = argv.index("chroot")
    assert argv[chroot + 1] == str(ROOT) and "env" in argv[:chroot] and "-i" in argv[:chroot]
    inside = argv[chroot + 2:]
    assert inside[:2] == ["/opt/p2pswarm/venv/bin/pip", "install"] and "--no-index" in inside
    assert inside[inside.index("--find-links") + 1] == str(a.WHEELS_IN_ROOT)
    assert inside[-1] == f"{a.WHEELS_IN_ROOT}/p2pswarm-0.1.0-py3-none-any.whl"
    again = a.reinstall_package_command(ROOT, "p.whl")
    assert "--no-deps" in again and "--force-reinstall" in again
    assert a.venv_command(ROOT)[-4:] == ["python3", "-m", "venv", "/opt/p2pswarm/venv"]


def test_mounts_give_the_root_proc_dev_and_the_wheelhouse() -> None:
    ms = a.mounts(ROOT, Path("/cache/wheels"))
    assert [m.target for m in ms] == [ROOT / "proc", ROOT / "dev",
                                      ROOT / "mnt" / "p2pswarm-wheels"]
    assert ms[0].argv == ("mount", "-t", "proc", "proc", str(ROOT / "proc"))
    assert ms[-1].argv == ("mount", "--bind", "/cache/wheels", str(ROOT / "mnt/p2pswarm-wheels"))
    assert all("--rbind" not in m.argv for m in ms)  # a plain bind unmounts alone


def test_the_aarch64_fellow_joins_chrooted_in_its_namespace_under_the_cpu_asked() -> None:
    home = ROOT / "tmp" / "run" / "f002"
    argv = a.join_command(ROOT, "p2s-1-2", listen="10.213.11.3:7782", name="arm64",
                          home=home, seeds=["10.213.11.1:7782"], preset="lan",
                          cpu="cortex-a72")
    assert argv[:4] == ["ip", "netns", "exec", "p2s-1-2"]
    assert "QEMU_CPU=cortex-a72" in argv and "OMP_NUM_THREADS=1" in argv
    chroot = argv.index("chroot")
    assert argv[chroot + 1:chroot + 5] == [str(ROOT), "/opt/p2pswarm/venv/bin/python", "-m",
                                          "p2pswarm.cli"]
    join = argv[chroot + 5:]
    assert join[:2] == ["join", "10.213.11.1:7782"]
    assert join[join.index("--home") + 1] == "/tmp/run/f002"  # the path inside the root
    assert join[join.index("--listen") + 1] == "10.213.11.3:7782"
    assert join[join.index("--http") + 1] == "off"
    assert not any("p2ps1-" in x or x == "--token" for x in argv)  # the token: environment
    x86 = a.host_join_command("/py", "p2s-1-0", listen="10.213.11.1:7782", name="x86-a",
                              home=Path("/h"), seeds=[], preset="lan", priority=20)
    assert x86[:5] == ["ip", "netns", "exec", "p2s-1-0", "/py"] and "chroot" not in x86
    assert x86[x86.index("--leader-priority") + 1] == "20"


def test_a_path_under_the_root_is_seen_from_inside() -> None:
    assert a.path_in_root(ROOT, ROOT / "tmp" / "x") == PurePosixPath("/tmp/x")
    with pytest.raises(ValueError):
        a.path_in_root(ROOT, Path("/elsewhere"))


def test_the_probe_runs_here_and_reports_each_kernel_against_f32() -> None:
    report = probe(64, 48, 32)
    kernels = report["kernels"]
    assert report["torch"] and report["quantized_engines"]
    assert kernels["f32"] == {"ok": True, "ms": kernels["f32"]["ms"], "error": 0.0}
    assert {"weight_int8pack_mm", "weight_int4pack_mm_for_cpu",
            "dyn_quant_matmul_4bit"} <= set(kernels)
    for name, k in kernels.items():  # each answers: runs with its error, or why not
        assert set(k) == ({"ok", "ms", "error"} if k["ok"] else {"ok", "error"}), name
    int8 = kernels["weight_int8pack_mm"]
    if int8["ok"]:
        assert int8["error"] < 0.02  # per-row int8: about 1/127 of the largest weight
    int4 = kernels["weight_int4pack_mm_for_cpu"]
    if int4["ok"]:
        assert int4["error"] < 0.2  # 4-bit groups of 32


def test_the_roots_sysfs_shows_the_emulated_cores_main_id_register() -> None:
    files = a.cpu_sysfs("cortex-a72", 2)
    assert files["sys/devices/system/cpu/online"] == "0-1\n"
    assert files["sys/devices/system/cpu/cpu1/regs/identification/midr_el1"] == (
        "0x00000000410fd083\n")  # ARM, part 0xd08 (Cortex-A72), r0p3
    assert a.cpu_sysfs("max", 1)["sys/devices/system/cpu/present"] == "0\n"
    assert set(a.MIDR_EL1) == set(a.CPU_MODELS)
