"""``kvferry.EngineClient`` against a node whose engine listener speaks TLS (issue 29): the
lab certificates of ``config/tls-lab`` (node ``a``'s names ``a``, localhost and 127.0.0.1)."""

from __future__ import annotations

import re

import pytest

import kvferry
from nodeproc import ROOT, Node

LAB = ROOT / "config" / "tls-lab"


@pytest.fixture
def tls_node(tmp_path):
    tls = f'[tls]\ncert = "{LAB}/a.pem"\nkey = "{LAB}/a.key"\nca = "{LAB}/ca.pem"\n'
    node = Node(tmp_path, "a", extra=tls)
    yield node
    node.kill()


def failures(node, listener):
    m = re.search(
        r'^kvferry_tls_handshake_failures_total\{listener="%s"\} (\d+)' % listener,
        node.metrics(),
        re.M,
    )
    return int(m.group(1)) if m else 0


def test_engine_client_over_tls(tls_node):
    ca = str(LAB / "ca.pem")
    c = kvferry.EngineClient(tls_node.addr, tls_ca=ca)
    assert c.health()
    # The certificate's DNS name instead of the address's host.
    named = kvferry.EngineClient(tls_node.addr, tls_ca=ca, tls_server_name="a")
    assert named.health()

    # Plaintext to the TLS listener is refused, and the node counts it.
    before = failures(tls_node, "engine")
    with pytest.raises(kvferry.KvferryError):
        kvferry.EngineClient(tls_node.addr, connect_timeout_s=5.0)
    assert failures(tls_node, "engine") > before
    # A name the certificate does not carry is refused by the client.
    with pytest.raises(kvferry.KvferryError):
        kvferry.EngineClient(tls_node.addr, tls_ca=ca, tls_server_name="b")
    # The connected clients were not disturbed.
    assert c.health() and named.health()


def test_tls_arguments_are_checked():
    with pytest.raises(ValueError):
        kvferry.EngineClient("127.0.0.1:1", tls_cert="c.pem", tls_key="k.pem")
    with pytest.raises(ValueError):
        kvferry.EngineClient("127.0.0.1:1", tls_ca=str(LAB / "ca.pem"), tls_cert="c.pem")
    with pytest.raises(OSError):
        kvferry.EngineClient("127.0.0.1:1", tls_ca="/nonexistent/ca.pem")
