"""Where an ``image_url`` may point beyond a ``data:`` URL, as the server's operator allows it.

By default only inline data URLs are read. ``fw serve`` opens two more sources (vLLM's flag names):

- ``--allowed-local-media-path DIR``: local paths and ``file:`` URLs whose real path (symlinks and
  ``..`` resolved) lies inside ``DIR``;
- ``--allowed-media-domains HOST ...``: ``http(s)`` URLs of those hosts (``*``: any host), fetched
  with ``--media-fetch-timeout`` seconds for the whole download, at most
  :data:`~framework.multimodal.images.MAX_IMAGE_BYTES` (read in chunks, given up past the limit),
  no redirects (a redirect could leave the allowed hosts).

Every refusal is an :class:`~framework.multimodal.images.ImageError` naming the flag that opens the
source or the limit that was met. The API process turns it into a 400 naming the content part.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from framework.multimodal.images import MAX_IMAGE_BYTES, ImageError


@dataclass(frozen=True, slots=True)
class MediaSources:
    """The image sources an operator opened: a local directory, web hosts, the fetch limits."""

    #: ``--allowed-local-media-path``: paths under this directory may be read (None: none may).
    allowed_local_path: Path | None = None
    #: ``--allowed-media-domains``: host names (lower case) whose http(s) URLs are fetched; ``*`` any.
    allowed_domains: tuple[str, ...] = ()
    #: ``--media-fetch-timeout``: seconds one download may take, connection included.
    fetch_timeout_s: float = 10.0
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def from_flags(
        cls, local_path: str | None, domains: list[str] | None, fetch_timeout_s: float = 10.0
    ) -> MediaSources:
        """The sources of the CLI flags (``domains`` one host each); ``ValueError`` for a directory
        that does not exist or a bad timeout."""
        root = None
        if local_path:
            root = Path(local_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {local_path!r} is not a directory")
        if fetch_timeout_s <= 0:
            raise ValueError(f"--media-fetch-timeout must be positive, got {fetch_timeout_s}")
        return cls(root, tuple(host.lower() for host in domains or []), fetch_timeout_s)


#: Only data URLs (the default of ``LLM.chat`` and of ``fw serve`` without the flags).
DATA_URLS_ONLY = MediaSources()


def read_image_source(url: str, sources: MediaSources) -> bytes:
    """The encoded bytes an ``http(s)`` URL, a ``file:`` URL or a local path points to, if ``sources`` allow it."""
    if url.startswith(("http://", "https://")):
        return _fetch(url, sources)
    if url.startswith("file:"):
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(
                f"a file: URL names a local file (file:///path); {url[:80]!r} names host {parsed.netloc!r}"
            )
        return _read_local(urllib.parse.unquote(parsed.path), sources)
    if url.startswith("/") or url.startswith("~") or url.startswith("."):
        return _read_local(url, sources)
    raise ImageError(
        "an image_url is a data URL (data:image/png;base64,...)"
        + (", an http(s) URL" if sources.allowed_domains else "")
        + (", a file: URL or a local path" if sources.allowed_local_path else "")
        + f"; got {url[:40]!r}"
    )


def _read_local(raw: str, sources: MediaSources) -> bytes:
    root = sources.allowed_local_path
    if root is None:
        raise ImageError(
            "local paths and file: URLs are read only under the directory the server's operator allows "
            "(fw serve --allowed-local-media-path DIR); send the image inline as a data URL"
        )
    path = Path(raw).expanduser().resolve()
    if not path.is_relative_to(root):
        raise ImageError(f"{raw!r} is outside the allowed media directory {str(root)!r}")
    if not path.is_file():
        raise ImageError(f"{raw!r} is not a file under the allowed media directory")
    size = path.stat().st_size
    if size > sources.max_bytes:
        raise ImageError(f"the image is larger than {_size(sources.max_bytes)}")
    return path.read_bytes()


def _fetch(url: str, sources: MediaSources) -> bytes:
    import httpx

    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if not sources.allowed_domains:
        raise ImageError(
            "image URLs over http(s) are fetched only from the hosts the server's operator allows "
            "(fw serve --allowed-media-domains HOST); send the image inline as a data URL (data:image/png;base64,...)"
        )
    if "*" not in sources.allowed_domains and host not in sources.allowed_domains:
        raise ImageError(f"images are not fetched from {host!r}; allowed hosts: {', '.join(sources.allowed_domains)}")
    deadline = time.monotonic() + sources.fetch_timeout_s
    limit = sources.max_bytes
    try:
        with httpx.Client(timeout=sources.fetch_timeout_s, follow_redirects=False) as client:
            with client.stream("GET", url) as response:
                if response.is_redirect:
                    raise ImageError(f"the image URL redirects ({response.status_code}); redirects are not followed")
                if response.status_code != 200:
                    raise ImageError(f"fetching the image gave HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise ImageError(f"the image is larger than {_size(limit)}")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise ImageError(f"the image is larger than {_size(limit)}")
                    if time.monotonic() > deadline:
                        raise ImageError(f"fetching the image took longer than {sources.fetch_timeout_s:g} s")
                    chunks.append(chunk)
    except httpx.TimeoutException:
        raise ImageError(f"fetching the image took longer than {sources.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as error:
        raise ImageError(f"the image could not be fetched ({type(error).__name__})") from None
    return b"".join(chunks)


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
