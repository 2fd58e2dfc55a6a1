"""Who may call nibble serve (runner/serve/guard.py): Host names and web origins. The server's own
answers to hostile requests are test_serve.py's."""
import pytest
from hypothesis import given, strategies as st

from nibble.runner.serve.guard import Callers, host_name, is_loopback
from nibble.runner.serve.server import exposed


@pytest.mark.parametrize("header, name", [("127.0.0.1:8132", "127.0.0.1"), ("[::1]:8132", "::1"), ("[::1]", "::1"),
                                          ("LocalHost", "localhost"), ("::1", "::1"), ("a.example", "a.example"),
                                          ("[", "["), ("", "")])
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.8.9.1", "::1", "[::1]"])
def test_loopback_names(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["evil.example", "localhost.evil.example", "0.0.0.0", "192.168.1.2", "::", "", "["])
def test_names_that_are_not_loopback(host):
    assert not is_loopback(host)


def test_on_loopback_only_loopback_names_and_the_ones_added_are_served():
    callers = Callers.of("127.0.0.1", hosts=["mybox.lan"])
    assert callers.refusal("localhost:8132", None) is None and callers.refusal("MyBox.lan:8132", None) is None
    assert "--allowed-hosts evil.example" in callers.refusal("evil.example:8132", None)
    assert callers.refusal(None, None) is None   # HTTP/1.0 sends no Host: nothing rebinding can use


def test_on_another_address_any_host_but_still_only_allowed_origins():
    callers = Callers.of("0.0.0.0", origins=["http://app.lan:8080/"])
    assert callers.refusal("evil.example", None) is None
    assert callers.refusal("x", "http://app.lan:8080") is None and callers.refusal("x", "http://localhost:5173") is None
    assert "--cors-origins https://app.lan:8080" in callers.refusal("x", "https://app.lan:8080")
    assert Callers.of("::1", origins=["*"]).refusal("localhost", "https://anything.example") is None


@pytest.mark.parametrize("origin", ["http://localhost", "https://127.0.0.1:3000", "http://[::1]:8080"])
def test_pages_on_loopback_are_allowed(origin):
    assert Callers().refusal("localhost", origin) is None


@pytest.mark.parametrize("origin", ["null", "http://localhost.evil.example", "http://127.0.0.1.evil.example",
                                    "file://", "chrome-extension://abc", "http://localhost:3000/path"])
def test_other_origins_are_refused(origin):
    assert Callers().refusal("localhost", origin) is not None


@pytest.mark.fuzz
@given(st.text(), st.one_of(st.none(), st.text()), st.sampled_from(["127.0.0.1", "localhost", "0.0.0.0"]))
def test_any_header_is_served_or_refused_with_a_reason(host, origin, bound_to):
    why = Callers.of(bound_to).refusal(host, origin)
    assert why is None or why.startswith(("this server answers", "requests from web pages"))


def test_another_address_without_a_key_says_the_network_can_use_it():
    assert "anyone on the network" in exposed("0.0.0.0", None)
    assert exposed("0.0.0.0", "sk-x") is None and exposed("127.0.0.1", None) is None and exposed("::1", None) is None
