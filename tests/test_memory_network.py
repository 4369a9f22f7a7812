"""MemoryNetwork in virtual time: the models' statistics, partitions, downs, streams, replay.

Every test runs under an autojump MockClock, so ``trio.sleep`` is virtual and free. The
statistical tests state their bounds: a seeded run is deterministic, so a bound of
several standard errors is a check that the model is right, not a source of flakiness.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from statistics import NormalDist

import pytest
import trio
import trio.testing

from p2pswarm.config import TransportConfig
from p2pswarm.errors import ConfigError, TransportError
from p2pswarm.transport import Stream, Transport
from p2pswarm.transport.memory import (
    Bernoulli,
    FixedDelay,
    GilbertElliott,
    LinkModel,
    LognormalDelay,
    MemoryNetwork,
    PacketRecord,
    ParetoDelay,
    UniformDelay,
)

BIG_QUEUE = TransportConfig(receive_queue_datagrams=1_000_000)


@asynccontextmanager
async def running(net: MemoryNetwork) -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        yield nursery
        nursery.cancel_scope.cancel()


def drain(transport: Transport) -> list[tuple[bytes, str]]:
    """What sits in a transport's receive queue now (memory transports only)."""
    items = []
    while True:
        try:
            items.append(transport._datagram_out.receive_nowait())  # type: ignore[attr-defined]
        except trio.WouldBlock:
            return items


async def send_rounds(net: MemoryNetwork, pairs: list[tuple[Transport, str]], rounds: int,
                      interval_s: float) -> None:
    """Every interval, each (transport, dst) pair sends one datagram carrying its round."""
    for round_ in range(rounds):
        payload = round_.to_bytes(4, "big")
        for transport, dst in pairs:
            await transport.send_datagram(dst, payload)
        await trio.sleep(interval_s)


def make_links(net: MemoryNetwork, count: int) -> list[tuple[Transport, str]]:
    pairs = []
    for i in range(count):
        src = net.transport(f"s{i}:1")
        dst = net.transport(f"r{i}:1")
        pairs.append((src, dst.local_addr))
    return pairs


def lost_runs(outcomes: list[bool]) -> list[int]:
    """Lengths of the runs of consecutive losses."""
    runs, current = [], 0
    for lost in outcomes:
        if lost:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


def per_link_outcomes(trace: list[PacketRecord]) -> dict[tuple[str, str], list[bool]]:
    """Lost or not, per link, in send order (originals only)."""
    by_link: dict[tuple[str, str], dict[int, bool]] = {}
    for record in trace:
        if record.copy == 0:
            by_link.setdefault((record.src, record.dst), {})[record.seq] = (
                record.outcome != "delivered")
    return {link: [lost[seq] for seq in sorted(lost)] for link, lost in by_link.items()}


# --- loss ----------------------------------------------------------------------------------


async def test_bernoulli_loss_rate(autojump_clock: trio.abc.Clock) -> None:
    p, links, rounds = 0.1, 40, 500
    net = MemoryNetwork(seed=11, config=BIG_QUEUE, record=True)
    net.set_default(LinkModel(loss=Bernoulli(p)))
    pairs = make_links(net, links)
    async with running(net):
        await send_rounds(net, pairs, rounds, 0.01)
        await trio.sleep(1)
    n = links * rounds
    observed = net.counters["lost_link"] / n
    standard_error = math.sqrt(p * (1 - p) / n)
    assert abs(observed - p) < 5 * standard_error, (observed, standard_error)
    assert net.counters["delivered"] + net.counters["lost_link"] == n == net.counters["sent"]


async def test_gilbert_elliott_loss_fraction_and_burst_time(
        autojump_clock: trio.abc.Clock) -> None:
    """Loss fraction and mean burst duration, in time, match the model.

    Sampling the chain every ``interval`` gives a two-state Markov chain with
    P(bad -> bad) = f + (1 - f) * rho, rho = exp(-interval / tau), 1/tau = 1/burst + 1/gap.
    So a run of losses lasts interval / ((1 - f) * (1 - rho)) on average (exactly, no
    bias from bursts that fall between two packets), which tends to mean_burst_s as the
    interval shrinks. The loss fraction's standard error uses the same correlation.
    Half the links send twice as often: a burst lasts the same time on both, so it
    holds twice the packets on the fast ones.
    """
    model = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.1)
    tick, links, rounds = 0.01, 40, 3000
    net = MemoryNetwork(seed=12, config=BIG_QUEUE, record=True)
    net.set_default(LinkModel(loss=model))
    pairs = make_links(net, links)
    fast, slow = pairs[: links // 2], pairs[links // 2:]
    async with running(net):
        for round_ in range(rounds):
            for transport, dst in fast if round_ % 2 else pairs:
                await transport.send_datagram(dst, b"x")
            await trio.sleep(tick)
        await trio.sleep(1)
    assert net.trace is not None
    outcomes = per_link_outcomes(net.trace)
    f = model.bad_fraction
    tau = 1 / (1 / model.mean_burst_s + 1 / model.mean_gap_s)
    mean_runs = {}
    for group, interval in ((fast, tick), (slow, 2 * tick)):
        group_outcomes = [outcomes[(t.local_addr, dst)] for t, dst in group]
        rho = math.exp(-interval / tau)
        n = sum(len(o) for o in group_outcomes)
        fraction = sum(sum(o) for o in group_outcomes) / n
        fraction_se = math.sqrt(f * (1 - f) / n * (1 + rho) / (1 - rho))
        assert abs(fraction - f) < 5 * fraction_se, (interval, fraction, fraction_se)

        runs = [run for o in group_outcomes for run in lost_runs(o)]
        leave = (1 - f) * (1 - rho)  # P(bad -> good) per interval
        expected_burst_s = interval / leave
        assert abs(expected_burst_s - model.mean_burst_s) < 0.15 * model.mean_burst_s
        burst_s = interval * sum(runs) / len(runs)
        # Run lengths are geometric(leave): sd sqrt(1 - leave) / leave, over len(runs).
        burst_se = interval * math.sqrt(1 - leave) / leave / math.sqrt(len(runs))
        assert len(runs) > 500
        assert abs(burst_s - expected_burst_s) < 5 * burst_se, (interval, burst_s, burst_se)
        mean_runs[interval] = sum(runs) / len(runs)
    assert mean_runs[tick] > 1.7 * mean_runs[2 * tick]


async def test_heavy_tailed_bursts_keep_the_time_fraction(
        autojump_clock: trio.abc.Clock) -> None:
    """Lognormal bursts with the same mean: the same fraction of time lost, longer runs.

    The bound here is loose (a quarter of f): heavy tails make the fraction converge
    slowly, and the point is only that the mean is preserved, not the variance.
    """
    heavy = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.05, burst_shape="lognormal",
                           burst_tail=1.5)
    net = MemoryNetwork(seed=13, config=BIG_QUEUE, record=True)
    net.set_default(LinkModel(loss=heavy))
    pairs = make_links(net, 20)
    async with running(net):
        await send_rounds(net, pairs, 2000, 0.01)
        await trio.sleep(1)
    fraction = net.counters["lost_link"] / net.counters["sent"]
    assert abs(fraction - 0.2) < 0.05, fraction
    with pytest.raises(ConfigError):
        GilbertElliott(bad_fraction=0.2, mean_burst_s=0.05, burst_shape="pareto", burst_tail=1)


async def test_radio_loss_is_shared_by_all_links_of_a_node(
        autojump_clock: trio.abc.Clock) -> None:
    """A's radio fades for everyone: A->B and A->C lose the same packets. The same model
    on two links instead fades them independently."""
    fade = GilbertElliott(bad_fraction=0.3, mean_burst_s=0.2)
    net = MemoryNetwork(seed=14, config=BIG_QUEUE, record=True)
    a, _, _, d = (net.transport(f"{name}:1") for name in "abcd")
    net.set_radio("a:1", fade)
    net.set_link("d:1", "b:1", LinkModel(loss=fade))
    net.set_link("d:1", "c:1", LinkModel(loss=fade))
    pairs = [(a, "b:1"), (a, "c:1"), (d, "b:1"), (d, "c:1")]
    async with running(net):
        await send_rounds(net, pairs, 1000, 0.02)
        await trio.sleep(1)
    assert net.trace is not None
    outcomes = per_link_outcomes(net.trace)
    ab, ac = outcomes[("a:1", "b:1")], outcomes[("a:1", "c:1")]
    db, dc = outcomes[("d:1", "b:1")], outcomes[("d:1", "c:1")]
    assert ab == ac and 200 < sum(ab) < 400
    assert db != dc and 200 < sum(db) < 400 and 200 < sum(dc) < 400
    assert net.counters["lost_radio"] == sum(ab) + sum(ac)
    # The receiver's radio counts too: B's radio down means nothing reaches B.
    net.set_radio("b:1", Bernoulli(1.0))
    e = net.transport("e:1")
    async with running(net):
        await e.send_datagram("b:1", b"x")
        await trio.sleep(1)
    assert net.trace[-1].outcome == "lost_radio"


async def test_a_watched_radio_reports_every_fade_that_loses_packets(
        autojump_clock: trio.abc.Clock) -> None:
    """What the radio drops is exactly what falls inside the bad stays it reports."""
    fade = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.3, burst_shape="pareto")
    net = MemoryNetwork(seed=15, config=BIG_QUEUE, record=True)
    a, _ = net.transport("a:1"), net.transport("b:1")
    net.set_radio("a:1", fade)
    stays: list[tuple[float, float]] = []
    net.watch_radio("a:1", lambda start, end: stays.append((start, end)))
    async with running(net):
        await send_rounds(net, [(a, "b:1")], 2000, 0.01)
        await trio.sleep(1)
    assert net.trace is not None and stays
    for record in net.trace:
        inside = any(start <= record.sent_at_s < end for start, end in stays)
        assert inside == (record.outcome == "lost_radio"), record


# --- delay ---------------------------------------------------------------------------------

STANDARD_NORMAL = NormalDist()


def lognormal_cdf(model: LognormalDelay, x: float) -> float:
    if x <= model.base_s:
        return 0.0
    return STANDARD_NORMAL.cdf(math.log((x - model.base_s) / model.median_extra_s) / model.sigma)


def pareto_cdf(model: ParetoDelay, x: float) -> float:
    if x <= model.base_s:
        return 0.0
    return 1 - (1 + (x - model.base_s) / model.scale_s) ** -model.alpha


def uniform_cdf(model: UniformDelay, x: float) -> float:
    return min(1.0, max(0.0, (x - model.min_s) / (model.max_s - model.min_s)))


@pytest.mark.parametrize("model, cdf", [
    (LognormalDelay(base_s=0.01, median_extra_s=0.005, sigma=0.8), lognormal_cdf),
    (ParetoDelay(base_s=0.01, scale_s=0.004, alpha=2.5), pareto_cdf),
    (UniformDelay(min_s=0.005, max_s=0.015), uniform_cdf),
])
async def test_delay_quantiles_match_the_model(autojump_clock: trio.abc.Clock, model,
                                               cdf) -> None:
    """For the empirical q-quantile X, F(X) is a Beta order statistic around q with
    standard deviation sqrt(q(1-q)/n): five of those bound it, whatever the shape."""
    links, rounds = 20, 400
    net = MemoryNetwork(seed=15, config=BIG_QUEUE, record=True)
    net.set_default(LinkModel(delay=model))
    pairs = make_links(net, links)
    async with running(net):
        await send_rounds(net, pairs, rounds, 0.1)
        await trio.sleep(1)
    assert net.trace is not None
    delays = sorted(r.at_s - r.sent_at_s for r in net.trace if r.outcome == "delivered")
    n = len(delays)
    assert n == links * rounds
    for q in (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99):
        x = delays[math.ceil(q * n) - 1]
        assert abs(cdf(model, x) - q) < 5 * math.sqrt(q * (1 - q) / n), (q, x)
    assert delays[0] >= getattr(model, "base_s", getattr(model, "min_s", 0.0))


async def test_received_datagrams_arrive_after_the_link_delay(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=16)
    net.set_default(LinkModel(delay=FixedDelay(0.25)))
    a, b = net.transport("a:1"), net.transport("b:1")
    async with running(net):
        start = trio.current_time()
        await a.send_datagram("b:1", b"hello")
        assert await b.receive_datagram() == (b"hello", "a:1")
        assert trio.current_time() - start == pytest.approx(0.25)
        with pytest.raises(TransportError, match="max_datagram_bytes"):
            await a.send_datagram("b:1", bytes(1401))
        # Nobody at the address: silent, counted.
        await a.send_datagram("nobody:1", b"x")
        assert net.counters["lost_unreachable"] == 1
        assert isinstance(a, Transport)


async def test_duplication_and_reordering_are_observable(
        autojump_clock: trio.abc.Clock) -> None:
    n, dup_p, reorder_p = 4000, 0.1, 0.2
    net = MemoryNetwork(seed=17, config=BIG_QUEUE)
    net.set_default(LinkModel(delay=FixedDelay(0.01), duplicate_probability=dup_p,
                              reorder_probability=reorder_p, reorder_extra_s=0.005))
    a, b = net.transport("a:1"), net.transport("b:1")
    arrivals: list[tuple[int, float]] = []
    sent_at: dict[int, float] = {}

    async def receive() -> None:
        while True:
            data, _ = await b.receive_datagram()
            arrivals.append((int.from_bytes(data, "big"), trio.current_time()))

    async with running(net) as nursery:
        nursery.start_soon(receive)
        for i in range(n):
            sent_at[i] = trio.current_time()
            await a.send_datagram("b:1", i.to_bytes(4, "big"))
            await trio.sleep(0.001)
        await trio.sleep(1)
    duplicates = len(arrivals) - n
    assert sorted({i for i, _ in arrivals}) == list(range(n))
    assert duplicates == net.counters["duplicated"]
    assert abs(duplicates / n - dup_p) < 5 * math.sqrt(dup_p * (1 - dup_p) / n)
    held = {i for i, at in arrivals if at - sent_at[i] > 0.012}
    assert len(held) == net.counters["reordered"]
    assert abs(len(held) / n - reorder_p) < 5 * math.sqrt(reorder_p * (1 - reorder_p) / n)
    firsts = [i for i, _ in arrivals]
    inversions = sum(1 for x, y in itertools.pairwise(firsts) if y < x)
    assert inversions > 0.5 * len(held)  # a held packet is overtaken by the next ones


async def test_bandwidth_queues_packets_and_frames(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=18)
    net.set_default(LinkModel(delay=FixedDelay(0.01), bandwidth_bytes_per_s=100_000))
    a, b = net.transport("a:1"), net.transport("b:1")
    async with running(net):
        start = trio.current_time()
        for _ in range(5):
            await a.send_datagram("b:1", bytes(1000))  # 10 ms each on the wire
        for k in range(1, 6):
            await b.receive_datagram()
            assert trio.current_time() - start == pytest.approx(0.01 * k + 0.01)


# --- partitions and downs ------------------------------------------------------------------


async def all_pairs_reach(net: MemoryNetwork, transports: dict[str, Transport]
                          ) -> set[tuple[str, str]]:
    for src, transport in transports.items():
        for dst in transports:
            if dst != src:
                await transport.send_datagram(dst, src.encode())
    await trio.sleep(1)
    return {(data.decode(), dst) for dst, t in transports.items() for data, _ in drain(t)}


async def test_partition_cuts_exactly_the_named_links_and_heal_restores(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=19)
    names = ["a:1", "b:1", "c:1", "d:1", "e:1"]
    transports = {name: net.transport(name) for name in names}
    everything = {(s, d) for s in names for d in names if s != d}
    async with running(net):
        assert await all_pairs_reach(net, transports) == everything
        net.partition({"a:1", "b:1"}, {"c:1"})  # d and e: in no group, reach everyone
        cut = {("a:1", "c:1"), ("c:1", "a:1"), ("b:1", "c:1"), ("c:1", "b:1")}
        assert await all_pairs_reach(net, transports) == everything - cut
        assert net.counters["lost_partition"] == 4
        assert not net.reachable("a:1", "c:1") and net.reachable("a:1", "b:1")
        assert net.reachable("d:1", "c:1")
        net.heal()
        assert await all_pairs_reach(net, transports) == everything
        # A new partition replaces the old one.
        net.partition({"a:1"}, {"b:1"})
        net.partition({"a:1"}, {"e:1"})
        assert net.reachable("a:1", "b:1") and not net.reachable("a:1", "e:1")
        net.heal()
        with pytest.raises(ConfigError):
            net.partition({"a:1", "b:1"}, {"b:1"})
        with pytest.raises(ConfigError):
            net.partition("a:1", "b:1")  # type: ignore[arg-type]


async def test_partition_drops_packets_in_flight(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=20, record=True)
    net.set_default(LinkModel(delay=FixedDelay(0.1)))
    a, b = net.transport("a:1"), net.transport("b:1")
    async with running(net):
        await a.send_datagram("b:1", b"x")
        await trio.sleep(0.05)
        net.partition({"a:1"}, {"b:1"})
        await trio.sleep(0.1)
        net.heal()
        assert drain(b) == []
    assert net.trace is not None
    assert [(r.outcome, r.at_s - r.sent_at_s) for r in net.trace] == [
        ("lost_partition", pytest.approx(0.1))]


async def test_down_node_sends_and_hears_nothing_until_up(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=21)
    names = ["a:1", "b:1", "c:1"]
    transports = {name: net.transport(name) for name in names}
    everything = {(s, d) for s in names for d in names if s != d}
    async with running(net):
        net.down("c:1")
        assert not net.is_up("c:1")
        assert await all_pairs_reach(net, transports) == {("a:1", "b:1"), ("b:1", "a:1")}
        assert net.counters["lost_down"] == 4
        assert net.link_counters("c:1", "a:1")["lost_down"] == 1
        net.up("c:1")
        assert await all_pairs_reach(net, transports) == everything


# --- streams -------------------------------------------------------------------------------


async def echo_handler(stream: Stream) -> None:
    while True:
        await stream.send_frame(await stream.receive_frame())


async def test_stream_connects_in_one_round_trip_and_keeps_order(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=22, config=TransportConfig(max_frame_bytes=65536))
    net.set_default(LinkModel(delay=UniformDelay(0.01, 0.05)))
    net.set_link("a:1", "b:1", LinkModel(delay=FixedDelay(0.02)))
    net.set_link("b:1", "a:1", LinkModel(delay=FixedDelay(0.03)))
    a, b = net.transport("a:1"), net.transport("b:1")
    async with running(net) as nursery:
        await nursery.start(b.serve_streams, echo_handler)
        start = trio.current_time()
        stream = await a.open_stream("b:1")
        assert trio.current_time() - start == pytest.approx(0.05)
        assert stream.peer_addr == "b:1" and isinstance(stream, Stream)
        # Jittered links still deliver a stream's frames in order.
        net.set_link("a:1", "b:1", None)
        net.set_link("b:1", "a:1", None)
        frames = [bytes([i]) * (i + 1) for i in range(200)]
        for frame in frames:
            await stream.send_frame(frame)
        assert [await stream.receive_frame() for _ in frames] == frames
        await stream.aclose()
        with pytest.raises(TransportError, match="closed"):
            await stream.receive_frame()
        with pytest.raises(TransportError, match="max_frame_bytes"):
            stream2 = await a.open_stream("b:1")
            await stream2.send_frame(bytes(net.config.max_frame_bytes + 1))


async def test_a_radio_fade_holds_stream_frames_back_in_order(
        autojump_clock: trio.abc.Clock) -> None:
    """Streams meet the radio's loss as TCP does: a frame sent into a fade goes again
    after 0.2 s, 0.4 s, ... and frames sent after it wait behind it."""
    net = MemoryNetwork(seed=23)
    net.set_default(LinkModel(delay=FixedDelay(0.01)))
    a, b = net.transport("a:1"), net.transport("b:1")
    received: list[tuple[float, bytes]] = []

    async def record(stream: Stream) -> None:
        while True:
            frame = await stream.receive_frame()
            received.append((trio.current_time(), frame))

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, record)
        stream = await a.open_stream("b:1")
        net.set_radio("b:1", Bernoulli(1.0))  # the fade: nothing crosses b's radio
        start = trio.current_time()
        for i in range(3):
            await stream.send_frame(bytes([i]))
        await trio.sleep(1.0)
        assert received == [] and net.counters["retransmitted"] == 3  # at 0, 0.2, 0.6 s
        net.set_radio("b:1", None)
        await trio.sleep(2.0)
    # the next try is 1.4 s after the first: then all three, in order, one delay later
    assert [frame for _, frame in received] == [b"\x00", b"\x01", b"\x02"]
    assert [t - start for t, _ in received] == pytest.approx([1.41] * 3)


async def test_a_lost_handshake_is_sent_again_after_a_second(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=24, config=TransportConfig(stream_connect_timeout_s=10.0))
    net.set_default(LinkModel(delay=FixedDelay(0.01)))
    a, b = net.transport("a:1"), net.transport("b:1")
    async with running(net) as nursery:
        await nursery.start(b.serve_streams, echo_handler)
        net.set_radio("a:1", Bernoulli(1.0))
        start = trio.current_time()
        async with trio.open_nursery() as inner:
            async def fade_ends() -> None:
                await trio.sleep(1.5)
                net.set_radio("a:1", None)
            inner.start_soon(fade_ends)
            await a.open_stream("b:1")
        # SYN lost at 0 and at 1 s; the one at 3 s gets through and back
        assert trio.current_time() - start == pytest.approx(3.02)
        net.set_radio("a:1", Bernoulli(1.0))
        start = trio.current_time()
        with pytest.raises(TransportError, match="timed out"):
            await a.open_stream("b:1")
        assert trio.current_time() - start == pytest.approx(10.0)


async def test_stream_backpressure(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=23, stream_window_bytes=4096)
    a, b = net.transport("a:1"), net.transport("b:1")
    accepted: list[Stream] = []
    sent = 0

    async def keep(stream: Stream) -> None:
        accepted.append(stream)
        await trio.sleep_forever()

    async def sender(stream: Stream) -> None:
        nonlocal sent
        for _ in range(10):
            await stream.send_frame(bytes(1024))
            sent += 1
        await stream.send_frame(bytes(10_000))  # larger than the window: goes alone
        sent += 1

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, keep)
        stream = await a.open_stream("b:1")
        nursery.start_soon(sender, stream)
        await trio.sleep(10)
        assert sent == 4  # the window is full, nobody reads
        await accepted[0].receive_frame()
        await trio.sleep(10)
        assert sent == 5
        for _ in range(9):
            await accepted[0].receive_frame()
        await trio.sleep(10)
        assert sent == 11
        assert len(await accepted[0].receive_frame()) == 10_000


async def test_close_drains_then_ends_the_peer(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=24)
    a, b = net.transport("a:1"), net.transport("b:1")
    got: list[bytes] = []
    ended = trio.Event()

    async def reader(stream: Stream) -> None:
        try:
            while True:
                got.append(await stream.receive_frame())
        except TransportError:
            with pytest.raises(TransportError, match="closed"):
                await stream.send_frame(b"too late")
            ended.set()
            raise

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, reader)
        stream = await a.open_stream("b:1")
        for i in range(3):
            await stream.send_frame(b"%d" % i)
        await stream.aclose()
        await stream.aclose()  # idempotent
        with trio.fail_after(60):
            await ended.wait()
        assert got == [b"0", b"1", b"2"]


async def test_refused_and_timed_out_connects(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=25, config=TransportConfig(stream_connect_timeout_s=3.0))
    net.set_default(LinkModel(delay=FixedDelay(0.01)))
    a = net.transport("a:1")
    net.transport("b:1")
    async with running(net):
        start = trio.current_time()
        with pytest.raises(TransportError, match="refused"):
            await a.open_stream("b:1")  # b does not serve streams
        assert trio.current_time() - start == pytest.approx(0.02)
        for unreachable in ("nobody:1", "b:1"):
            net.partition({"a:1"}, {"b:1"})
            start = trio.current_time()
            with pytest.raises(TransportError, match="timed out"):
                await a.open_stream(unreachable)
            assert trio.current_time() - start == pytest.approx(3.0)
        net.heal()


async def test_partition_and_down_break_streams_on_both_ends(
        autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=26, config=TransportConfig(stream_connect_timeout_s=2.0))
    a, b, c = net.transport("a:1"), net.transport("b:1"), net.transport("c:1")
    server_errors: list[str] = []

    async def handler(stream: Stream) -> None:
        try:
            await stream.receive_frame()
        except TransportError as exc:
            server_errors.append(str(exc))
            raise

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, handler)
        await nursery.start(c.serve_streams, handler)
        to_b = await a.open_stream("b:1")
        to_c = await a.open_stream("c:1")
        await trio.sleep(1)
        net.partition({"a:1"}, {"b:1"})
        with pytest.raises(TransportError, match="broke"):
            await to_b.receive_frame()
        with pytest.raises(TransportError, match="broke"):
            await to_b.send_frame(b"x")
        await trio.sleep(1)
        assert len(server_errors) == 1 and "partitioned" in server_errors[0]
        # The stream to c crossed no cut: its handler reads, returns, closes its end.
        await to_c.send_frame(b"still here")
        with pytest.raises(TransportError, match="closed"):
            await to_c.receive_frame()
        net.heal()

        to_c = await a.open_stream("c:1")
        await trio.sleep(1)
        net.down("c:1")
        with pytest.raises(TransportError, match="down"):
            await to_c.receive_frame()
        await trio.sleep(1)
        assert "c:1 went down" in server_errors[1]
        with pytest.raises(TransportError, match="down"):
            await c.open_stream("a:1")  # from a down node: at once
        start = trio.current_time()
        with pytest.raises(TransportError, match="timed out"):
            await a.open_stream("c:1")  # to a down node: silence
        assert trio.current_time() - start == pytest.approx(2.0)
        net.up("c:1")
        stream = await a.open_stream("c:1")
        await stream.send_frame(b"back")


async def test_transport_close_stops_everything(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=27)
    a, b = net.transport("a:1"), net.transport("b:1")
    cancelled = trio.Event()
    served = trio.Event()

    async def handler(stream: Stream) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    async def serve() -> None:
        await b.serve_streams(handler)
        served.set()

    async def receive_until_closed() -> None:
        with pytest.raises(TransportError, match="closed"):
            await b.receive_datagram()

    async with running(net) as nursery:
        nursery.start_soon(serve)
        nursery.start_soon(receive_until_closed)
        await trio.sleep(1)
        stream = await a.open_stream("b:1")
        await trio.sleep(1)
        await b.aclose()
        with trio.fail_after(60):
            await served.wait()
        assert cancelled.is_set()
        with pytest.raises(TransportError, match="closed"):
            await stream.receive_frame()  # the handler's stream was closed: FIN arrived
        with pytest.raises(TransportError, match="closed"):
            await b.send_datagram("a:1", b"x")
        await a.send_datagram("b:1", b"x")  # to a closed transport: silent
        await trio.sleep(1)
        assert net.counters["lost_unreachable"] == 1
        # A restarted fellow gets a fresh transport at the same address.
        b2 = net.transport("b:1")
        await a.send_datagram("b:1", b"again")
        assert await b2.receive_datagram() == (b"again", "a:1")
        with pytest.raises(TransportError, match="already has an open transport"):
            net.transport("b:1")


async def test_a_failing_handler_does_not_stop_serving(autojump_clock: trio.abc.Clock) -> None:
    net = MemoryNetwork(seed=28)
    a, b = net.transport("a:1"), net.transport("b:1")

    async def handler(stream: Stream) -> None:
        frame = await stream.receive_frame()
        if frame == b"boom":
            raise ValueError("a bug in the handler")
        await stream.send_frame(frame)

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, handler)
        bad = await a.open_stream("b:1")
        await bad.send_frame(b"boom")
        with pytest.raises(TransportError, match="closed"):
            await bad.receive_frame()
        good = await a.open_stream("b:1")
        await good.send_frame(b"fine")
        assert await good.receive_frame() == b"fine"


# --- determinism and scale -----------------------------------------------------------------


async def wifi_run(seed: int) -> tuple[dict[str, list[tuple[float, str, bytes]]],
                                       list[PacketRecord]]:
    """Five fellows on a jittery, bursty, duplicating radio; what each one heard, when."""
    net = MemoryNetwork(seed=seed, record=True)
    net.set_default(LinkModel(
        delay=LognormalDelay(base_s=0.002, median_extra_s=0.003, sigma=1.0),
        loss=GilbertElliott(bad_fraction=0.1, mean_burst_s=0.05),
        duplicate_probability=0.02, reorder_probability=0.05))
    net.set_radio("n0:1", GilbertElliott(bad_fraction=0.2, mean_burst_s=0.3))
    names = [f"n{i}:1" for i in range(5)]
    transports = [net.transport(name) for name in names]
    heard: dict[str, list[tuple[float, str, bytes]]] = {name: [] for name in names}

    async def listen(transport: Transport) -> None:
        while True:
            data, src = await transport.receive_datagram()
            heard[transport.local_addr].append((trio.current_time(), src, data))

    async with running(net) as nursery:
        for transport in transports:
            nursery.start_soon(listen, transport)
        for round_ in range(300):
            for i, transport in enumerate(transports):
                for name in names:
                    if name != transport.local_addr:
                        await transport.send_datagram(name, b"%d/%d" % (round_, i))
            await trio.sleep(0.01)
        await trio.sleep(2)
    assert net.trace is not None
    return heard, net.trace


def test_the_same_seed_replays_exactly() -> None:
    def run(seed: int):  # type: ignore[no-untyped-def]
        return trio.run(wifi_run, seed, clock=trio.testing.MockClock(autojump_threshold=0))

    first, second, other = run(5), run(5), run(6)
    assert first == second
    assert first != other
    _, trace = first
    assert len(trace) > 5000
    outcomes = {record.outcome for record in trace}
    assert {"delivered", "lost_link", "lost_radio"} <= outcomes


async def test_a_thousand_fellows(autojump_clock: trio.abc.Clock) -> None:
    """Scale: 1000 transports, 20,000 datagrams on 20,000 links, one scheduler task."""
    net = MemoryNetwork(seed=29)
    net.set_default(LinkModel(delay=UniformDelay(0.001, 0.01), loss=Bernoulli(0.01)))
    names = [f"10.0.{i // 250}.{i % 250}:7946" for i in range(1000)]
    transports = [net.transport(name) for name in names]
    async with running(net):
        for round_ in range(20):
            for i, transport in enumerate(transports):
                await transport.send_datagram(names[(i * 37 + round_ * 101 + 1) % 1000], b"p")
            await trio.sleep(0.1)
        await trio.sleep(1)
    received = sum(len(drain(t)) for t in transports)
    assert received == net.counters["delivered"]
    assert received + net.counters["lost_link"] == 20_000


# --- the network's own event loop: direct delivery and alarms --------------------------------

async def _deliveries_and_alarms(net: MemoryNetwork) -> list[tuple[float, str]]:
    """What a fellow on deliver_to/call_at sees: every datagram and alarm, with its time."""
    net.set_default(LinkModel(delay=FixedDelay(0.25)))
    a, b = net.transport("a:1"), net.transport("b:1")
    seen: list[tuple[float, str]] = []
    b.deliver_to(lambda data, addr: seen.append((trio.current_time(), f"{addr} {data!r}")))
    async with running(net):
        b.call_at(1.0, lambda: seen.append((trio.current_time(), "alarm 1")))
        b.call_at(0.5, lambda: seen.append((trio.current_time(), "alarm 0.5")))
        await a.send_datagram("b:1", b"hello")
        await trio.sleep(0.75)
        b.close_now()  # as a crash: the alarm still pending never rings
        await a.send_datagram("b:1", b"late")
        await trio.sleep(1.0)
    assert net.counters["delivered"] == 1 and net.counters["lost_unreachable"] == 1
    with pytest.raises(TransportError, match="closed"):
        b.call_at(5.0, lambda: None)
    return seen


async def test_deliver_to_and_call_at_run_on_the_network_loop(
        autojump_clock: trio.abc.Clock) -> None:
    seen = await _deliveries_and_alarms(MemoryNetwork(seed=40))
    assert seen == [(0.25, "a:1 b'hello'"), (0.5, "alarm 0.5")]


def test_the_jump_clock_wakes_the_network_loop_as_mock_time_does() -> None:
    from p2pswarm.sim.virtual import JumpClock

    async def main() -> list[tuple[float, str]]:
        return await _deliveries_and_alarms(MemoryNetwork(seed=40))

    jumped = trio.run(main, clock=JumpClock())
    mocked = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert jumped == mocked == [(0.25, "a:1 b'hello'"), (0.5, "alarm 0.5")]


async def test_a_frozen_transport_holds_datagrams_alarms_sends_and_accepts_until_thawed(
        autojump_clock: trio.abc.Clock) -> None:
    """As SIGSTOP holds a process: what arrives waits in its socket, its timers and its
    own sends wait, a connection is accepted by its kernel but not served; at the thaw,
    all of it happens at once, in the order it came."""
    net = MemoryNetwork(seed=41)
    net.set_default(LinkModel(delay=FixedDelay(0.25)))
    a, b = net.transport("a:1"), net.transport("b:1")
    seen: list[tuple[float, str]] = []
    a.deliver_to(lambda data, addr: seen.append((trio.current_time(), f"a got {data!r}")))
    b.deliver_to(lambda data, addr: seen.append((trio.current_time(), f"b got {data!r}")))
    served: list[float] = []

    async def serve(stream: Stream) -> None:
        served.append(trio.current_time())

    async with running(net) as nursery:
        await nursery.start(b.serve_streams, serve)
        b.freeze()
        b.call_at(0.5, lambda: seen.append((trio.current_time(), "b alarm 0.5")))
        await a.send_datagram("b:1", b"ping")
        await b.send_datagram("a:1", b"pong")
        await a.open_stream("b:1")  # the handshake completes: b's kernel answers it
        await trio.sleep(2.0 - trio.current_time())
        assert seen == [] and served == []
        b.thaw()
        await trio.sleep(1.0)
    assert seen == [(2.0, "b got b'ping'"), (2.0, "b alarm 0.5"), (2.25, "a got b'pong'")]
    assert served == [2.0]
