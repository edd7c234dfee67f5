"""No network unless asked: every command runs with no socket opened and no name looked up."""

import socket
import time
from types import SimpleNamespace

import pytest

from storylens.cli import main


def skip_hub_backoff(monkeypatch):
    """The hub client retries a refused request five times, sleeping 1, 2, 4, 8 and 8 s between
    tries (huggingface_hub's http_backoff): the tries still happen, the waits are skipped."""
    import huggingface_hub.utils._http as hub_http

    monkeypatch.setattr(hub_http, "time", SimpleNamespace(time=time.time, sleep=lambda seconds: None))


@pytest.fixture
def no_network(monkeypatch):
    """Any DNS lookup or connection attempt is recorded and refused."""
    attempts = []

    def refuse(what):
        def guard(*args, **kwargs):
            attempts.append((what, args[:2]))
            raise OSError(f"network disabled by the test ({what})")

        return guard

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "gethostbyname", refuse("gethostbyname"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return attempts


HUB_ID = "someone/tiny-storyteller"
OFFLINE = (
    f"storylens: error: {HUB_ID}: not a folder here and not in the local hub cache; storylens stays "
    "offline unless asked: pass --allow-download to fetch it"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "Once", "--model", HUB_ID],
        ["perplexity", "--model", HUB_ID],
        ["export-hf", "OUT", "--model", HUB_ID],
        ["check", "--model", HUB_ID],
        ["report", "--model", HUB_ID, "--out", "OUT", "--no-progress"],
        ["ablate", "--model", HUB_ID],
    ],
)
def test_a_hub_id_without_allow_download_opens_no_socket(no_network, capsys, tmp_path, argv):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == OFFLINE + "\n"
    assert no_network == []
    assert not (tmp_path / "out").exists()


def test_the_shipped_model_runs_with_no_network(no_network, capsys):
    assert main(["generate", "Once upon a time", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")
    assert no_network == []


def test_allow_download_really_tries_the_network(no_network, capsys, monkeypatch, tmp_path):
    """The guard itself works: with --allow-download the hub client does reach for the network."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    skip_hub_backoff(monkeypatch)
    assert main(["generate", "Once", "--model", HUB_ID, "--allow-download"]) == 1
    assert no_network, "the hub client opened no socket even when allowed: the guard would prove nothing"
