"""Real stores on 127.0.0.1 for the tests of shard sets at a URL (``tests/data/remote/``): moto's S3 server in its
own process (``python -m moto.server``, what s3fs's own suite runs against) and Python's ``http.server`` (plain or
TLS with a throw-away certificate), whose handler injects faults per object: drop the connection mid-body, serve
corrupted bytes, answer 404 or 503. Every byte a client reads crosses a socket; the client library is never patched.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import child_env, free_port

STALL_S = 60.0
"""How long a ``stall`` fault holds a half-sent body (a download in flight for as long as a test needs)."""

__all__ = ["STALL_S", "FaultyHandler", "HttpStore", "MotoServer", "S3_ENV", "s3_env", "self_signed_cert"]

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}
"""Credentials moto accepts (any key, unless started with authentication on)."""


def s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    """The environment a client (a test's process or a rank) reads the store through: the standard endpoint
    override and credentials variables."""
    return {**S3_ENV, "AWS_ENDPOINT_URL_S3": endpoint, **extra}


def _wait_port(port: int, proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


class MotoServer:
    """``python -m moto.server`` on a free port; ``auth=True`` turns on its IAM checks from the first request, so
    any access key is refused (InvalidAccessKeyId): a store refusing credentials."""

    def __init__(self, *, auth: bool = False):
        self.port = free_port()
        env = child_env(**({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def put_set(self, directory: Path, bucket: str, prefix: str) -> str:
        """Upload a shard directory's files (index.json last); returns its ``s3://`` URL."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        files = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name != "index.json")
        for path in [*files, Path(directory) / "index.json"]:
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        return f"s3://{bucket}/{prefix}/"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class FaultyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves ``directory``; ``faults[name]`` is a list of faults, one consumed per GET of that object: ``drop``
    (close the connection halfway through the body), ``stall`` (send half the body, then nothing for ``STALL_S``),
    ``corrupt`` (flip one byte), ``404``, ``503``; ``ok`` serves it.
    ``served`` counts the body bytes each GET sends, added before they are written."""

    faults: dict[str, list[str]]
    served: dict[str, int]
    lock: threading.Lock

    def log_message(self, *args) -> None:  # quiet: the test's output is the client's
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self.path.rsplit("/", 1)[-1]
        with self.lock:
            queue = self.faults.get(name, [])
            fault = queue.pop(0) if queue else "ok"
        if fault in ("404", "503"):
            self.send_error(int(fault))
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = bytearray(path.read_bytes())
        if fault == "corrupt":
            data[len(data) // 2] ^= 0xFF
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        body = bytes(data[:len(data) // 2]) if fault in ("drop", "stall") else bytes(data)
        with self.lock:  # before the write: a client that has read the body may look at once
            self.served[name] = self.served.get(name, 0) + len(body)
        self.wfile.write(body)
        if fault == "stall":
            self.wfile.flush()
            time.sleep(STALL_S)
        if fault == "drop":
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command line."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([shutil.which("openssl") or "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                    "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class HttpStore:
    """``http.server`` serving ``root`` on 127.0.0.1 in a thread of the test process, with :class:`FaultyHandler`;
    ``tls=(cert, key)`` serves https (clients trust the certificate through ``SSL_CERT_FILE``)."""

    def __init__(self, root: Path, *, tls: tuple[Path, Path] | None = None):
        handler = type("Handler", (FaultyHandler,), {"faults": {}, "served": {}, "lock": threading.Lock()})
        self.handler = handler
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(handler, directory=str(root)))
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def faults(self) -> dict[str, list[str]]:
        return self.handler.faults

    @property
    def served(self) -> dict[str, int]:
        return self.handler.served

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


