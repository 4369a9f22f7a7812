"""Frozen configuration with documented presets.

Three presets, in the spirit of memberlist's: ``lan()`` for wired machines on one switch,
``wifi()`` for laptops and Raspberry Pis on a lossy, bursty radio, ``local()`` for several
fellows on one machine (tests, the demo). Every field carries its unit in its name.
Derive a variant with ``dataclasses.replace``.

One config holds everything the machines are tuned by, as memberlist's ``Config`` does:
``GossipConfig`` carries the SWIM timings and, in ``tuning``, the Lifeguard refinements
beyond them (``GossipTuning``); ``ElectionConfig`` carries the election's timings and,
in ``tuning``, its finer knobs (``ElectionTuning``). The tunings' defaults are the
measured ones and every preset keeps them; the memberlist-defaults baseline the
simulation compares against is one more such function (``p2pswarm.sim.baseline``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from p2pswarm.errors import ConfigError

# The gossip port (UDP and TCP), when --listen and a seed's address name none. Not 7946:
# Docker Swarm's own node-to-node gossip (7946 tcp/udp, beside 2377 and 4789) holds it on
# every swarm node, and fellows run there with host networking. 7782 is unassigned by
# IANA and sits beside the HTTP API's 7780.
DEFAULT_PORT = 7782


@dataclass(frozen=True, slots=True)
class TransportConfig:
    max_datagram_bytes: int = 1400  # largest sealed datagram we send; fits one Ethernet MTU
    max_frame_bytes: int = 64 * 1024 * 1024  # largest stream frame accepted (tensors, state)
    max_shard_bytes: int = 1 << 40  # largest stage state or checkpoint shard accepted (in parts)
    max_job_data_bytes: int = 4 << 30  # the most text a job's data files may bring along
    stream_connect_timeout_s: float = 5.0  # giving up on a TCP connect
    stream_idle_timeout_s: float = 60.0  # closing a stream that says nothing this long
    receive_queue_datagrams: int = 1024  # datagrams buffered before new ones are dropped
    # Accepted connections (docs/security.md): over a cap a new one is closed at once
    max_streams: int = 1024  # accepted streams open at once, authenticated or not
    max_streams_per_host: int = 256  # ... from one source host
    max_unauthenticated_streams: int = 128  # accepted streams still in their handshake
    max_unauthenticated_per_host: int = 16  # ... from one source host
    max_streams_per_fellow: int = 128  # authenticated streams one fellow may hold open here
    # Bytes held in frames still arriving (a frame's announced size, reserved before it is
    # read), per source host and per fellow; never below max_frame_bytes
    max_held_frame_bytes_per_host: int = 64 * 1024 * 1024
    max_held_frame_bytes_per_fellow: int = 64 * 1024 * 1024
    accept_pause_s: float = 0.5  # out of file descriptors: stop accepting this long


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    replay_window_datagrams: int = 1024  # sequence numbers remembered per sender epoch
    handshake_timeout_s: float = 5.0  # a stream handshake must finish within this


@dataclass(frozen=True, slots=True)
class GossipTuning:
    """The membership machine's knobs beyond SWIM's timings (the Lifeguard refinements
    and ours; see ``p2pswarm.membership.machine``); the defaults are the measured ones."""

    # Probing
    random_probe_every: int = 3  # every n-th probe walks the shuffled round-robin; the
    ring_depth: int = 2  # others go to this node's ring successors, first, second, ... in turn
    nack_after_fraction: float = 0.8  # a helper sends its nack after this much of a timeout
    # Link-quality estimate (fraction of direct pings that missed their ack)
    loss_prior: float = 0.15  # where the estimate starts: cautious until measured
    loss_alpha: float = 1.0 / 16.0  # EWMA weight of one probe
    lossy_reference: float = 0.2  # at this estimate the "lossy" settings apply in full
    recheck_above_loss: float = 0.05  # above it, a failed probe is repeated before suspecting
    doubt_span_lossy_s: float = 1.0  # ... and on a lossy network, failed probes spanning
    # this long (less as the loss is less) raise suspicion: a shorter radio fade is doubt.
    fade_quantile: float = 0.9  # the span also covers this share of the silences this
    fade_samples: int = 64  # node last saw fellows come back from (once it has seen 8),
    doubt_span_max_s: float = 2.0  # up to this: heavy-tailed fades wait longer, short
    # bursts (where crashes must be found fast) give it less to grow on.
    # Suspicion
    suspicion_floor_clean_s: float = 0.8  # shortest suspicion on a clean network
    suspicion_floor_lossy_s: float = 3.0  # ... on a lossy, bursty one (spans radio fades)
    confirmations_expected: int = 2  # confirmations that bring the timeout to its floor
    independence_gap_clean_s: float = 0.0  # confirmations closer than this count once
    independence_gap_lossy_s: float = 0.4
    confirm_fanout: int = 4  # fellows expected to probe a suspect at once to confirm it
    evidence_fresh_s: float = 1.5  # a dead verdict needs a failed probe of our own this new
    streak_max_gap_s: float = 1.9  # failed probes further apart do not make one run
    watch_fraction: float = 0.5  # a watched suspect is probed every this much of an interval
    deaf_refute_s: float = 1.0  # heard nothing this long: refute any suspicion unasked
    declare_max_score: int = 2  # no dead verdicts from a node whose own health is worse
    # Dissemination and anti-entropy
    linger_s: float = 4.0  # sent-out updates still ride where a datagram has room
    fresh_fanout_mult: int = 2  # a gossip round carrying unsent news goes to this many x
    gossip_to_dead_s: float = 30.0  # keep gossiping to a dead fellow this long (it may refute)
    reconnect_interval_s: float = 10.0  # try anti-entropy with a dead fellow this often
    reconnect_for_s: float = 24 * 3600.0  # ... even after its tombstone is reaped, this long
    reconnect_max_lost: int = 256  # reaped fellows remembered for that
    refute_by_stream: bool = True  # push a refutation to its accuser over a stream too
    meta_pull_retry_s: float = 5.0  # how soon a failed metadata pull is tried again
    meta_inline_bytes: int = 512  # metadata up to this size rides in its Alive (memberlist's
    # limit): gossip spreads it where a pull over a lossy link waits out TCP's timers
    join_retry_min_s: float = 1.0  # first backoff between join attempts


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """SWIM + Lifeguard timing (see p2pswarm.membership)."""

    probe_interval_s: float = 1.0  # one member probed per interval
    probe_timeout_s: float = 0.5  # wait for a direct ack before asking others
    indirect_checks: int = 3  # fellows asked to ping-req a target that missed its ack
    suspicion_mult: float = 4.0  # suspicion timeout = mult * log10(max(N, 10)) * interval
    suspicion_max_timeout_mult: float = 6.0  # upper bound of suspicion as a multiple of it
    retransmit_mult: int = 4  # piggyback each update mult * log10(N + 1) times
    gossip_interval_s: float = 0.2  # how often buffered updates are pushed to random fellows
    gossip_nodes: int = 3  # fellows each gossip round goes to
    push_pull_interval_s: float = 30.0  # full-state anti-entropy with one random fellow
    awareness_max_multiplier: int = 8  # Lifeguard local health: probe slows up to this x
    dead_reap_after_s: float = 60.0  # tombstone time before a dead member is forgotten
    join_retry_max_s: float = 30.0  # upper bound of the backoff between join attempts
    leave_timeout_s: float = 2.0  # a leaver waits at most this long for its goodbye to spread
    tuning: GossipTuning = field(default_factory=GossipTuning)  # the finer knobs (above)


@dataclass(frozen=True, slots=True)
class ElectionTuning:
    """The election's knobs beyond its timings (see ``p2pswarm.election``); the defaults
    are the measured ones."""

    deputies: int = 3  # fellows the leader beats; the first in line to succeed it
    rank_spacing_s: float = 1.0  # each place further down the succession waits this longer
    check_timeout_s: float = 0.5  # a voter's own check of the leader waits this long
    vote_timeout_s: float = 1.5  # a candidate waits this long for (pre)votes
    vote_resend_s: float = 0.3  # ... asking again those that have not answered this often
    announce_retry_s: float = 0.2  # a new leader resends LeaderIs to the unacked this often
    announce_retry_for_s: float = 5.0  # ... for this long
    announce_relay: int = 2  # a fellow that learns of a new leader tells this many more
    announce_interval_s: float = 15.0  # and to everyone every this often
    query_interval_s: float = 2.0  # a fellow without a leader asks around this often
    jitter_s: float = 0.2  # random extra wait before a candidacy
    handover_after_s: float = 10.0  # a fellow of higher priority, alive this long, takes over
    settle_s: float = 3.0  # a fellow just joined (or restarted) neither runs nor votes this long
    # Local health (Lifeguard's, for the election): a fellow whose own loop ran late, or
    # whose leader's beats came in late, waits longer before it blames the leader
    lag_stretch_mult: float = 2.0  # the beat and check timeouts grow by this x the lag
    lag_stretch_max_s: float = 3.0  # ... by at most this (a crash still moves in 10 s)
    lag_half_life_s: float = 10.0  # a lag seen counts half as much this much later


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    election_timeout_min_s: float = 1.5  # a follower waits at least this long without a leader
    election_timeout_max_s: float = 3.0  # ... and at most this long (randomised)
    heartbeat_interval_s: float = 0.5  # leader's heartbeat period
    leader_lease_s: float = 4.0  # a leader steps down after this long without a majority
    electorate_dead_after_s: float = 240.0  # a dead fellow stops counting in majorities after
    tuning: ElectionTuning = field(default_factory=ElectionTuning)  # the finer knobs (above)


@dataclass(frozen=True, slots=True)
class InventoryConfig:
    """When a fellow tells the swarm its cards again (``p2pswarm.inventory.GossipRule``).

    A card's free memory (or what another program holds on it) has moved when it is more
    than ``max(gossip_step_bytes, gossip_step_fraction x the card's total)`` away from
    the value last gossiped. A move is gossiped once it has held for
    ``gossip_settle_reads`` reads in a row, at once when it passes
    ``gossip_urgent_fraction`` of the card. A card appearing, going or changing, and this
    fellow's own stages loading or unloading, are gossiped at once.
    """

    refresh_interval_s: float = 5.0  # how often cards are read again
    gossip_step_bytes: int = 256 * 1024 * 1024  # smaller moves are never news
    gossip_step_fraction: float = 1 / 16  # ... nor moves under this share of the card
    gossip_settle_reads: int = 2  # a move must hold this many reads in a row (not a spike)
    gossip_urgent_fraction: float = 1 / 4  # a move past this share of the card: at once


@dataclass(frozen=True, slots=True)
class ComputeConfig:
    """How the torch work (serving stages, training steps, checkpoints) shares the machine
    with the agent's own loop, which gossips, beats and answers probes."""

    # The worker threads that run it, and the threads torch starts from them, run this
    # many nice levels below the agent (Linux; 0: the same priority). Raising one's own
    # nice needs no privilege; a machine that trains then still answers in time.
    nice: int = 10
    # A plan made for a fellow runs on a thread of its own, one at a time per asker and at
    # most this many at once; one that takes longer than its budget is refused.
    plan_budget_s: float = 10.0
    plans_at_once: int = 2
    # The agent watches its own loop: a tick this often, a lag above this is logged.
    loop_watch_interval_s: float = 0.25
    loop_lag_warn_s: float = 0.1


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Serving's timings (``p2pswarm.agent.serving``): the leader's orders to a load's
    fellows, a stage's reservation, and failover's watch over a load's fellows. Every
    preset keeps these: a fade on a radio is what ``grace_s`` already spans."""

    order_timeout_s: float = 30.0  # StagePrepare, StageStart, StageRelease to one fellow
    load_timeout_s: float = 3600.0  # StageLoad: fetching and building a big stage
    reservation_s: float = 120.0  # a stage reserved or loaded but never started is dropped
    grace_s: float = 8.0  # a silent fellow keeps its stage this long (a 5 s radio fade)
    check_timeout_s: float = 1.0  # one StageCheck waits this long before it is asked again
    check_retry_s: float = 0.25  # ... and is asked again after this
    watch_s: float = 0.5  # how often the leader looks at its loads' fellows
    retry_waiting_s: float = 2.0  # a load waiting for a card tries again this often
    release_for_s: float = 120.0  # a lost fellow that comes back is told to release this long
    look_after_change_s: float = 30.0  # a leader watches this long for kept loads after a change
    keep_order_timeout_s: float = 5.0  # one fellow handed a load's orders or an unload
    member_watch_s: float = 0.25  # how often a driver looks at its stage fellows' state


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """What other fellows can make this one keep on disk, at most. A store past its cap
    drops what was used least recently, never what a live stage or job uses; what still
    does not fit is refused. None: a share of the disk the store lives on
    (``p2pswarm.disk_budget``: 35 %, 15 %, 10 %, 10 %, at most 64, 64, 64 and 4 GiB); a
    number is still cut to the disk's size. (One job's data:
    ``transport.max_job_data_bytes``.)"""

    weights_cache_bytes: int | None = None  # tensors fetched for stages (HOME/weights)
    checkpoint_copies_bytes: int | None = None  # checkpoint shards held for the leader
    job_checkpoints_bytes: int | None = None  # a leader's own (HOME/job-checkpoints)
    job_data_bytes: int | None = None  # jobs' data files (HOME/job-data)


# --- training timings ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    """How long the leader's driver of a training job waits, and how often it retries.
    ``simulated_step_s`` is for simulations only: the virtual seconds one step of a
    hosted stage takes (compute runs inline and takes none); 0 in the real world."""

    step_timeout_s: float = 120.0  # the most the driver waits for one stage's step
    open_timeout_s: float = 30.0  # the most an order to a stage, or opening its stream, takes
    retry_s: float = 5.0  # a pending job (or a paused replica) tries its fellows this often
    simulated_step_s: float = 0.0

    def simulating(self, step_s: float, *, step_timeout_s: float | None = None,
                   retry_s: float | None = None) -> TrainingConfig:
        """These timings in virtual time: each hosted step takes ``step_s``; a timeout
        or a retry left None stays as it is."""
        return replace(self, simulated_step_s=step_s,
                       step_timeout_s=self.step_timeout_s if step_timeout_s is None
                       else step_timeout_s,
                       retry_s=self.retry_s if retry_s is None else retry_s)


def training_real() -> TrainingConfig:
    """Real machines: a step may take minutes on a slow card."""
    return TrainingConfig()


def training_sim(step_s: float) -> TrainingConfig:
    """A simulated swarm whose hosted steps take ``step_s`` virtual seconds: the driver
    waits ten steps for one and retries every two seconds (the harness's timings)."""
    return TrainingConfig().simulating(step_s, step_timeout_s=10.0 * step_s, retry_s=2.0)


# --- the whole config ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    preset: str = "lan"  # the preset this was derived from, for status output
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    election: ElectionConfig = field(default_factory=ElectionConfig)
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


def lan() -> SwarmConfig:
    """Wired machines on one switch: memberlist's LAN timings."""
    return SwarmConfig(preset="lan")


def wifi() -> SwarmConfig:
    """Laptops and Pis on a radio that drops bursts of packets.

    Probes go out as often as on a LAN (detection speed), but a member must miss acks
    for longer before it is declared dead, because a burst of loss on a radio can last
    a few seconds and every confirmation behind the same radio is lost together.
    """
    return SwarmConfig(
        preset="wifi",
        gossip=GossipConfig(
            probe_timeout_s=0.5,
            indirect_checks=4,
            suspicion_mult=5.0,
            retransmit_mult=5,
            gossip_nodes=4,
            push_pull_interval_s=20.0,
        ),
        election=ElectionConfig(election_timeout_min_s=2.0, election_timeout_max_s=4.0,
                                leader_lease_s=6.0),
    )


def local() -> SwarmConfig:
    """Several fellows on one machine: short timeouts, frequent anti-entropy."""
    return SwarmConfig(
        preset="local",
        gossip=GossipConfig(
            probe_interval_s=0.5,
            probe_timeout_s=0.2,
            suspicion_mult=3.0,
            gossip_interval_s=0.1,
            push_pull_interval_s=10.0,
            dead_reap_after_s=30.0,
        ),
        election=ElectionConfig(election_timeout_min_s=0.5, election_timeout_max_s=1.0,
                                heartbeat_interval_s=0.2, leader_lease_s=2.0),
        inventory=InventoryConfig(refresh_interval_s=2.0),
    )


PRESETS = {"lan": lan, "wifi": wifi, "local": local}


def preset(name: str) -> SwarmConfig:
    """The preset called ``name``, or a ConfigError that lists the choices."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}: use one of {', '.join(sorted(PRESETS))}"
        ) from None


__all__ = [
    "DEFAULT_PORT", "TransportConfig", "SecurityConfig", "GossipTuning", "GossipConfig",
    "ElectionTuning", "ElectionConfig", "InventoryConfig", "StorageConfig", "ComputeConfig",
    "ServingConfig", "SwarmConfig", "TrainingConfig", "training_real", "training_sim",
    "lan", "wifi",
    "local", "preset", "replace", "split_addr",
]


def split_addr(text: str, *, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``, or ``"[v6]:port"``) as (host, port); ConfigError if bad."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        host, port_text = text, str(default_port)
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"address {text!r} has no host: write it as HOST:PORT, "
                          f"e.g. 192.168.1.20:{DEFAULT_PORT}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"address {text!r} has a bad port: write it as HOST:PORT with "
                          f"a port from 0 to 65535, e.g. 192.168.1.20:{DEFAULT_PORT}")
    return host, int(port_text)
