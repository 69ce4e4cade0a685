"""ListenerGate on real socket files: hidden at the pause mark, put back (the same socket) once descriptors fall,
and a path another server took meanwhile is left to it."""

import logging
import socket

import pytest

from engine_core.listener_gate import ListenerGate


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "engine.sock"))
    sock.listen()
    yield tmp_path / "engine.sock"
    sock.close()


def test_the_socket_file_is_hidden_at_the_mark_and_put_back_below_it(listener):
    gate = ListenerGate(f"ipc://{listener}")
    inode = listener.stat().st_ino
    gate.update([gate.pause_at - 1], 0)
    assert listener.exists()
    gate.update([gate.pause_at - 1, gate.pause_at], 0)
    assert not listener.exists()
    with socket.socket(socket.AF_UNIX) as client, pytest.raises(FileNotFoundError):
        client.connect(str(listener))
    gate.update([], gate.pause_at)  # the connections left (this process holds far fewer descriptors)
    assert listener.stat().st_ino == inode
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(listener))
    assert sorted(p.name for p in listener.parent.iterdir()) == ["engine.sock"]


def test_a_path_taken_while_hidden_stays_with_its_new_owner(listener, caplog):
    gate = ListenerGate(f"ipc://{listener}")
    gate.update([gate.pause_at], 0)
    listener.write_text("another server's")
    with caplog.at_level(logging.ERROR):
        gate.update([], gate.pause_at)
    assert listener.read_text() == "another server's"
    assert "cannot put" in caplog.text
    assert sorted(p.name for p in listener.parent.iterdir()) == ["engine.sock"]  # the hidden name is gone
    gate.update([gate.pause_at + 1], 0)  # nothing left to hide
    assert listener.read_text() == "another server's"


def test_an_address_without_a_file_is_logged_once(caplog):
    gate = ListenerGate("tcp://127.0.0.1:5555")
    with caplog.at_level(logging.WARNING):
        gate.update([gate.pause_at], 0)
        gate.update([gate.pause_at + 1], 0)
    assert caplog.text.count("no socket file to hide") == 1
