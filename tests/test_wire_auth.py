"""Frame authentication: run secret loading, key derivation, refusals with the right status, replay cache."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.auth import (
    MIN_RUN_SECRET_BYTES,
    AuthContext,
    FrameKey,
    FrameVerifier,
    ReplayCache,
    RunSecretError,
    check_epoch,
    derive_frame_key,
    hkdf_sha256,
    load_run_secret,
)
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.frames import FIXED_HEADER_BYTES, FrameDecoder, Received, decode_frame, encode_frame
from wire.limits import Limits
from wire.messages import FragmentContribution, Heartbeat, VoteRequest

RUN = "run-auth"
KEY = derive_frame_key(b"k" * 32)
AUTH = AuthContext(RUN, "site-a", KEY)
NOW = 1_800_000_000.0
SKEW = Limits().clock_skew_allowance_s
HEARTBEAT = Heartbeat(epoch=5, leader="site-a", seq=1, commit_index=40)


def encode(message=HEARTBEAT, *, auth=AUTH, now=NOW, nonce=None) -> bytes:
    return encode_frame(message, auth, now_unix=now, nonce=nonce or os.urandom(16))


def refusal(data: bytes, verifier: FrameVerifier, *, now: float = NOW) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as error:
        decode_frame(data, verifier, now_unix=now)
    return error.value


# ---------------------------------------------------------------------------------------------
# Run secret and key
# ---------------------------------------------------------------------------------------------


def write_secret(tmp_path, content: bytes, mode: int = 0o600):
    path = tmp_path / "run.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_load_run_secret_strips_one_trailing_newline(tmp_path):
    secret = os.urandom(16).hex().encode()  # 32 characters, as `openssl rand -hex 16` prints
    assert load_run_secret(write_secret(tmp_path, secret + b"\n")) == secret
    assert load_run_secret(write_secret(tmp_path, secret + b"\r\n")) == secret
    # Random bytes that do not end in a newline are kept whole (os.urandom alone would end in
    # b"\n" once in 256 runs, and that byte would rightly be stripped).
    raw = os.urandom(39) + b"\xff"
    assert load_run_secret(write_secret(tmp_path, raw)) == raw
    assert load_run_secret(write_secret(tmp_path, raw + b"\n")) == raw


def test_load_run_secret_allows_group_read(tmp_path):
    assert load_run_secret(write_secret(tmp_path, b"g" * 32, 0o640)) == b"g" * 32


@pytest.mark.parametrize(("content", "mode", "reason"), [
    (b"", 0o600, "is empty"),
    (b"\n", 0o600, "is empty"),
    (b"short", 0o600, f"is 5 bytes; at least {MIN_RUN_SECRET_BYTES} are required"),
    (b"w" * 32, 0o644, "accessible by other users .mode 644.; run: chmod 600"),
    (b"w" * 32, 0o602, "accessible by other users"),
    (b"w" * 5000, 0o600, "is this the right file"),
])
def test_load_run_secret_refuses_bad_files(tmp_path, content, mode, reason):
    with pytest.raises(RunSecretError, match=reason):
        load_run_secret(write_secret(tmp_path, content, mode))


def test_load_run_secret_missing_file_and_directory(tmp_path):
    with pytest.raises(RunSecretError, match="does not exist .create it with: head -c 32 /dev/urandom"):
        load_run_secret(tmp_path / "nope")
    with pytest.raises(RunSecretError, match="is not a regular file"):
        load_run_secret(tmp_path)


def test_hkdf_matches_rfc5869_test_case_1():
    output = hkdf_sha256(bytes([0x0B]) * 22, salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)), length=42)
    assert output.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c"
                            "5db02d56ecc4c5bf34007208d5b887185865")


def test_frame_key_is_deterministic_secret_dependent_and_never_printed():
    assert derive_frame_key(b"k" * 32) == KEY
    assert derive_frame_key(b"j" * 32) != KEY
    assert KEY.material.hex() not in repr(KEY) and "material" not in repr(KEY)
    assert KEY.material.hex() not in repr(AUTH)
    with pytest.raises(LocalProtocolError, match="at least 32 bytes"):
        derive_frame_key(b"short")
    with pytest.raises(LocalProtocolError, match="32 bytes"):
        FrameKey(b"x")


# ---------------------------------------------------------------------------------------------
# Refusals, each with its status
# ---------------------------------------------------------------------------------------------


def test_accepts_an_authentic_fresh_frame():
    received = decode_frame(encode(), FrameVerifier(RUN, KEY), now_unix=NOW + 2)
    assert received == Received(sender="site-a", sent_at_unix=NOW, message=HEARTBEAT)


def test_wrong_run_is_409():
    other_run = AuthContext("run-other", "site-a", KEY)
    error = refusal(encode(auth=other_run), FrameVerifier(RUN, KEY))
    assert error.status_hint == 409
    assert "frame is for run 'run-other', this node is in run 'run-auth'" in str(error)


def test_different_secret_is_401():
    stranger = AuthContext(RUN, "site-x", derive_frame_key(b"x" * 32))
    error = refusal(encode(auth=stranger), FrameVerifier(RUN, KEY))
    assert error.status_hint == 401 and "bad MAC on frame from 'site-x'" in str(error)


def test_tampered_header_is_401():
    data = bytearray(encode(VoteRequest(epoch=4, candidate="site-b", last_log_epoch=3, last_log_index=17)))
    position = data.index(b"candidate") + len(b"candidate") + 1 + len("site-")
    data[position:position + 1] = b"z"  # site-b -> site-z: same length, still valid msgpack
    error = refusal(bytes(data), FrameVerifier(RUN, KEY))
    assert error.status_hint == 401 and "bad MAC" in str(error)


def test_tampered_payload_is_401():
    message = FragmentContribution(fragment=1, base_index=2, base_round=3, c_steps=4, c_tokens=5, codec="int8",
                                   learner_id="site-a", payload=b"\x01" * 64)
    data = bytearray(encode(message))
    data[-1] ^= 0x80
    error = refusal(bytes(data), FrameVerifier(RUN, KEY))
    assert error.status_hint == 401 and "does not match its authenticated digest" in str(error)


def test_tampered_fixed_header_is_401():
    data = bytearray(encode())
    data[5] ^= 0x40  # another minor version: accepted as a version, but covered by the MAC
    assert refusal(bytes(data), FrameVerifier(RUN, KEY)).status_hint == 401


def test_replay_is_401():
    verifier = FrameVerifier(RUN, KEY)
    data = encode()
    decode_frame(data, verifier, now_unix=NOW)
    error = refusal(data, verifier, now=NOW + 1)
    assert error.status_hint == 401 and "replayed frame from 'site-a'" in str(error)


def test_same_nonce_from_another_sender_is_not_a_replay():
    verifier = FrameVerifier(RUN, KEY)
    nonce = os.urandom(16)
    decode_frame(encode(nonce=nonce), verifier, now_unix=NOW)
    other = AuthContext(RUN, "site-b", KEY)
    assert decode_frame(encode(auth=other, nonce=nonce), verifier, now_unix=NOW).sender == "site-b"


def test_stale_and_future_frames_are_401_at_the_window_edge():
    verifier = FrameVerifier(RUN, KEY)
    assert decode_frame(encode(now=NOW - SKEW), verifier, now_unix=NOW).message == HEARTBEAT
    assert decode_frame(encode(now=NOW + SKEW), verifier, now_unix=NOW).message == HEARTBEAT
    stale = refusal(encode(now=NOW - SKEW - 0.001), verifier)
    assert stale.status_hint == 401 and "stale frame from 'site-a': sent 30.001 s ago" in str(stale)
    future = refusal(encode(now=NOW + SKEW + 0.001), verifier)
    assert future.status_hint == 401 and "30.001 s in the future" in str(future) and "check its clock" in str(future)


def test_skew_allowance_is_configurable():
    verifier = FrameVerifier(RUN, KEY, Limits(clock_skew_allowance_s=2.0))
    assert refusal(encode(now=NOW - 2.5), verifier).status_hint == 401
    assert decode_frame(encode(now=NOW - 1.5), verifier, now_unix=NOW).message == HEARTBEAT


def test_header_is_authenticated_before_any_payload_arrives():
    """A stranger's 256 MB upload is refused after its header: nothing of the payload is needed."""
    stranger = AuthContext(RUN, "site-x", derive_frame_key(b"x" * 32))
    message = FragmentContribution(fragment=1, base_index=2, base_round=3, c_steps=4, c_tokens=5, codec="int8",
                                   learner_id="site-x", payload=b"\x00" * 1000)
    data = encode(message, auth=stranger)
    decoder = FrameDecoder(FrameVerifier(RUN, KEY))
    decoder.receive_data(data[:len(data) - 1000])  # header, map and MAC only
    with pytest.raises(RemoteProtocolError, match="bad MAC") as error:
        decoder.next_event(now_unix=NOW)
    assert error.value.status_hint == 401
    assert len(data) - 1000 > FIXED_HEADER_BYTES


# ---------------------------------------------------------------------------------------------
# Replay cache: bounded, and never a replay hole
# ---------------------------------------------------------------------------------------------


def test_replay_cache_forgets_nonces_once_their_frames_are_too_old_to_accept():
    cache = ReplayCache(max_nonces=100, window_s=10)
    cache.check_and_remember("a", b"n1", sent_at_ms=1_000, now_ms=1_000)
    cache.check_and_remember("a", b"n2", sent_at_ms=5_000, now_ms=5_000)
    assert len(cache) == 2
    cache.check_and_remember("a", b"n3", sent_at_ms=11_500, now_ms=11_500)
    assert len(cache) == 2  # n1 expired: its frame is now refused by time alone
    with pytest.raises(RemoteProtocolError, match="older than the replay window"):
        cache.check_and_remember("a", b"n1", sent_at_ms=1_000, now_ms=11_500)


def test_receiver_clock_stepping_back_does_not_revive_forgotten_nonces():
    cache = ReplayCache(max_nonces=100, window_s=10)
    cache.check_and_remember("a", b"n1", sent_at_ms=1_000, now_ms=1_000)
    cache.check_and_remember("a", b"n2", sent_at_ms=20_000, now_ms=20_000)  # n1 forgotten
    with pytest.raises(RemoteProtocolError, match="older than the replay window") as error:
        cache.check_and_remember("a", b"n1", sent_at_ms=1_000, now_ms=2_000)  # clock stepped back
    assert error.value.status_hint == 401


def test_flood_keeps_the_cache_bounded_and_evicted_nonces_still_refused():
    cache = ReplayCache(max_nonces=50, window_s=1000)
    for i in range(500):
        cache.check_and_remember("flooder", i.to_bytes(16, "big"), sent_at_ms=10_000 + i, now_ms=10_000 + i)
        assert len(cache) <= 50
    with pytest.raises(RemoteProtocolError, match="replay cache full") as error:
        cache.check_and_remember("flooder", (3).to_bytes(16, "big"), sent_at_ms=10_003, now_ms=10_600)
    assert error.value.status_hint == 401
    # Other senders' fresh frames are unaffected.
    cache.check_and_remember("site-b", b"fresh", sent_at_ms=10_600, now_ms=10_600)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 30), st.integers(0, 3000),
                                 st.integers(-50, 200)), max_size=120),
       capacity=st.integers(1, 20))
def test_replay_cache_accepts_each_frame_at_most_once(events, capacity):
    """Whatever the order, clock steps and capacity, a frame (sender, nonce, timestamp) that passes the
    timestamp window is accepted at most once, and the cache never exceeds its bound."""
    window_ms = 1000
    cache = ReplayCache(max_nonces=capacity, window_s=window_ms / 1000)
    accepted: set[tuple[str, int, int]] = set()
    now_ms = 1000
    for sender, nonce, sent_at_ms, step in events:
        now_ms = max(0, now_ms + step)  # mostly forward, sometimes a small step back
        if abs(sent_at_ms - now_ms) > window_ms:
            continue  # the verifier's timestamp check refuses these before the cache sees them
        frame_id = (sender, nonce, sent_at_ms)
        try:
            cache.check_and_remember(sender, bytes([nonce]), sent_at_ms=sent_at_ms, now_ms=now_ms)
        except RemoteProtocolError as error:
            assert error.status_hint == 401
        else:
            assert frame_id not in accepted, f"frame {frame_id} accepted twice"
            accepted.add(frame_id)
        assert len(cache) <= capacity


def test_verifier_shares_one_cache_across_decoders():
    verifier = FrameVerifier(RUN, KEY)
    data = encode()
    decode_frame(data, verifier, now_unix=NOW)  # one connection
    assert refusal(data, verifier).status_hint == 401  # the same frame on another connection


# ---------------------------------------------------------------------------------------------
# Epoch fencing and misuse
# ---------------------------------------------------------------------------------------------


def test_check_epoch_reasons_and_stale_refusal():
    assert check_epoch(7, 7) == "epoch 7 is current"
    assert check_epoch(8, 7) == "epoch 8 is newer than known 7: adopt it"
    with pytest.raises(RemoteProtocolError, match="stale epoch 6: this node has seen epoch 7") as error:
        check_epoch(6, 7)
    assert error.value.status_hint == 409


@pytest.mark.parametrize(("build", "reason"), [
    (lambda: AuthContext("", "a", KEY), "run id ''"),
    (lambda: AuthContext("run", "bad sender", KEY), "sender 'bad sender'"),
    (lambda: AuthContext("run", "a", b"k" * 32), "must be a FrameKey"),
    (lambda: FrameVerifier("run", b"k" * 32), "must be a FrameKey"),
    (lambda: encode_frame(HEARTBEAT, AUTH, now_unix=NOW, nonce=b"short"), "nonce must be 16"),
    (lambda: encode_frame(HEARTBEAT, AUTH, now_unix=float("nan"), nonce=os.urandom(16)), "now_unix"),
])
def test_our_misuse_is_a_local_error(build, reason):
    with pytest.raises(LocalProtocolError, match=reason):
        build()
