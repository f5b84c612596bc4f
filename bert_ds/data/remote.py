"""Shard sets at a URL: ``s3://``, ``gs://``, ``http://`` and ``https://``, read through fsspec (its ``s3fs``, ``gcsfs``
and aiohttp-based HTTP file systems; ``docs/data.md`` "Shards at a URL"). This module is the one place that talks to a
store: it opens the file system, reads objects, lists sizes, uploads, and turns what the client raises into one of
three outcomes:

* **transient** (a connection reset or dropped mid-body, a timeout, HTTP 5xx or 429, S3 throttling): retried by
  :func:`with_retries` with exponential backoff, each retry logged; still failing after :data:`ATTEMPTS` tries it is a
  :class:`RemoteError` naming the URL;
* **missing** (HTTP 404/410, S3 ``NoSuchKey``): :class:`RemoteError` naming the URL (exit 2);
* **credentials refused** (HTTP 401/403, S3 ``AccessDenied``/``InvalidAccessKeyId``/``SignatureDoesNotMatch``):
  :class:`RemoteError` naming the store and where its credentials come from (exit 2).

Credentials come from each provider's own chain (S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and ``~/.aws/``; GCS: ``GOOGLE_APPLICATION_CREDENTIALS`` and gcloud's default credentials); an
S3-compatible store (MinIO, Ceph) is reached through the standard ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``.
Nothing here signs or speaks HTTP by hand. The client libraries are imported lazily: a URL whose scheme needs a
package that is not installed is refused naming the package (``pip install 'bert_ds[remote]'``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from bert_ds.errors import BadInput, BertDsError, StepFailed

__all__ = ["ATTEMPTS", "RemoteError", "Store", "StoreUnavailable", "is_url", "join_url", "with_retries"]

log = logging.getLogger(__name__)

_URL = re.compile(r"^(s3|gs|gcs|https?)://[^/\s]+", re.IGNORECASE)
ATTEMPTS = 6
"""Tries of one remote operation before a transient error becomes fatal (waits 0.5, 1, 2, 4, 8 s between)."""
BACKOFF_S = 0.5
_CHUNK = 4 << 20
T = TypeVar("T")


class RemoteError(BadInput):
    """A shard set at a URL that cannot be used: an object missing, corrupt after a re-download, credentials refused.
    One line naming the URL (exit 2)."""


class StoreUnavailable(StepFailed):
    """The store kept failing transiently (resets, timeouts, 5xx, throttling) through all :data:`ATTEMPTS` tries: not
    the input's fault, so exit 1, which the supervisors restart from the newest checkpoint (docs/cluster.md)."""


def is_url(path: object) -> bool:
    """Whether ``path`` names a shard set on a store (``s3://``, ``gs://``, ``http(s)://``) rather than a directory."""
    return isinstance(path, str) and _URL.match(path) is not None


def join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _status(exc: BaseException) -> int | None:
    """The HTTP status an aiohttp or botocore error carries, if any."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _kind(exc: BaseException) -> str:
    """``missing``, ``credentials``, ``transient`` or ``fatal`` for an error the client raised."""
    status = _status(exc)
    if isinstance(exc, FileNotFoundError) or status in (404, 410):
        return "missing"
    if isinstance(exc, PermissionError) or status in (401, 403) or "Credential" in type(exc).__name__:
        return "credentials"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "transient"
    if isinstance(exc, OSError | asyncio.TimeoutError | TimeoutError | ConnectionError):
        return "transient"  # resets, refused connections, truncated bodies: aiohttp and botocore raise OSErrors
    name = type(exc).__name__
    if any(word in name for word in ("Connection", "Payload", "Timeout", "ServerDisconnected", "Throttl")):
        return "transient"
    return "fatal"


def with_retries(what: str, url: str, store: str, fn: Callable[[], T]) -> T:
    """``fn()`` retried on transient errors (logged, exponential backoff); missing objects and refused credentials
    become :class:`RemoteError` at once. ``what`` says what was being done (for the log and the error)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return fn()
        except BertDsError:  # already one line with its exit code (a full disk while writing: 74)
            raise
        except Exception as exc:  # noqa: BLE001 - the client libraries raise many types; _kind sorts them
            kind = _kind(exc)
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if kind == "missing":
                raise RemoteError(f"{url}: missing on the store ({what}; {detail})") from None
            if kind == "credentials":
                raise RemoteError(f"{store}: the store refused the credentials while {what} {url} ({detail}); "
                                  f"{_credential_hint(url)}") from None
            if kind == "fatal":
                raise RemoteError(f"{url}: {what} failed ({detail})") from None
            if attempt == ATTEMPTS:
                raise StoreUnavailable(f"{url}: {what} failed after {attempt} tries ({detail}): the store is "
                                       f"unreachable or failing for now; the newest checkpoint stands, and a "
                                       f"supervisor restart (--max-restarts) tries again") from None
            wait = BACKOFF_S * 2 ** (attempt - 1)
            log.warning("%s: %s failed (%s); retry %d of %d in %.1f s", url, what, detail, attempt, ATTEMPTS - 1,
                        wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _credential_hint(url: str) -> str:
    scheme = url.split(":", 1)[0].lower()
    if scheme == "s3":
        return ("credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials "
                "(endpoint: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)")
    if scheme in ("gs", "gcs"):
        return "credentials come from GOOGLE_APPLICATION_CREDENTIALS or gcloud's application-default login"
    return "the server answered 401/403: the URL needs credentials bert_ds does not send (use a signed URL)"


def _store_of(url: str) -> str:
    """What an error calls the store: ``s3://bucket`` (and the endpoint), ``https://host``."""
    scheme, rest = url.split("://", 1)
    store = f"{scheme}://{rest.split('/', 1)[0]}"
    endpoint = _s3_endpoint() if scheme.lower() == "s3" else None
    return f"{store} (endpoint {endpoint})" if endpoint else store


def _s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _open_filesystem(url: str):
    """The fsspec file system for ``url``'s scheme, imported lazily; BadInput naming the package when missing."""
    scheme = url.split(":", 1)[0].lower()
    try:
        if scheme == "s3":
            import s3fs

            endpoint = _s3_endpoint()
            return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint} if endpoint else {},
                                     skip_instance_cache=True)
        if scheme in ("gs", "gcs"):
            import gcsfs

            return gcsfs.GCSFileSystem(skip_instance_cache=True)
        import aiohttp  # noqa: F401 - fsspec's HTTP file system needs it
        from fsspec.implementations.http import HTTPFileSystem

        return HTTPFileSystem(skip_instance_cache=True)
    except ImportError as exc:
        package = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}.get(scheme, "aiohttp")
        raise BadInput(f"{url}: reading {scheme}:// needs the Python package {package!r}, which is not installed "
                       f"({exc}); pip install {package} (or pip install 'bert_ds[remote]')") from None


class Store:
    """One shard set's location on a store: reads, sizes and uploads of the objects under ``url``. Holds the file
    system per process (a DataLoader worker forked from a rank opens its own: the client's event loop does not
    survive a fork)."""

    def __init__(self, url: str):
        if not is_url(url):
            raise BadInput(f"{url!r} is not a shard-set URL (s3://, gs://, http://, https://)")
        self.url = url.rstrip("/")
        self.store = _store_of(url)
        self.http = self.url.split(":", 1)[0].lower() in ("http", "https")
        self._fs = None
        self._pid = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            self._fs = _open_filesystem(self.url)
            self._pid = os.getpid()
        return self._fs

    def object_url(self, name: str) -> str:
        return join_url(self.url, name)

    def _path(self, name: str) -> str:
        """What the file system calls object ``name`` (HTTP: the URL; object stores: bucket/key)."""
        url = self.object_url(name)
        return url if self.http else url.split("://", 1)[1]

    def read(self, name: str, what: str) -> bytes:
        """The whole object ``name`` (small objects: index.json), retried on transient errors."""
        return with_retries(what, self.object_url(name), self.store, lambda: self.fs.cat_file(self._path(name)))

    def size(self, name: str) -> int:
        url = self.object_url(name)
        return int(with_retries("reading the size of", url, self.store, lambda: self.fs.info(self._path(name)))["size"])

    def sizes(self, names: list[str]) -> dict[str, int]:
        """Byte size of each of ``names`` that exists (one listing on an object store, one HEAD each over HTTP)."""
        if self.http:
            found = {}
            for name in names:
                try:
                    found[name] = self.size(name)
                except RemoteError as exc:
                    if "missing on the store" not in str(exc):
                        raise
            return found
        listing = with_retries("listing", self.url + "/", self.store,
                               lambda: self.fs.ls(self.url.split("://", 1)[1], detail=True, refresh=True))
        return {entry["name"].rsplit("/", 1)[-1]: int(entry["size"]) for entry in listing
                if entry.get("type") == "file"}

    def stream(self, name: str) -> Iterator[bytes]:
        """The bytes of object ``name`` in blocks of 4 MiB, one pass (no retry: the caller restarts the download)."""
        # block_size=0 over HTTP: one streamed GET (Python's http.server, and some CDNs, serve no byte ranges).
        with self.fs.open(self._path(name), "rb", block_size=0 if self.http else _CHUNK) as src:
            while True:
                block = src.read(_CHUNK)
                if not block:
                    return
                yield block

    def upload(self, local_path: str, name: str) -> None:
        if self.http:
            raise BadInput(f"{self.url}: shards are uploaded to object stores (s3://, gs://), not over HTTP")
        url = self.object_url(name)
        with_retries("uploading", url, self.store, lambda: self.fs.put_file(local_path, self._path(name)))
