"""Pseudo-gradient codecs: exact byte counts, each within its stated error bound, top-k's
error feedback carrying the residual exactly, QSGD unbiased, malformed frames refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.training.codec import Encoded, ErrorFeedback, make_codec

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


CODECS = [("fp32", {}), ("fp16", {}), ("int8", {}), ("int8", {"k_sigma": 2.0}),
          ("topk", {"fraction": 0.01}), ("topk", {"fraction": 0.3}), ("qsgd", {}),
          ("qsgd", {"bits": 2}), ("qsgd", {"bits": 8, "norm": "l2", "bucket": 100})]


def vectors(numel: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy tails, like real pseudo-gradients: a normal plus a few outliers
    x = torch.randn(numel, generator=g) * scale
    x[torch.randint(0, numel, (max(1, numel // 100),), generator=g)] *= 20
    return x


@pytest.mark.parametrize(("name", "options"), CODECS)
@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 5000), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
def test_reconstruction_within_stated_bound(name: str, options: dict[str, object], numel: int,
                                            seed: int, scale: float) -> None:
    codec = make_codec(name, **options)
    x = vectors(numel, seed, scale)
    encoded = codec.encode(x)
    wire = encoded.to_bytes()
    assert encoded.nbytes == len(wire)
    decoded = codec.decode(Encoded.from_bytes(wire))
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32
    error = (decoded - x).abs()
    bound = codec.bound(x)
    assert bool((error <= bound).all()), float((error - bound).max())


def test_byte_counts_are_exact_and_small() -> None:
    n = 100_000
    x = vectors(n, 0, 1e-3)
    header = 12  # version, codec, meta count, numel
    sizes = {name: make_codec(name, **opts).encode(x).nbytes for name, opts in CODECS}
    assert sizes["fp32"] == header + 4 * n
    assert sizes["fp16"] == header + 8 + 2 * n
    assert sizes["int8"] == header + 4 * 256 + n  # codebook + one index a value
    qsgd = make_codec("qsgd").encode(x)
    assert qsgd.nbytes == header + 4 * (n // 512 + 1) + n // 2  # maxima + 4 bits a value
    topk = make_codec("topk", fraction=0.01).encode(x)
    assert topk.meta[0] == 1000
    # 1% kept: ~1.1 bytes of position gap and 2 bytes of value each, over 120x smaller
    assert topk.nbytes < 4 * n / 100


def test_topk_error_feedback_carries_the_residual_exactly() -> None:
    feedback = ErrorFeedback(make_codec("topk", fraction=0.02), 3000)
    sent_total = torch.zeros(3000, dtype=torch.float64)
    given_total = torch.zeros(3000, dtype=torch.float64)
    for round_ in range(30):
        x = vectors(3000, round_, 1e-3)
        before = feedback.residual.clone()
        _, decoded = feedback.compress(x)
        # what was sent plus what is kept is exactly what there was to send, bit for bit
        assert torch.equal(decoded + feedback.residual, x + before)
        assert int((decoded != 0).sum()) <= 60
        sent_total += decoded.double()
        given_total += x.double()
    # nothing is lost over rounds: the sum sent trails the sum given by the residual only
    assert torch.allclose(sent_total + feedback.residual.double(), given_total, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 2000), seed=st.integers(0, 2**16),
       fraction=st.sampled_from([0.001, 0.05, 0.5, 1.0]))
def test_topk_residual_exact_for_any_input(numel: int, seed: int, fraction: float) -> None:
    feedback = ErrorFeedback(make_codec("topk", fraction=fraction), numel)
    feedback.residual = vectors(numel, seed + 1, 1e-4)
    x = vectors(numel, seed, 1e-2)
    total = x + feedback.residual
    _, decoded = feedback.compress(x)
    assert torch.equal(decoded + feedback.residual, total)


def test_qsgd_is_unbiased_and_keeps_no_residual() -> None:
    codec = make_codec("qsgd", bits=2, seed=1)
    x = vectors(400, 3, 1.0)
    mean = torch.stack([codec.decode(codec.encode(x)) for _ in range(3000)]).mean(0)
    scale = codec.bound(x)  # one level: the per-draw error scale
    assert float(((mean - x).abs() / scale).max()) < 0.1
    feedback = ErrorFeedback(make_codec("qsgd"), 400)
    feedback.compress(x)
    assert not feedback.residual.any()


def test_qsgd_draws_are_reproducible_from_state() -> None:
    a, b = make_codec("qsgd", seed=7), make_codec("qsgd", seed=0)
    b.load_state_dict(a.state_dict())
    x = vectors(1000, 0, 1.0)
    assert a.encode(x).to_bytes() == b.encode(x).to_bytes()


@pytest.mark.parametrize(("name", "options", "error"), [
    ("zip", {}, "unknown"), ("topk", {"fraction": 0}, "fraction"),
    ("qsgd", {"bits": 3}, "bits"), ("int8", {"k_sigma": -1}, "k_sigma"),
    ("fp16", {"fraction": 0.1}, "fp16 codec"),
])
def test_bad_codec_options(name: str, options: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        make_codec(name, **options)


@pytest.mark.parametrize(("name", "options"), CODECS)
def test_malformed_frames_are_refused(name: str, options: dict[str, object]) -> None:
    codec = make_codec(name, **options)
    wire = codec.encode(vectors(700, 1, 1.0)).to_bytes()
    for bad in (wire[:5], wire[:-1], wire + b"\0", b"\x09" + wire[1:]):
        with pytest.raises(RemoteProtocolError):
            codec.decode(Encoded.from_bytes(bad))
    other = "fp16" if name != "fp16" else "fp32"
    with pytest.raises(RemoteProtocolError):
        make_codec(other).decode(Encoded.from_bytes(wire))
