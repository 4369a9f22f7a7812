"""Being in a swarm: join (run the agent; with an invitation, admitted first), leave, and
status (this fellow, the fellows it knows, the leader, traffic). `init` lives in
``admission``."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from p2pswarm.cli import admission
from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import EXIT_FAILURE, EXIT_USAGE, exits_on, fail
from p2pswarm.cli.local_agent import ask_agent
from p2pswarm.config import DEFAULT_PORT, split_addr
from p2pswarm.control.requests import request_map
from p2pswarm.errors import TokenRefused
from p2pswarm.models import q4_kernel
from p2pswarm.wire.control import LeaveRequest, StatusRequest

if TYPE_CHECKING:
    from p2pswarm.home import Home

if sys.version_info < (3, 11):  # trio's own dependency there
    from exceptiongroup import BaseExceptionGroup


def seed_list(seeds: list[str]) -> tuple[str, ...]:
    """Each seed as HOST:PORT (the default port where none is given); one argument may
    name several, ``a:7782,b:7782``, which is what a stack file's one variable expands to."""
    out = []
    for seed in (part for arg in seeds for part in arg.split(",") if part.strip()):
        host, port = split_addr(seed)
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return tuple(out)


TOKEN_FILE_MAX_BYTES = 4096  # a join token is under a hundred characters


def read_token(token: Optional[str], token_file: Optional[Path] = None) -> Optional[str]:
    """--token, else --token-file, else $P2PSWARM_TOKEN, else the file named by
    $P2PSWARM_TOKEN_FILE. A file keeps the token out of the process's command line (what
    `ps` shows every user); a Docker secret arrives as such a file."""
    if token:
        return token
    if token_file is not None:
        return read_token_file(str(token_file), "--token-file")
    if os.environ.get("P2PSWARM_TOKEN"):
        return os.environ["P2PSWARM_TOKEN"]
    path = os.environ.get("P2PSWARM_TOKEN_FILE")
    if path:
        return read_token_file(path, "P2PSWARM_TOKEN_FILE")
    return None


def read_token_file(path: str, given_as: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped); one line and exit if not."""
    try:
        with open(path, "rb") as f:
            data = f.read(TOKEN_FILE_MAX_BYTES + 1)
    except OSError as exc:
        fail(f"cannot read {given_as} {path}: {exc.strerror}")
    text = data.decode("utf-8", errors="replace").strip()
    if len(data) > TOKEN_FILE_MAX_BYTES or not text or len(text.split()) != 1:
        fail(f"{given_as} {path} does not hold a join token: put only the token from "
             "`p2pswarm init` in it")
    return text


@app.command()
@exits_on()
def join(
    seeds: list[str] = typer.Argument(None, help="HOST:PORT of fellows already in the swarm "
                                      f"(several, or a:{DEFAULT_PORT},b:{DEFAULT_PORT})."),
    token: Optional[str] = typer.Option(None, "--token", help="Join token from `p2pswarm init` "
                                        "(or $P2PSWARM_TOKEN)."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="Read the join token from this file (or the file "
        "$P2PSWARM_TOKEN_FILE names), e.g. a Docker secret: unlike --token, `ps` never shows it."),
    listen: str = typer.Option(f"0.0.0.0:{DEFAULT_PORT}", "--listen",
                               help="HOST:PORT to listen on (UDP and TCP)."),
    advertise: Optional[str] = typer.Option(None, "--advertise",
                                            help="HOST:PORT fellows should reach this one at."),
    name: Optional[str] = typer.Option(None, "--name", envvar="P2PSWARM_NAME",
                                       help="This fellow's name (default: the hostname)."),
    preset_name: str = typer.Option("lan", "--preset", help="Timings: lan, wifi or local."),
    leader_priority: int = typer.Option(0, "--leader-priority", min=0, max=255,
                                        help="Prefer this fellow as leader (higher wins)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="Offer only these GPUs, e.g. 0,2."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory",
                                             help="Offer at most this much RAM, e.g. 6GB."),
    no_cpu: bool = typer.Option(False, "--no-cpu", help="Do not offer the CPU as a card."),
    compute_nice: Optional[int] = typer.Option(
        None, "--compute-nice", min=0, max=19, help="Run torch work this many nice levels "
        "below the agent's loop, so a fellow that trains still answers in time (default "
        "10; 0: the same priority)."),
    http: Optional[str] = typer.Option(None, "--http", help="ADDR:PORT of the HTTP API, pages "
                                       "and OpenAI endpoint (default 127.0.0.1:7780), or off."),
    http_token: Optional[str] = typer.Option(None, "--http-token", help="Bearer token the HTTP "
                                             "API requires; needed beyond loopback. Visible "
                                             "to local users: prefer $P2PSWARM_HTTP_TOKEN or "
                                             "--http-token-file."),
    http_token_file: Optional[Path] = typer.Option(None, "--http-token-file",
                                                   help="Read the HTTP token from this file."),
    http_allow_host: Optional[list[str]] = typer.Option(
        None, "--http-allow-host", help="A host name the HTTP API answers to besides "
        "localhost and addresses (repeatable); others are refused (DNS rebinding)."),
    http_allow_dir: Optional[list[str]] = typer.Option(
        None, "--http-allow-dir", help="A directory jobs sent over HTTP may read data from "
        "and write checkpoints to (repeatable; default none)."),
    issuer_file: Optional[Path] = typer.Option(
        None, "--issuer-file", envvar="P2PSWARM_ISSUER_FILE", help="An issuer bundle from "
        "`p2pswarm delegate`: this fellow admits joiners (copied into --home, 0600)."),
    force: bool = typer.Option(False, "--force", help="With --token: leave the swarm --home "
                               "already holds and join the token's."),
    home: Optional[Path] = HomeOption,
    log_level: str = typer.Option("info", "--log-level", help="debug, info or warning."),
) -> None:
    """Run this machine's agent in the foreground and join the swarm (Ctrl-C leaves)."""
    refuse_a_second_agent(home_dir(home))  # first: before the imports of the agent
    import trio

    from p2pswarm.agent.node import NodeService, NodeSettings, run_node
    from p2pswarm.cli.http_options import join_http_settings
    from p2pswarm.config import ComputeConfig, preset, replace
    from p2pswarm.home import Home
    from p2pswarm.inventory import local_card_source
    from p2pswarm.security import SwarmSecret
    from p2pswarm.security.invitation_token import is_invitation_token

    directory = home_dir(home)
    with exits_on(EXIT_USAGE):
        config = preset(preset_name)
        if compute_nice is not None:
            config = replace(config, compute=ComputeConfig(nice=compute_nice))
        seed_addrs = seed_list(seeds or [])
        split_addr(listen)
        if advertise:
            split_addr(advertise)
        http_server = join_http_settings(http, http_token, http_token_file, http_allow_host,
                                         http_allow_dir)
        if http_server is not None and http_server.explicit:
            refuse_a_busy_http_port(http_server.host, http_server.port)
        text = read_token(token, token_file)
        state = Home(directory)
        if force and text is None:
            fail("--force replaces the swarm --home holds with the one of --token: give "
                 "--token too")
        # a token the seeds refuse must not stay in a home that held no other swarm: the
        # keyring this run wrote (and only that) goes again
        written: bytes | None = None
        if text is not None:
            had_swarm = state.has_swarm()
            if is_invitation_token(text):
                admission.take_invitation(directory, text, force=force)
            else:
                state.join_swarm(SwarmSecret.from_token(text), force=force)
            written = None if had_swarm else state.written_keyring()
        state.load_keyring()  # refuse early: no swarm, or key files others can read
        if issuer_file is not None:
            admission.take_issuer_file(directory, issuer_file)
        cards = local_card_source(gpus=gpus, cpu_memory=cpu_memory, no_cpu=no_cpu,
                                  own_pids=[os.getpid()])
        threads_within_cpu_quota(os.environ)
        idle_threads_sleep(os.environ)
        q4_kernel.use_environment(os.environ)
        services: tuple[NodeService, ...] = ()
        if http_server is not None:
            from p2pswarm.http import serve_http

            services = (functools.partial(serve_http, settings=http_server),)
        settings = NodeSettings(home=directory, listen=listen, seeds=seed_addrs,
                                name=name or socket.gethostname(), config=config,
                                advertise=advertise, leader_priority=leader_priority,
                                card_source=cards, services=services)
    setup_logging(log_level)
    with exits_on(EXIT_FAILURE):
        try:
            trio.run(run_node, settings)
        except KeyboardInterrupt:
            pass
        except TokenRefused:
            if written is not None:
                forget_new_swarm(state, written)
            raise
        except BaseExceptionGroup as group:  # a service that failed to start: its one line
            found = first_swarm_error(group)
            if isinstance(found, TokenRefused) and written is not None:
                forget_new_swarm(state, written)
            raise found from None


def forget_new_swarm(state: Home, written: bytes) -> None:
    """A join the swarm refused leaves a home that held no swarm as it found it: no keys,
    no invitation; only what this run wrote goes (``Home.forget_swarm``)."""
    if state.forget_swarm(written):
        (state.path / "admission.json").unlink(missing_ok=True)
        (state.path / "issuer.json").unlink(missing_ok=True)


def first_swarm_error(group: BaseExceptionGroup) -> BaseException:
    """The SwarmError a nursery's group carries (a busy port, a second agent that
    raced the check), so ``join`` says it in one line; the group itself otherwise."""
    from p2pswarm.errors import SwarmError

    found = group.subgroup(lambda exc: isinstance(exc, SwarmError))
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found if found is not None else group


def refuse_a_second_agent(directory: Path) -> None:
    """One line, before anything slow starts, when an agent already answers on the
    control socket of ``directory``: two agents cannot share a home."""
    from p2pswarm.control.protocol import MAX_SOCKET_PATH_BYTES, socket_path

    path = socket_path(directory)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        fail(f"the state directory {directory} is too deep for its control socket "
             f"({len(os.fsencode(path))} bytes to agent.sock, at most "
             f"{MAX_SOCKET_PATH_BYTES}): choose a shorter --home", EXIT_FAILURE)
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            return  # a stale socket of an agent that did not exit cleanly: the agent clears it
    fail(f"an agent is already running in {directory}: `p2pswarm status --home {directory}` "
         f"shows it; stop it first (`p2pswarm leave --home {directory}`), or give this one "
         "another --home (each agent on a machine needs its own)", EXIT_FAILURE)


def refuse_a_busy_http_port(host: str, port: int) -> None:
    """One line when another program holds --http's port (the server binds it again
    itself, and says the same if the port is taken in between)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            fail(http_port_busy(host, port, exc.strerror or str(exc)), EXIT_FAILURE)


def http_port_busy(host: str, port: int, why: str) -> str:
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    other = port + 1 if port < 65535 else port - 1
    return (f"cannot serve HTTP on {bind}: {why}: another program holds port {port}; "
            f"give another --http port (e.g. --http {host}:{other}), stop the other "
            "program, or --http off")


def threads_within_cpu_quota(environ: MutableMapping[str, str]) -> None:
    """In a container with a CPU quota (``--cpus``), torch's thread pools (sized by the
    machine's cores) would be throttled to a crawl: size them by the quota instead, unless
    the user already has (OMP_NUM_THREADS), before anything imports torch."""
    from p2pswarm.inventory import cpu_threads, read_cgroup_limits

    threads = cpu_threads(read_cgroup_limits())
    if threads is not None and "OMP_NUM_THREADS" not in environ:
        environ["OMP_NUM_THREADS"] = str(threads)


def idle_threads_sleep(environ: MutableMapping[str, str]) -> None:
    """Let torch's idle OpenMP threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``)
    instead of spinning for milliseconds after every operator, unless the user chose
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME); before anything imports torch.

    A fellow rarely has its cores alone: the next stage's fellow, the driver and other
    programs wait for them. A stage's threads that spin after its forward pass take the
    cores the next stage then computes on, and under load a spinning team waits at every
    operator for its descheduled members."""
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"} & set(environ):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


@app.command()
@exits_on()
def leave(home: Optional[Path] = HomeOption) -> None:
    """Make the local agent leave the swarm gracefully (fellows mark it `left`) and exit."""
    outcome = ask_agent(home, request_map("leave", LeaveRequest()))
    typer.echo(leave_sentence(outcome))


def leave_sentence(outcome: dict[str, Any]) -> str:
    """``left the swarm: 3 of 3 fellows acknowledged`` (and what happens when not all did)."""
    acknowledged, fellows = int(outcome.get("acknowledged", 0)), int(outcome.get("fellows", 0))
    if fellows == 0:
        return "left the swarm (no fellow was connected)"
    sentence = f"left the swarm: {acknowledged} of {fellows} fellows acknowledged"
    if not outcome.get("spread", True):
        sentence += "; the rest hear it by gossip (one that misses it records this fellow dead)"
    elif acknowledged < fellows:
        sentence += ", gossip carries it to the rest"
    return sentence


def setup_logging(level: str) -> None:
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
    if level not in levels:
        fail(f"unknown --log-level {level!r}: use debug, info or warning")
    logging.basicConfig(level=levels[level], stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")


@app.command()
@exits_on()
def status(home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Show this fellow, the fellows it knows, the leader and traffic counters."""
    data = ask_agent(home, request_map("status", StatusRequest()))
    if as_json:
        print_json(data)
        return
    render_status(data)


def card_summary(card: dict[str, Any]) -> str:
    """``GPU 0 3.9/4.3 GB free`` / ``CPU 1.6/2.0 GB free (cgroup memory.max)``: a CPU's
    figure says where it came from (a container's limit, the machine's RAM, a cap)."""
    label = f"GPU {card.get('index', 0)}" if card.get("kind") == "cuda" else "CPU"
    free, total = card.get("free_bytes", 0) / 1e9, card.get("total_bytes", 0) / 1e9
    source = card.get("memory_source") if card.get("kind") == "cpu" else None
    return f"{label} {free:.1f}/{total:.1f} GB free" + (f" ({source})" if source else "")


def duration(seconds: float) -> str:
    """``3 min 46 s``, ``4 min``, ``12 s``: a wait as people say it."""
    whole = max(0, round(seconds))
    minutes, rest = divmod(whole, 60)
    if not minutes:
        return f"{rest} s"
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


def leaderless_lines(electorate: Any) -> list[str]:
    """Why a side has no leader and what ends it: a leader needs the votes of a majority
    of the electorate, the dead leave the electorate only after their time, and a fellow
    brought back counts at once. Nothing while this side is a majority (it is electing)."""
    if not isinstance(electorate, dict):
        return []
    voters, needs, sees = (int(electorate.get(k, 0)) for k in ("voters", "needs", "sees"))
    if sees >= needs:
        return []
    lines = [f"  a leader needs the votes of a majority of the electorate: {needs} of its "
             f"{voters} fellows; this side sees {sees}"]
    shrinks_in_s = electorate.get("shrinks_in_s")
    after_s = float(electorate.get("dead_leave_after_s", 0.0))
    if isinstance(shrinks_in_s, (int, float)):
        smaller = voters - 1
        lines.append(f"  in {duration(shrinks_in_s)} the electorate shrinks to {smaller} "
                     f"(a dead fellow leaves it {duration(after_s)} after it was last seen), "
                     f"then {smaller // 2 + 1} votes elect")
    lines.append("  sooner: restart a fellow that died (`p2pswarm join` on its machine) or "
                 "join another; each one seen alive counts at once")
    return lines


def members_table(members: list[dict[str, Any]], width: int) -> Any:
    """The fellows, each with its address, state, cards and when it was last heard; on a
    terminal under 110 columns without id and incarnation, so none of those is lost."""
    from rich.table import Table
    from rich.text import Text

    narrow = width < 110
    longest = max((len(str(m["addr"])) for m in members), default=21)
    address_width = min(longest, 21 if narrow else 32)
    table = Table(title=f"{len(members)} fellows")
    columns = ("name", "address", "state", "cards", "last heard") if narrow else \
        ("name", "id", "address", "state", "inc", "proto", "cards", "last heard")
    # narrow: a fellow's protocol shows by its name when it differs from this one's
    own = next((m.get("protocol") for m in members if m.get("self")), None)
    for column in columns:
        # an address, a name and where a card's memory figure came from are never cut
        # short; "last heard" is what tells a live fellow from a silent one
        # (rich narrows the widest wrapping columns first, then widens the ones under
        # their min_width again, past the terminal's edge: the address's width is fixed
        # instead, and a longer one folds)
        table.add_column(column, overflow="fold" if column in ("name", "address", "cards")
                         else "ellipsis", no_wrap=column in ("state", "last heard"),
                         width=address_width if column == "address" else None,
                         min_width={"last heard": 10, "state": 5}.get(column))
    for m in members:
        cards = ", ".join(card_summary(c) for c in m.get("cards", [])) or "-"
        heard = m.get("last_heard_s")
        protocol = m.get("protocol")
        other = f" (protocol {protocol})" if narrow and None not in (own, protocol) \
            and protocol != own else ""
        cells = {"name": Text(str(m["name"]) + (" (this one)" if m.get("self") else "")
                              + other), "proto": str(protocol or "-"),
                 "id": str(m["id"])[:8], "address": Text(str(m["addr"])),
                 "state": str(m["state"]), "inc": str(m["incarnation"]), "cards": Text(cards),
                 "last heard": "-" if heard is None else f"{heard:.1f} s ago"}
        table.add_row(*(cells[c] for c in columns))
    return table


def render_status(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.text import Text

    # names, addresses and card names come from fellows: shown as text, never as markup
    console = Console()
    me = data["self"]
    leader = data.get("leader")
    # the address fellows are told, never cut short: it is what a user checks first
    listen = me.get("listen")
    bound = f" (listening on {escape(str(listen))})" if listen and listen != me["addr"] else ""
    console.print(f"[bold]{escape(str(me['name']))}[/] ({me['id'][:8]}) at "
                  f"{escape(str(me['addr']))}{bound}, "
                  f"preset {data.get('preset')}, health {data.get('health', 0)}",
                  soft_wrap=True)
    if leader:
        console.print(f"leader: [bold]{escape(str(leader['name']))}[/] ({leader['id'][:8]}), "
                      f"term {leader['term']}")
    else:
        console.print(Text(f"leader: {data.get('leader_note') or 'none yet'}"))
        for line in leaderless_lines(data.get("electorate")):
            console.print(Text(line))
    console.print(members_table(data["members"], console.width))
    held = data.get("stages_held") or []
    if held:
        console.print(Text("holds: " + ", ".join(
            f"stage {h['stage']} of {h['plan_id']} ({h['state']}, "
            f"{h.get('claim_bytes', 0) / 1e6:,.1f} MB claimed)" for h in held)))
    counters = data.get("counters", {})
    drops = counters.get("drops") or {}
    console.print(
        f"datagrams in/out {counters.get('datagrams_in', 0)}/{counters.get('datagrams_out', 0)}"
        f", streams in/out {counters.get('streams_in', 0)}/{counters.get('streams_out', 0)}"
        + (", drops: " + ", ".join(f"{k} {v}" for k, v in drops.items()) if drops else ""))
    watch = data.get("self_watch")
    if isinstance(watch, dict):
        held = watch.get("held_by_fellow") or {}
        most = max(held.values(), key=lambda h: h.get("bytes", 0), default=None)
        console.print(Text(
            f"loop lag {watch.get('loop_lag_ms', 0):.0f} ms (the most in the last minute "
            f"{watch.get('loop_lag_recent_max_ms', 0):.0f} ms, since start "
            f"{watch.get('loop_lag_max_ms', 0):.0f} ms); fellows' streams hold "
            f"{watch.get('held_bytes', 0) / 2**20:.1f} MiB"
            + (f", the most {most.get('bytes', 0) / 2**20:.1f} MiB by {most.get('name')}"
               if most else "")))
    for line in (admission_line(data.get("admission")), disks_line(data.get("disks"))):
        if line:
            console.print(Text(line))


def admission_line(doc: Any) -> str:
    """``admitted under invitation 1a2b3c4d slot 2 of 5 (by the admin key), until ...;
    issues certificates; 1 revocation known, 3 refused``."""
    if not isinstance(doc, dict):
        return ""
    cert = doc.get("certificate")
    if isinstance(cert, dict):
        by = "the admin key" if cert.get("issuer") == "admin" else \
            f"issuer {str(cert.get('issuer'))[:8]}"
        until = time.strftime("%Y-%m-%d", time.gmtime(int(cert.get("expires_at_s", 0))))
        text = (f"admitted under invitation {cert.get('invitation')} slot {cert.get('slot')} "
                f"of {cert.get('uses')} (by {by}), until {until}")
    else:
        text = "not admitted yet"
    if doc.get("issues"):
        text += "; issues certificates" + (" (delegated)" if doc.get("delegated") else "")
    refused = sum(int(v) for v in (doc.get("refused") or {}).values()) \
        + int(doc.get("refused_asks", 0))
    revocations = int(doc.get("revocations", 0))
    return (f"{text}; {revocations} revocation{'' if revocations == 1 else 's'} known, "
            f"{refused} refused")


def disks_line(disks: Any) -> str:
    """``status``'s stores against their caps, on one line ("" when there are none)."""
    if not isinstance(disks, list) or not disks:
        return ""
    parts = []
    for d in disks:
        if not isinstance(d, dict):
            continue
        used = f"{int(d.get('used_bytes') or 0) / 1e9:.2f}"
        cap = d.get("cap_bytes")
        parts.append(f"{d.get('store')} {used}/{int(cap) / 1e9:.1f} GB" if cap
                     else f"{d.get('store')} {used} GB")
    return "disk: " + ", ".join(parts)
