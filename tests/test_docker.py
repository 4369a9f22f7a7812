"""Docker deployment: deploy.sh against a recording stand-in for `docker`, the stack and
compose files (valid, and every command parses with the real `p2pswarm join`), the
default port, and the CPU card under a container's cgroup limits (a fake cgroup tree)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from p2pswarm.cards import Card
from p2pswarm.cli import app
from p2pswarm.cli.swarm import card_summary, read_token, seed_list, threads_within_cpu_quota
from p2pswarm.config import DEFAULT_PORT, preset, split_addr
from p2pswarm.inventory import CgroupLimits, CpuCardSource, cpu_threads, read_cgroup_limits

REPO = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO / "docker"
DEPLOY = DOCKER_DIR / "deploy.sh"
GiB = 1 << 30
TOKEN = "p2ps1-AAAAA-BBBBB-CCCCC-DDDDD-EEEEE-FFFFF-GGGGG-HHHHH-JJJJJ-KKKKK-MMMMM-NN"
MADE_ISSUER = '{"format": "p2pswarm-issuer", "version": 1, "ed25519_private_key": "c0ffee"}'
MADE_TOKEN = "p2ps1-ZZZZZ-YYYYY-XXXXX-WWWWW-VVVVV-TTTTT-SSSSS-RRRRR-QQQQQ-PPPPP-NNNNN-MM"
DOCKER_JOIN_TOKEN = ("SWMTKN-1-3pu6hszjas19xyp7ghgosyx9k8atbfcr8p2is99znpy26u2lkl-"
                     "1awxwuwd3z9j1z3puu7rcgdbx")
ENV_SEEN = ("P2PSWARM_SEEDS", "P2PSWARM_IMAGE", "SERVER_REPLICAS", "DESKTOP_REPLICAS",
            "LAPTOP_REPLICAS", "RPI_REPLICAS", "GPU_REPLICAS")

# --- deploy.sh against a stand-in docker ----------------------------------------------

# It records its argv, the stdin of `secret create NAME -` and the variables a stack file
# reads, and answers the few questions deploy.sh asks from a small world kept in files.
# A shell script, as a real docker is a quick binary: a Python one costs more than the
# script it stands in for.
STAND_IN = r"""#!/bin/sh
w=$FAKE_DOCKER_WORLD
input=
if [ "$1 $2" = "secret create" ]; then input=$(cat); fi
{
    for arg in "$@"; do printf '%s\037' "$arg"; done
    printf '\036%s\036' "$input"
    for name in ENV_SEEN; do
        eval "set_=\${$name+yes} value=\${$name-}"
        if [ -n "$set_" ]; then printf '%s=%s\037' "$name" "$value"; fi
    done
    printf '\n'
} >> "$FAKE_DOCKER_LOG"
case "$1 $2" in
    "secret inspect") test -e "$w/secret" || test -e "$w/secret-$3"; exit ;;
    "secret create")
        if [ -e "$w/secret" ] || [ -e "$w/secret-$3" ]; then exit 1; fi; touch "$w/secret-$3" ;;
    "image inspect") test -e "$w/image"; exit ;;
    "buildx inspect") test -e "$w/builder"; exit ;;
    "node ls")
        label=
        if [ "$4" = "--filter" ]; then label=${5#node.label=}; fi
        if [ "$3" = "-q" ]; then
            for node in "$w"/nodes/*; do
                if [ -z "$label" ] || grep -qx "$label" "$node/labels"; then basename "$node"; fi
            done
        fi ;;
    "node inspect")
        format=$4
        shift 4
        for id in "$@"; do
            case "$format" in
                *ManagerStatus*) cat "$w/nodes/$id/manager_addr" ;;
                *Status.Addr*) cat "$w/nodes/$id/addr" ;;
                *) cat "$w/nodes/$id/resources" ;;
            esac
        done ;;
    "run --rm")
        case " $* " in
            *" delegate "*) cat "$w/made_issuer" ;;
            *)  # init: the admin key lands in the admin home mounted at /admin
                prev=
                for arg in "$@"; do
                    if [ "$prev" = "-v" ]; then echo '{}' > "${arg%:/admin}/admin.json"; fi
                    prev=$arg
                done
                printf '{\n  "home": "/admin",\n  "token": "%s"\n}\n' "$(cat "$w/made_token")" ;;
        esac ;;
    "ps -q") cat "$w/containers" 2>/dev/null ;;
    "exec "*) cat "$w/leader" 2>/dev/null ;;
    "stack ps") cat "$w/tasks" 2>/dev/null ;;
esac
exit 0
"""


class FakeDocker:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        script = self.bin / "docker"
        script.write_text(STAND_IN.replace("ENV_SEEN", " ".join(ENV_SEEN)))
        script.chmod(0o755)
        self.log = tmp_path / "docker-calls.log"
        self.world_dir = tmp_path / "world"
        self.token_file = tmp_path / "config" / "p2pswarm" / "token"
        self.issuer_file = tmp_path / "config" / "p2pswarm" / "issuer.json"
        self.admin_home = tmp_path / "config" / "p2pswarm" / "admin"
        self.world: dict[str, Any] = {"made_token": MADE_TOKEN, "made_issuer": MADE_ISSUER,
                                      "nodes": {
            "n1": {"addr": "0.0.0.0", "manager_addr": "192.168.1.10:2377",
                   "labels": ["p2pswarm.kind=server"]},
            "n2": {"addr": "192.168.1.21", "labels": ["p2pswarm.kind=desktop"],
                   "resources": ["gpu"]},
            "n3": {"addr": "192.168.1.31", "labels": ["p2pswarm.kind=rpi"]},
            "n4": {"addr": "192.168.1.32", "labels": ["p2pswarm.kind=rpi"]},
            "n5": {"addr": "192.168.1.40", "labels": []},
        }}

    def _lay_out_world(self) -> None:
        made_secret = (self.world_dir / "secret").exists()  # an earlier run made it
        made = [p.name for p in self.world_dir.glob("secret-*")]  # made by name
        shutil.rmtree(self.world_dir, ignore_errors=True)
        self.world_dir.mkdir()
        for name in made:
            (self.world_dir / name).touch()
        (self.world_dir / "made_token").write_text(self.world["made_token"])
        (self.world_dir / "made_issuer").write_text(self.world["made_issuer"])
        for name in ("containers", "leader", "tasks"):  # what `logs leader` asks
            if name in self.world:
                (self.world_dir / name).write_text(self.world[name])
        for flag in ("secret", "image", "builder"):
            if self.world.get(flag) or (flag == "secret" and made_secret):
                (self.world_dir / flag).touch()
        for node_id, node in self.world["nodes"].items():
            directory = self.world_dir / "nodes" / node_id
            directory.mkdir(parents=True)
            (directory / "addr").write_text(node["addr"] + "\n")
            (directory / "manager_addr").write_text(node.get("manager_addr", "") + "\n")
            (directory / "labels").write_text("".join(f"{x}\n" for x in node["labels"]))
            (directory / "resources").write_text(" ".join(node.get("resources", [])) + "\n")

    def run(self, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        self._lay_out_world()
        # no p2pswarm on this PATH: the token comes from the file or the image
        environ = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.bin.parent),
                   "FAKE_DOCKER_LOG": str(self.log), "FAKE_DOCKER_WORLD": str(self.world_dir),
                   "P2PSWARM_TOKEN_FILE": str(self.token_file),
                   "P2PSWARM_ISSUER_FILE": str(self.issuer_file),
                   "P2PSWARM_ADMIN_HOME": str(self.admin_home), **env}
        return subprocess.run(["bash", str(DEPLOY), *args], input=stdin, env=environ,
                              capture_output=True, text=True, timeout=30)

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().split("\n")[:-1]:  # not splitlines: \x1e splits
            argv, stdin, env = line.split("\x1e")
            out.append({"argv": argv.split("\x1f")[:-1], "stdin": stdin,
                        "env": dict(pair.split("=", 1) for pair in env.split("\x1f")[:-1])})
        return out

    def argvs(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls()]

    def with_token_file(self) -> None:
        self.token_file.parent.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(TOKEN + "\n")


@pytest.fixture
def docker(tmp_path: Path) -> FakeDocker:
    if not shutil.which("bash"):
        pytest.skip("deploy.sh needs bash")
    return FakeDocker(tmp_path)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_init_makes_the_swarm_and_the_token_secret_from_stdin(docker: FakeDocker) -> None:
    docker.with_token_file()
    printed = ok(docker.run("init", "192.168.1.10"))
    assert docker.argvs() == [
        ["swarm", "init", "--advertise-addr", "192.168.1.10"],
        ["secret", "inspect", "p2pswarm_token"],
        ["secret", "create", "p2pswarm_token", "-"],
    ]
    assert docker.calls()[-1]["stdin"].strip() == TOKEN
    assert "+ docker swarm init --advertise-addr 192.168.1.10" in printed
    assert "+ docker secret create p2pswarm_token - < " in printed


def test_init_without_a_token_yet_leaves_it_to_deploy(docker: FakeDocker) -> None:
    printed = ok(docker.run("init"))
    assert docker.argvs() == [["swarm", "init"], ["secret", "inspect", "p2pswarm_token"],
                              ["image", "inspect", "p2pswarm:cpu"]]
    assert "No join token yet: deploy.sh deploy makes one" in printed


def test_join_label_and_scale_are_one_docker_command_each(docker: FakeDocker) -> None:
    ok(docker.run("join", DOCKER_JOIN_TOKEN, "192.168.1.10:2377"))
    ok(docker.run("label", "pi-1", "rpi"))
    ok(docker.run("scale", "worker-rpi", "20"))
    ok(docker.run("scale", "p2pswarm_worker-gpu", "0"))
    assert docker.argvs() == [
        ["swarm", "join", "--token", DOCKER_JOIN_TOKEN, "192.168.1.10:2377"],
        ["node", "update", "--label-add", "p2pswarm.kind=rpi", "pi-1"],
        ["service", "scale", "p2pswarm_worker-rpi=20"],
        ["service", "scale", "p2pswarm_worker-gpu=0"],
    ]


def test_join_reads_the_docker_token_from_stdin_and_never_prints_it(docker: FakeDocker) -> None:
    printed = ok(docker.run("join", "-", "192.168.1.10:2377", stdin=DOCKER_JOIN_TOKEN + "\n"))
    assert docker.argvs() == [["swarm", "join", "--token", DOCKER_JOIN_TOKEN,
                               "192.168.1.10:2377"]]  # docker takes it no other way
    assert DOCKER_JOIN_TOKEN not in printed
    assert "+ docker swarm join --token SWMTKN-1-3pu" in printed


def test_build_makes_a_multi_arch_cpu_image_and_a_cuda_one(docker: FakeDocker) -> None:
    ok(docker.run("build"))
    argvs = docker.argvs()
    assert argvs[:2] == [["buildx", "inspect", "p2pswarm"],
                         ["buildx", "create", "--name", "p2pswarm", "--driver", "docker-container"]]
    cpu, cuda = argvs[2:]
    assert cpu[:2] == ["buildx", "build"] and cuda[:2] == ["buildx", "build"]
    assert cpu[cpu.index("--platform") + 1] == "linux/amd64,linux/arm64"
    assert cpu[cpu.index("-t") + 1] == "p2pswarm:cpu" and cpu[-1] == str(REPO)
    assert cpu[cpu.index("-f") + 1] == str(DOCKER_DIR / "Dockerfile")
    assert cuda[cuda.index("--platform") + 1] == "linux/amd64"
    assert "TORCH_INDEX=cuda" in cuda and cuda[cuda.index("-t") + 1] == "p2pswarm:cuda"
    assert "--push" not in cpu + cuda and "--load" not in cpu  # two platforms stay cached


def test_push_needs_a_registry_and_pushes_both_variants(docker: FakeDocker) -> None:
    refused = docker.run("push")
    assert refused.returncode == 2 and docker.argvs() == []
    assert refused.stderr.strip().splitlines() == [
        "deploy.sh: push: set REGISTRY, e.g. REGISTRY=registry.lan:5000 docker/deploy.sh push"]
    docker.world["builder"] = True
    ok(docker.run("push", REGISTRY="registry.lan:5000"))
    builds = [a for a in docker.argvs() if a[:2] == ["buildx", "build"]]
    assert [b[b.index("-t") + 1] for b in builds] == ["registry.lan:5000/p2pswarm:cpu",
                                                      "registry.lan:5000/p2pswarm:cuda"]
    assert all("--push" in b for b in builds)


def test_deploy_makes_the_token_secret_and_one_fellow_per_labelled_machine(
        docker: FakeDocker) -> None:
    docker.world["image"] = True
    printed = ok(docker.run("deploy"))
    calls = docker.calls()
    argvs = [c["argv"] for c in calls]
    # an invitation for the five fellows the stack runs, for a day; the admin key made in
    # the admin home on this machine (mounted), owned by whoever deploys
    user = f"{os.getuid()}:{os.getgid()}"
    mount = ["-v", f"{docker.admin_home}:/admin"]
    assert ["run", "--rm", "--network", "none", "--user", user, *mount, "--entrypoint",
            "p2pswarm", "p2pswarm:cpu", "init", "--home", "/admin", "--uses", "5", "--ttl",
            "24h", "--json"] in argvs
    creates = [c for c in calls if c["argv"][:2] == ["secret", "create"]]
    assert [c["argv"] for c in creates] == [["secret", "create", "p2pswarm_token", "-"],
                                            ["secret", "create", "p2pswarm_issuer", "-"]]
    assert creates[0]["stdin"].strip() == MADE_TOKEN
    assert docker.token_file.read_text().strip() == MADE_TOKEN
    assert stat.S_IMODE(docker.token_file.stat().st_mode) == 0o600
    deploy = calls[-1]
    assert deploy["argv"] == ["stack", "deploy", "--with-registry-auth", "-c",
                              str(DOCKER_DIR / "stack.yml"), "p2pswarm"]
    # servers first; a manager that says 0.0.0.0 is found by its manager address
    assert deploy["env"] == {
        "P2PSWARM_SEEDS": f"192.168.1.10:{DEFAULT_PORT},192.168.1.21:{DEFAULT_PORT},"
                          f"192.168.1.31:{DEFAULT_PORT},192.168.1.32:{DEFAULT_PORT}",
        "P2PSWARM_IMAGE": "p2pswarm", "SERVER_REPLICAS": "1", "DESKTOP_REPLICAS": "1",
        "LAPTOP_REPLICAS": "0", "RPI_REPLICAS": "2", "GPU_REPLICAS": "1"}
    assert MADE_TOKEN not in printed


def test_deploy_delegates_an_issuer_bundle_into_a_second_secret(docker: FakeDocker) -> None:
    docker.world["image"] = True
    docker.admin_home.mkdir(parents=True)
    (docker.admin_home / "admin.json").write_text("{}")  # what init left there
    docker.with_token_file()
    printed = ok(docker.run("deploy", ISSUER_TTL="14d"))
    calls = docker.calls()
    user = f"{os.getuid()}:{os.getgid()}"
    assert ["run", "--rm", "--network", "none", "--user", user, "-v",
            f"{docker.admin_home}:/admin", "--entrypoint", "p2pswarm", "p2pswarm:cpu",
            "delegate", "--home", "/admin", "--ttl", "14d", "--out", "-"] \
        == next(c["argv"] for c in calls if "delegate" in c["argv"])
    create = next(c for c in calls if c["argv"][:3] == ["secret", "create", "p2pswarm_issuer"])
    assert create["stdin"].strip() == MADE_ISSUER  # from stdin, never an argument
    assert docker.issuer_file.read_text().strip() == MADE_ISSUER
    assert stat.S_IMODE(docker.issuer_file.stat().st_mode) == 0o600
    assert "c0ffee" not in printed and not any("c0ffee" in a for a in docker.argvs()[-1])
    # made once: a second deploy takes the secret as it is
    ok(docker.run("deploy"))
    assert sum("delegate" in a for a in docker.argvs()) == 1
    # no admin key here and no bundle: one line saying where to make one
    (docker.bin.parent / "other").mkdir()
    other = FakeDocker(docker.bin.parent / "other")
    other.world["image"] = True
    other.with_token_file()
    refused = other.run("deploy")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "deploy.sh: deploy: no issuer bundle:")


def test_deploy_takes_an_existing_secret_and_refuses_an_unlabelled_swarm(
        docker: FakeDocker) -> None:
    docker.world["secret"] = True
    ok(docker.run("deploy", REGISTRY="registry.lan:5000", RPI_REPLICAS="5"))
    deploy = docker.calls()[-1]
    assert deploy["env"]["P2PSWARM_IMAGE"] == "registry.lan:5000/p2pswarm"
    assert deploy["env"]["RPI_REPLICAS"] == "5"
    assert not any(a[:2] == ["secret", "create"] for a in docker.argvs())
    docker.world["nodes"] = {"n5": {"addr": "192.168.1.40", "labels": []}}
    refused = docker.run("deploy")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "deploy.sh: deploy: no machine is labelled yet")


def test_status_and_logs(docker: FakeDocker) -> None:
    ok(docker.run("status"))
    ok(docker.run("logs"))
    ok(docker.run("logs", "worker-rpi"))
    argvs = docker.argvs()
    assert argvs[0][:2] == ["node", "ls"]
    assert argvs[1:3] == [["stack", "services", "p2pswarm"],
                          ["stack", "ps", "--filter", "desired-state=running", "p2pswarm"]]
    logs = argvs[3:]
    assert [a[-1] for a in logs[:5]] == ["p2pswarm_worker-server", "p2pswarm_worker-desktop",
                                         "p2pswarm_worker-laptop", "p2pswarm_worker-rpi",
                                         "p2pswarm_worker-gpu"]
    assert logs[5] == ["service", "logs", "--follow", "--tail", "100", "p2pswarm_worker-rpi"]


RUNNING_TASKS = ("t1 n1 p2pswarm_worker-server.1\n"
                 "t2 n2 p2pswarm_worker-desktop.1\n"
                 "t3 n2 p2pswarm_worker-gpu.1\n"
                 "t4 n3 p2pswarm_worker-rpi.1\n")


@pytest.mark.parametrize("word", ["leader", "coordinator"])
@pytest.mark.parametrize("leader, task", [("n3", "t4"), ("n2-gpu", "t3"), ("n2", "t2")])
def test_logs_leader_follows_the_fellow_that_leads(docker: FakeDocker, word: str, leader: str,
                                                   task: str) -> None:
    # The leader coordinates: `logs coordinator`, as a design may name it, finds it too.
    docker.world.update(containers="c1\n", leader=leader + "\n", tasks=RUNNING_TASKS)
    printed = ok(docker.run("logs", word))
    assert f"the leader is {leader}" in printed
    argvs = docker.argvs()
    assert argvs[0][:2] == ["ps", "-q"] and argvs[1][:2] == ["exec", "c1"]
    assert argvs[-1] == ["service", "logs", "--follow", "--tail", "100", task]


@pytest.mark.parametrize("world, line", [
    ({}, "deploy.sh: logs leader: no fellow of p2pswarm runs on this machine to ask who leads"),
    ({"containers": "c1\n", "leader": "\n"}, "deploy.sh: logs leader: the swarm has no leader "
     "right now"),
    ({"containers": "c1\n", "leader": "n9\n", "tasks": RUNNING_TASKS}, "deploy.sh: logs "
     "leader: n9 leads, but no running task of p2pswarm is on a machine of that name"),
])
def test_logs_leader_says_why_it_cannot(docker: FakeDocker, world: dict[str, str],
                                        line: str) -> None:
    docker.world.update(world)
    refused = docker.run("logs", "leader")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(line)


@pytest.mark.parametrize("args, line", [
    ((), None),
    (("join", DOCKER_JOIN_TOKEN), "deploy.sh: missing argument: join TOKEN MANAGER-IP:2377"),
    (("join", DOCKER_JOIN_TOKEN, "192.168.1.10"), "deploy.sh: join: give the manager as "
     "HOST:PORT, e.g. 192.168.1.10:2377"),
    (("label", "pi-1"), "deploy.sh: missing argument: label NODE server|desktop|laptop|rpi"),
    (("label", "pi-1", "toaster"), "deploy.sh: label: toaster is not one of: server desktop "
     "laptop rpi"),
    (("scale", "worker-rpi"), "deploy.sh: missing argument: scale SERVICE N"),
    (("scale", "worker-rpi", "many"), "deploy.sh: scale: N must be a whole number, not many"),
    (("scale", "worker-toaster", "2"), "deploy.sh: no service worker-toaster: use one of "
     "worker-server worker-desktop worker-laptop worker-rpi worker-gpu (or leader, for logs)"),
    (("logs", "a", "b"), "deploy.sh: too many arguments: logs [SERVICE|leader]"),
    (("status", "now"), "deploy.sh: too many arguments: status"),
    (("frobnicate",), "deploy.sh: unknown command frobnicate: docker/deploy.sh help lists them"),
])
def test_a_missing_or_bad_argument_gets_one_line_and_runs_nothing(
        docker: FakeDocker, args: tuple[str, ...], line: str | None) -> None:
    result = docker.run(*args)
    assert result.returncode == 2 and docker.argvs() == []
    if line is None:  # no command at all: the usage
        assert result.stderr.startswith("usage: docker/deploy.sh COMMAND")
    else:
        assert result.stderr.splitlines() == [line]


def test_help_names_every_command(docker: FakeDocker) -> None:
    text = ok(docker.run("help")) + docker.run("help").stdout
    for command in ("init", "join TOKEN MANAGER-IP:2377", "label NODE server|desktop|laptop|rpi",
                    "build", "push", "deploy", "status", "logs", "scale SERVICE N", "help"):
        assert f"\n  {command}" in text


def test_the_swarm_token_is_never_an_argument(docker: FakeDocker) -> None:
    docker.world["image"] = True
    for args in (("init",), ("deploy",), ("status",), ("scale", "worker-rpi", "3")):
        ok(docker.run(*args))
    docker.world["secret"] = True
    ok(docker.run("deploy"))
    argvs = docker.argvs()
    assert len(argvs) > 10
    assert not any(MADE_TOKEN in arg or "p2ps1-" in arg for argv in argvs for arg in argv)
    assert [c["stdin"].strip() for c in docker.calls() if c["stdin"]] == [MADE_TOKEN,
                                                                         MADE_ISSUER]


# --- the stack and compose files ---------------------------------------------------------

STACK_ENV = {"P2PSWARM_SEEDS": f"192.168.1.10:{DEFAULT_PORT},192.168.1.21:{DEFAULT_PORT}"}
COMPOSE_ENV = {"P2PSWARM_TOKEN_FILE": "/run/p2pswarm-token",
               "P2PSWARM_ISSUER_FILE": "/run/p2pswarm-issuer"}
SERVICES = {"worker-server", "worker-desktop", "worker-laptop", "worker-rpi", "worker-gpu"}


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """${VAR}, ${VAR:-default}, ${VAR:?message} as compose does them (enough for ours)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name, op, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        if name in env:
            return env[name]
        assert op != ":?", f"{name} is required: {rest}"
        return rest
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


def load(name: str, env: dict[str, str]) -> dict[str, Any]:
    data = interpolate(yaml.safe_load((DOCKER_DIR / name).read_text()), env)
    assert isinstance(data, dict)
    return data


def join_params(args: list[str]) -> dict[str, Any]:
    """What the real `p2pswarm join` parser makes of these arguments (nothing runs)."""
    command = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    ctx = command.make_context("join", list(args), resilient_parsing=False)
    return dict(ctx.params)


def check_join_command(args: list[str]) -> dict[str, Any]:
    params = join_params(args)
    assert params["token"] is None  # never on a command line
    split_addr(params["listen"])
    seed_list(params["seeds"] or [])
    preset(params["preset_name"])
    return params


def test_stack_services_parse_with_the_real_join_parser() -> None:
    stack = load("stack.yml", STACK_ENV)
    services = stack["services"]
    assert set(services) == SERVICES
    ports: dict[str, int] = {}
    for name, service in services.items():
        params = check_join_command(service["command"])
        assert seed_list(params["seeds"]) == (f"192.168.1.10:{DEFAULT_PORT}",
                                              f"192.168.1.21:{DEFAULT_PORT}")
        ports[name] = split_addr(params["listen"])[1]
        env = service["environment"]
        assert env["P2PSWARM_TOKEN_FILE"] == "/run/secrets/p2pswarm_token"
        assert "{{.Node.Hostname}}" in env["P2PSWARM_NAME"]
        # the issuer bundle goes to the most stable machines only
        if name == "worker-server":
            assert service["secrets"] == ["p2pswarm_token", "p2pswarm_issuer"]
            assert env["P2PSWARM_ISSUER_FILE"] == "/run/secrets/p2pswarm_issuer"
            assert join_params(service["command"])["issuer_file"] is None  # read from env
        else:
            assert service["secrets"] == ["p2pswarm_token"]
            assert "P2PSWARM_ISSUER_FILE" not in env
        assert service["networks"] == ["hostnet"]
        assert any(v.endswith(":/var/lib/p2pswarm") for v in service["volumes"])
        deploy = service["deploy"]
        assert deploy["mode"] == "replicated" and deploy["restart_policy"]["condition"] == "any"
        assert deploy["placement"]["max_replicas_per_node"] == 1  # one port per node
        if name == "worker-gpu":
            assert params["no_cpu"] and service["image"].endswith(":cuda")
            spec = deploy["resources"]["reservations"]["generic_resources"][0]
            assert spec["discrete_resource_spec"] == {"kind": "gpu", "value": 1}
        else:
            assert params["gpus"] == "none" and service["image"].endswith(":cpu")
            kind = name.removeprefix("worker-")
            assert f"node.labels.p2pswarm.kind == {kind}" in deploy["placement"]["constraints"]
    # a node's CPU fellow and GPU fellow share the host's network: two ports
    assert ports.pop("worker-gpu") != DEFAULT_PORT and set(ports.values()) == {DEFAULT_PORT}
    assert stack["networks"]["hostnet"] == {"external": True, "name": "host"}
    assert stack["secrets"]["p2pswarm_token"] == {"external": True}
    assert stack["secrets"]["p2pswarm_issuer"] == {"external": True}


def test_compose_scales_with_unique_names_and_one_token() -> None:
    compose = load("compose.yaml", COMPOSE_ENV)
    services = compose["services"]
    assert set(services) == {"seed", "fellow"}
    token = {"P2PSWARM_TOKEN_FILE": "/run/secrets/p2pswarm_token"}
    for service in services.values():
        assert "container_name" not in service
        check_join_command(service["command"])
        assert service["mem_limit"]  # each fellow offers its container's share, not the host's
    # replicas are named by their hostname, which docker makes unique: none fixed
    assert "hostname" not in services["fellow"]
    assert join_params(services["fellow"]["command"])["name"] is None
    assert join_params(services["fellow"]["command"])["seeds"] == [f"seed:{DEFAULT_PORT}"]
    assert compose["secrets"]["p2pswarm_token"] == {"file": "/run/p2pswarm-token"}
    # the seed alone issues certificates: the issuer bundle is its secret only
    assert services["fellow"]["secrets"] == ["p2pswarm_token"]
    assert services["fellow"]["environment"] == token
    assert services["seed"]["secrets"] == ["p2pswarm_token", "p2pswarm_issuer"]
    assert services["seed"]["environment"] == {
        **token, "P2PSWARM_ISSUER_FILE": "/run/secrets/p2pswarm_issuer"}
    assert compose["secrets"]["p2pswarm_issuer"] == {"file": "/run/p2pswarm-issuer"}


def test_dockerfile_runs_join_on_the_default_port() -> None:
    text = (DOCKER_DIR / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert split_addr(check_join_command(cmd)["listen"])[1] == DEFAULT_PORT
    assert f"EXPOSE {DEFAULT_PORT}/udp {DEFAULT_PORT}/tcp" in text
    assert 'ENTRYPOINT ["p2pswarm", "join"]' in text


def run_checker(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=DOCKER_DIR)


def test_docker_stack_config_accepts_the_stack_file() -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI here; the stack file is still checked above")
    result = run_checker("docker", "stack", "config", "-c", "stack.yml", env=STACK_ENV)
    if "unknown command" in result.stderr or "is not a docker command" in result.stderr:
        pytest.skip("this docker CLI has no `stack config`")
    assert result.returncode == 0, result.stderr
    assert "worker-rpi" in result.stdout
    unset = run_checker("docker", "stack", "config", "-c", "stack.yml",
                        env={"P2PSWARM_SEEDS": ""})
    assert unset.returncode != 0 and "P2PSWARM_SEEDS" in unset.stderr


def test_docker_compose_config_accepts_the_compose_file() -> None:
    for checker in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(checker[0]) or (
                checker[0] == "docker" and run_checker(*checker, "version", env={}).returncode):
            continue  # not installed, or docker without its compose plugin
        result = run_checker(*checker, "-f", "compose.yaml", "config", env=COMPOSE_ENV)
        assert result.returncode == 0, result.stderr
        assert "fellow" in result.stdout
        return
    pytest.skip("neither `docker compose` nor docker-compose here; checked above")


# --- the default port ------------------------------------------------------------------

def test_the_default_port_is_not_docker_swarms_and_every_file_uses_it() -> None:
    assert DEFAULT_PORT not in (2377, 7946, 4789, 7780)  # swarm's ports, our HTTP API
    assert split_addr("seed.lan") == ("seed.lan", DEFAULT_PORT)
    assert join_params([])["listen"] == f"0.0.0.0:{DEFAULT_PORT}"
    assert f"PORT={DEFAULT_PORT} " in DEPLOY.read_text()
    for name in ("Dockerfile", "stack.yml", "compose.yaml", "deploy.sh", "README.md"):
        text = (DOCKER_DIR / name).read_text()
        assert f":{DEFAULT_PORT}" in text or f"={DEFAULT_PORT}" in text, name
        # 7946 may be named as Docker's port, never used as a fellow's
        assert not re.search(r"[:=]7946\b|7946/(udp|tcp)", text), name


def test_seeds_may_come_as_one_comma_separated_argument() -> None:
    assert seed_list([f"a:{DEFAULT_PORT},b", "[fd00::1]:9000"]) == (
        f"a:{DEFAULT_PORT}", f"b:{DEFAULT_PORT}", "[fd00::1]:9000")


# --- the token from a file -------------------------------------------------------------

def test_token_file_is_read_and_bad_ones_get_one_line(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "token"
    good.write_text(f"  {TOKEN}\n")
    assert read_token(None, good) == TOKEN
    assert read_token("given", good) == "given"
    for content in ("", "two words\n", "x" * 5000):
        bad = tmp_path / "bad"
        bad.write_text(content)
        with pytest.raises(typer.Exit):
            read_token(None, bad)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not hold a join token" in err
    with pytest.raises(typer.Exit):
        read_token(None, tmp_path / "missing")
    assert "cannot read --token-file" in capsys.readouterr().err


# --- the CPU card inside a container: the cgroup's limits -------------------------------

class FakeMemory:
    def __init__(self, total: int, available: int) -> None:
        self.total, self.available = total, available


class FakePsutil:
    def __init__(self, total: int, available: int) -> None:
        self.memory = FakeMemory(total, available)

    def virtual_memory(self) -> FakeMemory:
        return self.memory


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def cpu_card(root: Path, proc: Path, total: int = 16 * GiB, available: int = 9 * GiB,
             cap: int | None = None) -> Card:
    source = CpuCardSource(psutil_module=FakePsutil(total, available), cap_bytes=cap,
                           cgroup_reader=lambda: read_cgroup_limits(root, proc))
    (card,) = source.read()
    return card


def test_cgroup_v2_memory_max_is_the_cpu_cards_size(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    write_tree(root, {"cgroup.controllers": "cpu memory pids\n", "memory.max": f"{2 * GiB}\n",
                      "memory.current": f"{GiB}\n",
                      "memory.stat": f"anon 1\nfile 2\ninactive_file {GiB // 4}\n",
                      "cpu.max": "150000 100000\n"})
    proc.write_text("0::/\n")  # a container's own cgroup namespace
    card = cpu_card(root, proc)
    assert card.total_bytes == 2 * GiB
    assert card.free_bytes == 2 * GiB - (GiB - GiB // 4)  # the limit less what it holds
    assert card.memory_source == "cgroup memory.max"
    limits = read_cgroup_limits(root, proc)
    assert limits.cpu_limit_cores == 1.5 and limits.cpu_from == "cgroup cpu.max"
    # free never exceeds what the host has free
    assert cpu_card(root, proc, available=GiB // 2).free_bytes == GiB // 2
    # a --cpu-memory cap below the limit is what the card says it came from
    capped = cpu_card(root, proc, cap=GiB)
    assert (capped.total_bytes, capped.memory_source) == (GiB, "--cpu-memory")


def test_a_cpu_quota_sizes_the_thread_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_threads(CgroupLimits(cpu_limit_cores=1.5)) == 2
    assert cpu_threads(CgroupLimits(cpu_limit_cores=0.25)) == 1
    assert cpu_threads(CgroupLimits()) is None
    monkeypatch.setattr("p2pswarm.inventory.read_cgroup_limits",
                        lambda: CgroupLimits(cpu_limit_cores=3.0))
    environ: dict[str, str] = {}
    threads_within_cpu_quota(environ)
    assert environ == {"OMP_NUM_THREADS": "3"}
    environ = {"OMP_NUM_THREADS": "8"}  # the user's word stands
    threads_within_cpu_quota(environ)
    assert environ == {"OMP_NUM_THREADS": "8"}


def test_cgroup_v1_memory_limit_in_bytes_is_the_cpu_cards_size(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    write_tree(root, {"memory/memory.limit_in_bytes": f"{3 * GiB}\n",
                      "memory/memory.usage_in_bytes": f"{GiB}\n",
                      "memory/memory.stat": f"cache 5\ntotal_inactive_file {GiB // 2}\n",
                      "cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
                      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    # the host's path for this container, which does not exist inside it
    proc.write_text("4:memory:/docker/0123abcd\n2:cpu,cpuacct:/docker/0123abcd\n1:name=systemd:/\n")
    card = cpu_card(root, proc)
    assert (card.total_bytes, card.free_bytes) == (3 * GiB, 3 * GiB - GiB // 2)
    assert card.memory_source == "cgroup memory.limit_in_bytes"
    assert read_cgroup_limits(root, proc).cpu_limit_cores == 2.0


def test_no_limit_or_a_limit_above_the_ram_leaves_the_machines_ram(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    write_tree(root, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                      "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    proc.write_text("4:memory:/\n")
    card = cpu_card(root, proc)
    assert (card.total_bytes, card.free_bytes, card.memory_source) == \
        (16 * GiB, 9 * GiB, "/proc/meminfo")
    assert read_cgroup_limits(root, proc).cpu_limit_cores is None
    write_tree(root, {"memory/memory.limit_in_bytes": f"{64 * GiB}\n"})
    assert cpu_card(root, proc).memory_source == "/proc/meminfo"
    # nothing mounted at all (another OS, a locked-down sandbox)
    assert cpu_card(tmp_path / "nowhere", tmp_path / "none").total_bytes == 16 * GiB


def test_a_parents_lower_limit_binds_and_garbage_is_no_limit(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    write_tree(root, {"cgroup.controllers": "memory\n",
                      "system.slice/memory.max": f"{4 * GiB}\n",
                      "system.slice/p2pswarm.service/memory.max": "max\n",
                      "system.slice/p2pswarm.service/cpu.max": "max 100000\n"})
    proc.write_text("0::/system.slice/p2pswarm.service\n")
    card = cpu_card(root, proc)
    assert (card.total_bytes, card.memory_source) == (4 * GiB, "cgroup memory.max")
    write_tree(root, {"system.slice/memory.max": "\x00\xff garbage",
                      "system.slice/p2pswarm.service/cpu.max": "lots 0\n"})
    proc.write_text("0::/../../etc\n")  # a path is never followed out of the mount
    limits = read_cgroup_limits(root, proc)
    assert limits.memory_limit_bytes is None and limits.cpu_limit_cores is None


def test_status_shows_where_the_cpu_figure_came_from() -> None:
    card = Card(index=0, kind="cpu", name="Cortex-A76", uuid="cpu-pi", total_bytes=2 * 10**9,
                free_bytes=1_600_000_000, memory_source="cgroup memory.max")
    data = card.to_dict()
    assert data["memory_source"] == "cgroup memory.max" and Card.from_dict(data) == card
    assert card_summary(data) == "CPU 1.6/2.0 GB free (cgroup memory.max)"
    gpu = {"kind": "cuda", "index": 0, "free_bytes": 3.9e9, "total_bytes": 4.3e9,
           "memory_source": "NVML"}
    assert card_summary(gpu) == "GPU 0 3.9/4.3 GB free"
    # a fellow's word is bounded, and a fellow that says nothing shows nothing
    assert len(Card.from_dict({**data, "memory_source": "x" * 10_000}).memory_source) == 64
    assert "memory_source" not in Card.from_dict({**data, "memory_source": ""}).to_dict()


# --- a fellow as the stack runs one, on real processes --------------------------------

def memory_cgroup(name: str, limit: int) -> Path | None:
    """A fresh memory cgroup with this limit (its ``cgroup.procs``), or None where this
    process may not make one (not root, no writable cgroup tree)."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    for directory, limit_file in ((v1 / name, "memory.limit_in_bytes"), (v2 / name, "memory.max")):
        try:
            directory.mkdir()
        except OSError:
            continue
        try:
            (directory / limit_file).write_text(str(limit))
            return directory
        except OSError:
            directory.rmdir()
    return None


@pytest.mark.slow
def test_a_fellow_run_as_the_stack_runs_it(tmp_path: Path) -> None:
    """Token from a file (never in the process's command line), name from the variable,
    seeds as one comma-separated argument, and, inside a memory cgroup where this test may
    make one, a CPU card of the cgroup's limit. (Joining is test_join_token's.)"""
    from p2pswarm.sim.commands import stop
    from p2pswarm.sim.field import free_port
    from tests.test_join_token import SEED_SECRET, wait_for_fellows

    token_file = tmp_path / "p2pswarm_token"
    token_file.write_text(SEED_SECRET.token() + "\n")
    home = tmp_path / "fellow"
    limit = 1536 * 2**20
    cgroup = memory_cgroup(f"p2pswarm-test-{os.getpid()}", limit)

    def enter_cgroup() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    seeds = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"  # nobody there yet
    fellow = subprocess.Popen(
        [sys.executable, "-m", "p2pswarm.cli", "join", seeds, "--listen", "127.0.0.1:0",
         "--gpus", "none", "--preset", "local", "--http", "off"],
        env={**os.environ, "P2PSWARM_HOME": str(home), "P2PSWARM_TOKEN": "",
             "P2PSWARM_TOKEN_FILE": str(token_file), "P2PSWARM_NAME": "pi-1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, preexec_fn=enter_cgroup)
    try:
        data = wait_for_fellows(home, fellow, 1)
        assert data["self"]["name"] == "pi-1"
        assert SEED_SECRET.token().encode() not in Path(f"/proc/{fellow.pid}/cmdline").read_bytes()
        (card,) = next(m for m in data["members"] if m["self"])["cards"]
        if cgroup is None:
            assert card["memory_source"] in ("/proc/meminfo", "cgroup memory.max",
                                             "cgroup memory.limit_in_bytes")
        else:
            assert (card["total_bytes"], card["memory_source"]) == (
                limit, "cgroup memory.limit_in_bytes" if "memory/" in str(cgroup)
                else "cgroup memory.max")
    finally:
        stop(fellow)
        if cgroup is not None:
            cgroup.rmdir()
