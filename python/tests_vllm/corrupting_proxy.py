"""A loopback TCP proxy between a subscriber and its publisher (plaintext gRPC: HTTP/2 frames) that,
once armed, flips one byte in the payload of the next large HTTP/2 DATA frame going to the
subscriber: the bytes of a patch in flight, damaged after the publisher's checks and before the
subscriber's. Binds port 0; each connection is served by two threads until either side closes."""
from __future__ import annotations

import socket
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MIN_DATA = 4096  # a DATA frame at least this long carries tensor bytes


class CorruptingProxy:
    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._armed = False
        self.corrupted = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def _take(self) -> bool:
        with self._lock:
            if not self._armed:
                return False
            self._armed = False
            self.corrupted += 1
            return True

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._frames, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def _frames(self, src, dst) -> None:
        """Server -> client: forwards whole HTTP/2 frames, damaging one when armed."""
        buf = bytearray()
        try:
            while data := src.recv(65536):
                buf += data
                while len(buf) >= 9:
                    length = int.from_bytes(buf[0:3], "big")
                    if len(buf) < 9 + length:
                        break
                    frame = buf[:9 + length]
                    del buf[:9 + length]
                    if frame[3] == 0 and length >= MIN_DATA and self._take():
                        frame[9 + length // 2] ^= 0x5A
                    dst.sendall(bytes(frame))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()
