"""An aarch64 fellow under emulation beside two x86 fellows: a quantized load across all
three, its greedy tokens against one x86 process of the same dtype.

    sudo python simulations/arm64.py [--weights-dtype int8] [--tokens 16] [--json]
    sudo python simulations/arm64.py --probe-only     # build the root, probe its kernels

What it does, each slow step cached under --cache (default ~/.cache/p2pswarm-arm64):
1. binfmt_misc mounted, qemu-user-static, binfmt-support and debootstrap installed (apt);
2. an arm64 Debian root (``debootstrap --arch=arm64 bookworm``; its second stage runs
   under qemu: many minutes the first time);
3. a wheel of this checkout (``pip wheel --no-deps``) and aarch64 wheels of its
   dependencies from the package registry (torch pinned to the x86 version), installed
   by the root's own pip into a venv, from that wheelhouse only (no compiler there);
4. a probe of the root's torch: quantized engines and kernels (``p2pswarm.sim.kernel_probe``);
5. the reference: one x86 fellow on loopback loads the model in one stage with the same
   dtypes and generates greedy tokens;
6. three fellows in network namespaces on one bridge (``p2pswarm.sim.netns``): two x86
   ``join`` processes and one aarch64 ``join`` chrooted into the root, under qemu's
   ``--cpu`` model (a Pi 4's Cortex-A72 by default); a load of three stages, one per
   fellow, then the same greedy generation. The verdict: the tokens are equal.

It proves correctness, not speed: under emulation the aarch64 stage runs tens of times
slower than on a real core. Needs root (chroot, mounts, namespaces) on an x86-64 Linux.
Exit status: 0 equal, 1 not equal, inconclusive (the aarch64 fellow held no stage, or
the text repeats a token or three) or a step failed, 2 a bad argument.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2pswarm.sim import arm64_root as a  # noqa: E402

Say = Callable[[str], None]
JOIN_TIMEOUT_S = 900.0  # the aarch64 agent imports torch under qemu before it answers
LOAD_TIMEOUT_S = 1800.0
GENERATE_TIMEOUT_S = 1800.0
LOAD_ATTEMPTS = 3
PRESET = "lan"


class StepFailed(Exception):
    """A step that did not work, with what to look at."""


def run(argv: Sequence[str], *, log: Path | None = None, timeout_s: float = 3600.0,
        env: dict[str, str] | None = None) -> str:
    """``argv``'s stdout; its output also goes to ``log`` when given."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                          env=env, check=False)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise StepFailed(f"{' '.join(argv[:8])} ... failed ({proc.returncode}):\n{tail}")
    return proc.stdout


class Steps:
    """What the run did: each step's name, seconds and whether it was cached."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.done: list[dict[str, Any]] = []

    @contextmanager
    def step(self, name: str, cached: bool = False) -> Iterator[None]:
        self.say(f"{name}{' (cached)' if cached else ' ...'}")
        t0 = time.monotonic()
        yield
        seconds = round(time.monotonic() - t0, 1)
        self.done.append({"step": name, "seconds": seconds, "cached": cached})
        if not cached:
            self.say(f"  done in {seconds:g} s")


# --- the host and the root -------------------------------------------------------------

def ensure_host(steps: Steps, opts: a.Arm64Options) -> None:
    if not (a.BINFMT_DIR / "register").exists():
        with steps.step("mount binfmt_misc"):
            run(a.binfmt_mount_command())
    missing = [p for p, tool in (("qemu-user-static", a.QEMU_STATIC),
                                 ("debootstrap", Path("/usr/sbin/debootstrap")))
               if not tool.exists()]
    if missing or not (a.BINFMT_DIR / "qemu-aarch64").exists():
        with steps.step("apt-get install " + " ".join(a.HOST_PACKAGES)):
            run(["apt-get", "update", "-q"], log=opts.cache / "apt.log")
            run(a.host_packages_command(), log=opts.cache / "apt.log")
            if not (a.BINFMT_DIR / "qemu-aarch64").exists():
                run(["update-binfmts", "--enable", "qemu-aarch64"], log=opts.cache / "apt.log")


def ensure_root(steps: Steps, opts: a.Arm64Options) -> None:
    marker = opts.root / ".p2pswarm-debootstrap-done"
    if marker.exists():
        with steps.step(f"arm64 Debian root {opts.root}", cached=True):
            return
    registration = (a.BINFMT_DIR / "qemu-aarch64").read_text()
    interpreter = a.interpreter_path(registration)
    if a.needs_interpreter_in_root(registration) and interpreter is not None:
        inside = opts.root / interpreter.relative_to("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(a.QEMU_STATIC, inside)
    with steps.step(f"debootstrap --arch=arm64 {a.DEBIAN_SUITE} into {opts.root} "
                    "(second stage under qemu: many minutes)"):
        run(a.debootstrap_command(opts.root), log=opts.cache / "debootstrap.log")
        marker.write_text(a.DEBIAN_SUITE + "\n")


def package_wheel(steps: Steps, opts: a.Arm64Options) -> Path:
    """This checkout's wheel, in the wheelhouse."""
    out = opts.cache / "dist"
    shutil.rmtree(out, ignore_errors=True)
    with steps.step("pip wheel --no-deps . (this checkout)"):
        run(a.wheel_command(sys.executable, REPO, out), log=opts.cache / "wheel.log")
    (wheel,) = out.glob("p2pswarm-*.whl")
    opts.wheelhouse.mkdir(parents=True, exist_ok=True)
    for old in opts.wheelhouse.glob("p2pswarm-*.whl"):
        old.unlink()
    return Path(shutil.copy2(wheel, opts.wheelhouse / wheel.name))


def ensure_wheelhouse(steps: Steps, opts: a.Arm64Options) -> None:
    deps = dependencies((REPO / "pyproject.toml").read_text())
    wanted = a.requirements(deps)
    key = hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
    marker = opts.wheelhouse / f".downloaded-{key}"
    if marker.exists():
        with steps.step("aarch64 wheels of the dependencies", cached=True):
            return
    opts.wheelhouse.mkdir(parents=True, exist_ok=True)
    with steps.step("pip download the dependencies' aarch64 wheels (torch "
                    f"{a.TORCH_VERSION})"):
        run(a.download_command(sys.executable, opts.wheelhouse, wanted),
            log=opts.cache / "download.log")
        marker.write_text("\n".join(wanted) + "\n")


def dependencies(pyproject: str) -> list[str]:
    """The ``[project]`` dependencies of a pyproject.toml's text (tomllib is 3.11+)."""
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    if block is None:
        raise StepFailed("pyproject.toml has no [project] dependencies list")
    return re.findall(r'"([^"]+)"', block.group(1))


@contextmanager
def root_mounts(opts: a.Arm64Options) -> Iterator[None]:
    """The root's /proc, /dev and wheelhouse, unmounted again on the way out (only those
    this run mounted), and its own CPU files in /sys for the qemu CPU asked."""
    mounted: list[Path] = []
    if os.path.ismount(opts.root / "sys"):
        raise StepFailed(f"{opts.root / 'sys'} is a mount; unmount it (umount "
                         f"{opts.root / 'sys'}): the root needs its own CPU files there")
    for rel, text in a.cpu_sysfs(opts.cpu, os.cpu_count() or 1).items():
        (opts.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (opts.root / rel).write_text(text)
    try:
        for m in a.mounts(opts.root, opts.wheelhouse):
            if os.path.ismount(m.target):
                continue
            m.target.mkdir(parents=True, exist_ok=True)
            run(m.argv)
            mounted.append(m.target)
        yield
    finally:
        for target in reversed(mounted):
            run(["umount", "-l", str(target)])


def wheel_digest(wheel: Path) -> str:
    """A digest of what the wheel holds: its RECORD (each file's hash), not the zip's bytes,
    which carry the build's timestamps, so an unchanged checkout is not installed again."""
    with zipfile.ZipFile(wheel) as z:
        (record,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        return hashlib.sha256(z.read(record)).hexdigest()


def ensure_venv(steps: Steps, opts: a.Arm64Options, wheel: Path) -> None:
    venv = opts.root / a.VENV_IN_ROOT.relative_to("/")
    if not (venv / "bin" / "python").exists():
        with steps.step("python3 -m venv in the root (under qemu)"):
            run(a.venv_command(opts.root), log=opts.cache / "venv.log")
    deps_marker = venv / ".p2pswarm-deps-installed"
    wheel_marker = venv / ".p2pswarm-wheel-sha256"
    digest = wheel_digest(wheel)
    if not deps_marker.exists():
        with steps.step("pip install the wheel and its aarch64 dependencies in the root "
                        "(under qemu: minutes)"):
            run(a.pip_install_command(opts.root, wheel.name), log=opts.cache / "pip.log")
            deps_marker.write_text("ok\n")
            wheel_marker.write_text(digest + "\n")
    elif wheel_marker.exists() and wheel_marker.read_text().strip() == digest:
        with steps.step("this checkout's wheel in the root", cached=True):
            pass
    else:
        with steps.step("pip install this checkout's new wheel in the root"):
            run(a.reinstall_package_command(opts.root, wheel.name), log=opts.cache / "pip.log")
            wheel_marker.write_text(digest + "\n")


def probe_root(steps: Steps, opts: a.Arm64Options) -> dict[str, Any]:
    with steps.step(f"probe the aarch64 torch's quantized kernels (qemu cpu {opts.cpu})"):
        out = run(a.probe_command(opts.root, opts.cpu), log=opts.cache / "probe.log",
                  timeout_s=1800)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- the swarms ------------------------------------------------------------------------

def cli(home: Path, *args: str, timeout_s: float) -> dict[str, Any]:
    out = run([sys.executable, "-m", "p2pswarm.cli", *args, "--home", str(home), "--json"],
              timeout_s=timeout_s)
    return json.loads(out)  # type: ignore[no-any-return]


def load_args(opts: a.Arm64Options, stages: int) -> list[str]:
    return ["load", opts.model, "--stages", str(stages), "--weights-dtype", opts.weights_dtype,
            "--kv-dtype", "f32", "--context", "128"]


def generate_args(opts: a.Arm64Options) -> list[str]:
    return ["generate", "--prompt-ids", ",".join(map(str, opts.prompt_ids)),
            "--max-tokens", str(opts.tokens)]


def reference(steps: Steps, opts: a.Arm64Options, say: Say) -> dict[str, Any]:
    """One x86 fellow on loopback: the model in one stage, the same dtypes."""
    from p2pswarm.sim.processes import local_swarm

    with steps.step("the reference: one x86 process, one stage"), \
            local_swarm(lambda line: None, keep=opts.keep, threads=1) as swarm:
        swarm.start("x86-reference", extra=("--log-level", "warning", "--http", "off"))
        swarm.wait_formed(["x86-reference"])
        home = swarm.homes["x86-reference"]
        cli(home, *load_args(opts, 1), timeout_s=600)
        t0 = time.monotonic()
        got = cli(home, *generate_args(opts), timeout_s=600)
        got["wall_s"] = round(time.monotonic() - t0, 2)
        return got


def mixed_swarm(steps: Steps, opts: a.Arm64Options, say: Say) -> dict[str, Any]:
    """Two x86 fellows and the aarch64 one, each in its network namespace."""
    from p2pswarm.sim.netns import Netns
    from p2pswarm.sim.profiles import profile

    tag = f"{os.getpid() % 100000:05d}"
    work = opts.root / "tmp" / f"p2pswarm-arm64-{tag}"  # under the root: the chroot sees it
    names = ["x86-a", "x86-b", "arm64"]
    result: dict[str, Any] = {}
    try:
        with Netns(3, [profile("wired")] * 3, [20, 10, 0], work, tag) as net:
            token = net.init_swarm()
            env = {**os.environ, "P2PSWARM_TOKEN": token, "OMP_NUM_THREADS": "1"}
            seed = net.fellows[0].addr
            logs = []
            for f, name in zip(net.fellows, names):
                f.home.mkdir(parents=True, exist_ok=True)
                if name == "arm64":
                    argv = a.join_command(opts.root, f.ns, listen=f.addr, name=name,
                                          home=f.home, seeds=[seed], preset=PRESET,
                                          cpu=opts.cpu)
                    argv = ["nice", "-n", "10", *argv]
                else:
                    argv = a.host_join_command(sys.executable, f.ns, listen=f.addr, name=name,
                                               home=f.home, seeds=[] if f.index == 0 else [seed],
                                               preset=PRESET, priority=f.priority)
                log = open(work / f"{name}.log", "ab")
                logs.append(log)
                # the root's Python imports only what the root's venv holds
                own_env = {k: v for k, v in env.items()
                           if name != "arm64" or k not in ("PYTHONPATH", "VIRTUAL_ENV")}
                f.proc = subprocess.Popen(argv, stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=own_env)
            with steps.step("three fellows join (the aarch64 one imports torch under qemu)"):
                _wait_formed(net, names, work)
            home = net.fellows[0].home
            with steps.step(f"load {opts.model} in 3 stages, weights {opts.weights_dtype}"):
                result["load_refusals"] = []
                loaded = _load(home, opts, say, result["load_refusals"])
            result["stages"] = [{"stage": s.get("stage"), "fellow": s.get("fellow"),
                                 "layers": s.get("layers")} for s in loaded.get("stages", [])]
            with steps.step(f"generate {opts.tokens} greedy tokens across the three"):
                t0 = time.monotonic()
                got = cli(home, *generate_args(opts), timeout_s=GENERATE_TIMEOUT_S)
                got["wall_s"] = round(time.monotonic() - t0, 2)
            result["generated"] = got
            for log in logs:
                log.close()
        result["leftovers"] = net.leftovers()
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _load(home: Path, opts: a.Arm64Options, say: Say, refusals: list[str]
          ) -> dict[str, Any]:
    """The load's record; each refused try's reason goes to ``refusals``. An emulated
    agent on a busy machine can miss the 30 s a stage order waits (``order_timeout_s``);
    a refused load releases everything, so asking again is safe."""
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            return cli(home, *load_args(opts, 3), timeout_s=LOAD_TIMEOUT_S)
        except StepFailed as e:
            if "no answer to" not in str(e) or attempt == LOAD_ATTEMPTS:
                raise
            refusals.append(str(e).splitlines()[-1])
            say(f"  try {attempt} refused (a slow emulated answer): {refusals[-1]}")
    raise AssertionError("unreachable")


def _wait_formed(net: Any, names: list[str], work: Path) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        seen = []
        for f, name in zip(net.fellows, names):
            if f.proc is not None and f.proc.poll() is not None:
                tail = (work / f"{name}.log").read_text(errors="replace")[-1500:]
                raise StepFailed(f"fellow {name} exited with {f.proc.returncode}:\n{tail}")
            status = net.status(f.index)
            seen.append(status is not None and status.get("leader") is not None and sum(
                m["state"] == "alive" for m in status.get("members", [])) == len(names))
        if all(seen):
            return
        if time.monotonic() > deadline:
            raise StepFailed(f"the three fellows did not form within {JOIN_TIMEOUT_S:g} s "
                             f"(logs in {work}; --keep keeps them)")
        time.sleep(1.0)


# --- the run ---------------------------------------------------------------------------

def missing_requirements() -> str | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "this runs on x86-64 Linux (it emulates the aarch64 fellow)"
    if os.geteuid() != 0:
        return "this needs root (chroot, mounts, network namespaces): run it with sudo"
    if shutil.which("ip") is None or shutil.which("nft") is None:
        return "this needs `ip` and `nft` (apt-get install iproute2 nftables)"
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str]) -> int:
    try:
        opts = a.parse_options(argv)
    except a.OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why_not = missing_requirements()
    if why_not is not None:
        print(f"error: {why_not}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds through the unmounts and tear-down
    say: Say = (lambda m: None) if opts.as_json else (lambda m: print(m, flush=True))
    opts.cache.mkdir(parents=True, exist_ok=True)
    steps = Steps(say)
    report: dict[str, Any] = {"model": opts.model, "weights_dtype": opts.weights_dtype,
                              "tokens": opts.tokens, "qemu_cpu": opts.cpu,
                              "root": str(opts.root)}
    t0 = time.monotonic()
    try:
        ensure_host(steps, opts)
        ensure_root(steps, opts)
        ensure_wheelhouse(steps, opts)
        wheel = package_wheel(steps, opts)
        with root_mounts(opts):
            ensure_venv(steps, opts, wheel)
            report["aarch64_torch"] = probe_root(steps, opts)
            if not opts.probe_only:
                report["reference"] = reference(steps, opts, say)
                report["mixed"] = mixed_swarm(steps, opts, say)
    except KeyboardInterrupt:
        print("interrupted: mounts, namespaces and fellows removed", file=sys.stderr)
        return 130
    except (StepFailed, subprocess.TimeoutExpired, OSError) as e:
        report.update(verdict="failed", error=str(e), steps=steps.done,
                      wall_s=round(time.monotonic() - t0, 1))
        if opts.as_json:
            print(json.dumps(report, indent=2))
        else:
            print(f"failed: {e}", file=sys.stderr)
        return 1
    report["steps"] = steps.done
    report["wall_s"] = round(time.monotonic() - t0, 1)
    if opts.probe_only:
        report["verdict"] = "probed"
    else:
        want = report["reference"]["token_ids"]
        got = report["mixed"]["generated"]["token_ids"]
        arm_stage = [s for s in report["mixed"]["stages"] if s["fellow"] == "arm64"]
        report["greedy_equal"] = want == got
        # a model stuck on one token would make equal tokens prove little
        report["distinct_tokens"] = len(set(want))
        report["aarch64_held_a_stage"] = bool(arm_stage)
        report["verdict"] = ("not equal" if want != got else "equal"
                             if arm_stage and len(set(want)) > 3 else "inconclusive")
    if opts.as_json:
        print(json.dumps(report, indent=2))
    else:
        print(summary(report))
    return 0 if report["verdict"] in ("equal", "probed") else 1


def summary(report: dict[str, Any]) -> str:
    t = report["aarch64_torch"]
    lines = [f"aarch64 torch {t['torch']} (python {t['python']}, cpu capability "
             f"{t['cpu_capability']}, quantized engines {', '.join(t['quantized_engines'])}, "
             f"KleidiAI {t['kleidiai_available']})"]
    for name, k in t["kernels"].items():
        lines.append(f"  {name:28s} " + (f"runs, error {k['error']}, {k['ms']} ms emulated"
                                         if k["ok"] else f"unavailable: {k['error']}"))
    if "mixed" in report:
        for s in report["mixed"]["stages"]:
            lines.append(f"stage {s['stage']} on {s['fellow']}: layers {s['layers']}")
        lines.append(f"reference (one x86 process): {report['reference']['token_ids']}")
        lines.append(f"mixed swarm (x86, x86, aarch64): "
                     f"{report['mixed']['generated']['token_ids']}")
    lines.append(f"verdict: {report['verdict']} in {report['wall_s']:g} s "
                 f"({report['weights_dtype']} weights, {report['tokens']} tokens)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
