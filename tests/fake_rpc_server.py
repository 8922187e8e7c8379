"""A ggml RPC server that only answers HELLO, with a protocol version of the test's choice (a server of
another build). Wire format (ggml-rpc.cpp): request | cmd u8 | size u64 | data |, response | size u64 |
data |; HELLO's response data: major, minor, patch, padding (u8 each) + connection capabilities (none)."""

from __future__ import annotations

import socket
import struct
import threading

RPC_CMD_HELLO = 14


class FakeRpcServer:
    def __init__(self, version: tuple[int, int, int]) -> None:
        self.version = version
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self.hellos = 0
        self.other_commands: list[int] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        cmd = self._recv(conn, 1)[0]
                        size = struct.unpack("<Q", self._recv(conn, 8))[0]
                        data = self._recv(conn, size)
                        if cmd != RPC_CMD_HELLO:
                            self.other_commands.append(cmd)
                            return
                        self.hellos += 1
                        caps = bytes(len(data))  # as many capability bytes as the client sent: none set
                        rsp = bytes([*self.version, 0]) + caps
                        conn.sendall(struct.pack("<Q", len(rsp)) + rsp)
                except (ConnectionError, OSError):
                    continue

    def close(self) -> None:
        self.sock.close()
