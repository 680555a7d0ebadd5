"""Raw HTTP/1.1 over a socket, for what no client library sends: half-open connections, bytes
that trickle in, malformed and ambiguous requests. Loopback only."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_response(sock: socket.socket) -> RawResponse:
    """One response with a Content-Length body (all this service's non-streaming answers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a complete response: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(int(status_line.split()[1]), headers, body[:length])


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes its side (EOF) within `within_s`; data is read and dropped."""
    sock.settimeout(within_s)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def exchange(port: int, request: bytes) -> tuple[RawResponse, socket.socket]:
    sock = connect(port)
    sock.sendall(request)
    return read_response(sock), sock
