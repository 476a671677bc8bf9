"""eval/sessions/relay.py on loopback: bytes relayed both ways, and the host relay's cap on connections at once (issue
47: 1,200 connections held by one container added ~2,400 threads to the rollout)."""

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import eval.sessions.relay
from eval.sessions.relay import Relay

RELAY_SCRIPT = Path(eval.sessions.relay.__file__)


@contextlib.contextmanager
def echo_server():
    """A TCP server that sends back what it reads, a thread per connection; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def connect(path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(str(path))
    return client


def closed_by_peer(client: socket.socket) -> bool:
    try:
        return client.recv(100) == b""
    except ConnectionResetError:
        return True


def round_trip(client: socket.socket, payload: bytes) -> bytes:
    client.sendall(payload)
    got = b""
    while len(got) < len(payload) and (data := client.recv(65536)):
        got += data
    return got


def test_the_host_relay_holds_its_cap_refuses_and_counts_the_rest_and_frees_slots_as_connections_end(tmp_path):
    with echo_server() as port:
        relay = Relay(f"unix:{tmp_path}/proxy.sock", f"tcp:127.0.0.1:{port}", max_connections=8).start()
        threads_before = threading.active_count()
        held = [connect(tmp_path / "proxy.sock") for _ in range(8)]
        for i, client in enumerate(held):  # every held one is relayed (and so holds its slot)
            assert round_trip(client, b"call %d" % i) == b"call %d" % i
        extra = [connect(tmp_path / "proxy.sock") for _ in range(40)]
        for client in extra:  # closed at once by the relay: end of stream, nothing relayed
            assert closed_by_peer(client)
            client.close()
        assert relay.refused == 40
        # Two relay threads and one echo thread a relayed connection; the 40 refused added none (uncapped: 144).
        assert threading.active_count() - threads_before <= 3 * 8
        for client in held:
            client.close()
        # Slots come back as connections end: a new one is relayed again.
        deadline = time.monotonic() + 10
        while True:
            client = connect(tmp_path / "proxy.sock")
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if round_trip(client, b"again") == b"again":
                    client.close()
                    break
            client.close()
            assert time.monotonic() < deadline, "no slot came back after every connection closed"
        relay.stop()


def test_without_a_cap_the_relay_takes_every_connection(tmp_path):
    with echo_server() as port:
        relay = Relay(f"unix:{tmp_path}/proxy.sock", f"tcp:127.0.0.1:{port}").start()
        held = [connect(tmp_path / "proxy.sock") for _ in range(20)]
        assert [round_trip(c, b"x%d" % i) for i, c in enumerate(held)] == [b"x%d" % i for i in range(20)]
        assert relay.refused == 0
        for client in held:
            client.close()
        relay.stop()


def test_the_container_relay_exits_at_its_deadline(tmp_path):
    # In a container the relay is PID 1's only child: its exit ends the container, whatever became of the rollout.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = subprocess.Popen(
        [sys.executable, "-P", str(RELAY_SCRIPT), "--listen", f"tcp:127.0.0.1:{port}", "--connect",
         f"unix:{tmp_path}/proxy.sock", "--deadline", "1"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert relay.stdout.readline().startswith("relay: ")  # serving
        assert relay.wait(timeout=60) == 124
    finally:
        relay.kill()  # a relay without its deadline would serve on
        relay.wait()
        relay.stdout.close()
