"""A byte relay between a TCP port and a unix socket: how a container with no network reaches its proxy.

    python -P eval/sessions/relay.py --listen tcp:127.0.0.1:8080 --connect unix:/polar/sock/proxy.sock  # in a container
    Relay("unix:/tmp/s1/proxy.sock", "tcp:127.0.0.1:8080").start()                                      # on the host

A docker session runs with ``--network none``: its only way out is the unix socket of its own host-side relay,
bound into the container. The harness CLIs (and mitmproxy, mitmproxy#7072) speak only TCP, so inside the
container this script, run by path with the host's interpreter bound read-only, listens on the container's own
loopback and carries each connection to the socket; on the host a :class:`Relay` carries it on to the proxy.
Bytes pass as they come (streamed answers stay streamed); one side's end of stream half-closes the other.
Standard library only, so any interpreter in any image runs it.

In a container the relay is PID 1's only child: ``--deadline`` ends it, and so the container, at the session's
timeout plus a grace, even if the rollout that started it was killed.

A connection costs the relay two threads. The host's relay takes at most ``max_connections`` at once (the docker
runtime's ``--limits.connections``): a container's process could otherwise open thousands past its pids limit
(1,200 held connections added ~2,400 threads to the rollout). One more is closed at once, and counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading

__all__ = ["Relay", "main"]

CHUNK = 65536


def _address(spec: str) -> tuple[int, str | tuple[str, int]]:
    kind, _, rest = spec.partition(":")
    if kind == "unix" and rest:
        return socket.AF_UNIX, rest
    host, _, port = rest.rpartition(":")
    if kind == "tcp" and host and port.isdigit():
        return socket.AF_INET, (host, int(port))
    raise ValueError(f"relay address {spec!r}: expected unix:PATH or tcp:HOST:PORT")


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass  # the other side went away; closing both below ends the pair
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


class Relay:
    """Accepts on ``listen`` and joins each connection to a new one to ``connect``, in threads; with
    ``max_connections``, at most that many at once, each one more closed and counted in ``refused``."""

    def __init__(self, listen: str, connect: str, max_connections: int | None = None) -> None:
        self._connect = _address(connect)
        self._slots = threading.BoundedSemaphore(max_connections) if max_connections else None
        self.refused = 0
        family, address = _address(listen)
        self._server = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET:
            self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(address))
        self._server.bind(address)
        self._server.listen(64)
        self._thread = threading.Thread(target=self.serve, name=f"relay {listen}", daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def serve(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed by stop()
                return
            if self._slots is not None and not self._slots.acquire(blocking=False):
                self.refused += 1  # only this thread writes it
                client.close()
                continue
            threading.Thread(target=self._join, args=(client,), daemon=True).start()

    def _join(self, client: socket.socket) -> None:
        family, address = self._connect
        upstream = socket.socket(family, socket.SOCK_STREAM)
        try:
            upstream.connect(address)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()
        except OSError:
            pass  # the proxy is not there: the client sees its connection closed
        finally:
            client.close()
            upstream.close()
            if self._slots is not None:
                self._slots.release()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="tcp:HOST:PORT or unix:PATH to accept on")
    parser.add_argument("--connect", required=True, help="tcp:HOST:PORT or unix:PATH each connection goes to")
    parser.add_argument(
        "--deadline", type=float, help="seconds after which the relay exits (124): a container whose relay it is ends"
    )
    args = parser.parse_args(argv)
    relay = Relay(args.listen, args.connect)
    if args.deadline is not None:  # whatever happens to the rollout that started the container
        threading.Timer(args.deadline, os._exit, args=(124,)).start()
    print(f"relay: {args.listen} -> {args.connect}", flush=True)  # the docker runtime waits for this line
    relay.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
