"""protocol/channels.py and protocol/stream_errors.py: the security layer plugs call signing and
caller verification in (protocol never imports it), and a refusal's reason word survives the
trip through a gRPC status."""

from __future__ import annotations

import importlib

import grpc
import pytest

from protocol import channels
from protocol.stream_errors import StreamError, error_of, refusal_of


@pytest.fixture
def hooks():
    saved = channels._client_auth, channels._verified_peer
    yield
    channels.install_auth(*saved)


class _Auth:
    def __init__(self):
        self.asked: list = []

    def interceptors(self, addr, peer_id):
        self.asked.append((addr, peer_id))
        return []


async def test_installed_hooks_sign_channels_and_name_the_caller(hooks):
    auth = _Auth()
    channels.install_auth(lambda: auth, lambda: "12D3KooWcaller")
    assert channels.verified_peer() == "12D3KooWcaller"
    ch = channels.signed_channel("127.0.0.1:1", [], peer_id="12D3KooWpeer")
    await ch.close()
    assert auth.asked == [("127.0.0.1:1", "12D3KooWpeer")]
    pool = channels.ChannelPool(auth=None)  # an explicit None: plain, whatever is installed
    pool.get("127.0.0.1:2")
    await pool.close()
    assert auth.asked == [("127.0.0.1:1", "12D3KooWpeer")]
    channels.install_auth(lambda: None, lambda: None)
    assert channels.verified_peer() is None


def test_the_security_layer_installs_its_hooks():
    peer_auth = importlib.import_module("security.peer_auth")  # installs them at import
    assert channels._client_auth is peer_auth.client_auth
    assert channels._verified_peer is peer_auth.current_peer


@pytest.mark.parametrize("details, word", [
    ("busy: busy proposing; retry (round 3)", "busy"),
    ("not_root:12D3KooWabc: this worker is not the root of round 4", "not_root:12D3KooWabc"),
    ("[size] tensor 'w' is 9 bytes: above the cap", ""),
    ("no hello in 5.0 s", ""),
    ("", ""),
])
def test_refusal_word_of_a_status_text(details, word):
    assert refusal_of(details) == word


def test_error_of_a_failed_call():
    def err(code, details):
        return error_of(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))

    e = err(grpc.StatusCode.FAILED_PRECONDITION, "late: the mean of round 3 is already computed")
    assert isinstance(e, StreamError) and (e.reason, e.refusal) == ("refused", "late")
    e = err(grpc.StatusCode.INVALID_ARGUMENT, "[checksum] digest mismatch")
    assert (e.reason, e.refusal, e.code) == ("checksum", "", grpc.StatusCode.INVALID_ARGUMENT)
    assert err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded").reason == "timeout"
    assert err(grpc.StatusCode.UNAVAILABLE, "gone").reason == "peer_error"
