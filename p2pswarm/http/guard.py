"""What keeps the web out of the HTTP API (the threat model: docs/security.md).

The agent answers on loopback without a token, so the user's browser can reach it from
any page it visits. Every request passes ``WebGuard.check`` before it is routed:

- ``Host`` must name this agent (DNS rebinding): an IP address (a rebinding page can
  only send its own *name*; an address in ``Host`` means the browser connected to that
  address as the page's own origin), ``localhost``, or a name the user allowed
  (``join --http-allow-host``, and the name ``--http`` binds).
- A state-changing request from a browser must come from this agent's own origin:
  ``Origin`` (when present) equals ``http://`` + the ``Host``, and ``Sec-Fetch-Site``
  (when present) says ``same-origin`` or ``none``. Programs (curl, the openai client,
  the CLI) send neither and pass.
- A request with a body must say ``Content-Type: application/json``: a form or a
  ``text/plain`` fetch (the requests a browser sends cross-site without asking first)
  cannot.
- Framing a proxy could read differently is refused: ``Content-Length`` together with
  ``Transfer-Encoding``, several or malformed lengths, a body announced over the cap.

``job_paths_allowed`` is the last rule: a job sent over HTTP may name files (its data,
its checkpoint directory) only inside directories the local user allowed.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from p2pswarm.http.problems import HttpError

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024  # the whole header block (hypercorn's h11 limit is set to it)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost"})
JSON_TYPE = "application/json"
# Sent with every answer: pages load only their own files and run in no frame; nothing is
# sniffed into another type; the token in a page's address never leaves in a Referer.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", "default-src 'self'; script-src 'self'; "
     "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
     "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
# The refusals counted in ``status`` (``drops``, as ``http-<code>``).
COUNTED = frozenset({"foreign-host", "foreign-origin", "unsupported-media-type",
                     "bad-framing", "too-large", "headers-too-large", "dir-not-allowed"})

Headers = Iterable[tuple[bytes, bytes]]


def split_host(value: str) -> tuple[str, int | None]:
    """``Host`` (or an origin's netloc) as a lowercase name and a port; ValueError when
    it is neither ``name[:port]`` nor ``[v6][:port]``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(value)
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(value)
        port_text = rest[1:]
    else:
        name, _, port_text = value.partition(":")
    if not name or (port_text and (not port_text.isdigit() or len(port_text) > 5)):
        raise ValueError(value)
    return name.rstrip("."), int(port_text) if port_text else None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class WebGuard:
    """The rules above for one server; ``allow_hosts`` are the extra names it answers."""

    allow_hosts: frozenset[str] = frozenset()

    @classmethod
    def for_names(cls, names: Iterable[str]) -> WebGuard:
        return cls(frozenset(n.strip().lower().rstrip(".") for n in names if n.strip()))

    def host_allowed(self, name: str) -> bool:
        return name in LOOPBACK_NAMES or name in self.allow_hosts or _is_address(name)

    def check(self, method: str, raw_headers: Headers) -> None:
        """Raise the HttpError that refuses this request, if any rule does."""
        headers: dict[str, list[str]] = {}
        for key, value in raw_headers:
            headers.setdefault(key.decode("latin-1").lower(), []).append(
                value.decode("latin-1"))
        self._check_framing(headers)
        host = self._check_host(headers)
        if method.upper() not in SAFE_METHODS:
            self._check_origin(headers, host)
            self._check_content_type(headers)

    def _check_framing(self, headers: Mapping[str, list[str]]) -> None:
        if sum(len(k) + len(v) + 4 for k, vs in headers.items() for v in vs) > MAX_HEADER_BYTES:
            raise HttpError("headers-too-large", f"the request's headers are over "
                                                 f"{MAX_HEADER_BYTES // 1024} KiB")
        lengths = headers.get("content-length", [])
        if lengths and "transfer-encoding" in headers:
            raise HttpError("bad-framing", "the request has both Content-Length and "
                                           "Transfer-Encoding: send one")
        if len(lengths) > 1:
            raise HttpError("bad-framing", "the request has several Content-Length headers")
        if lengths:
            text = lengths[0].strip()
            if not text.isdigit() or len(text) > 19:
                raise HttpError("bad-framing", f"Content-Length {text[:40]!r} is not a length")
            if int(text) > MAX_BODY_BYTES:
                raise HttpError("too-large", f"the request body is over "
                                             f"{MAX_BODY_BYTES // (1024 * 1024)} MiB")

    def _check_host(self, headers: Mapping[str, list[str]]) -> tuple[str, int | None] | None:
        values = headers.get("host", [])
        if not values:
            return None  # HTTP/1.0 without Host: no browser sends that
        if len(values) > 1:
            raise HttpError("bad-framing", "the request has several Host headers")
        try:
            host = split_host(values[0])
        except ValueError:
            raise HttpError("foreign-host", f"Host {values[0][:80]!r} is not a host "
                                            "name") from None
        if not self.host_allowed(host[0]):
            raise HttpError("foreign-host", f"this agent does not answer to the name "
                                            f"{host[0][:80]!r} (a page of another site "
                                            "resolving its name here?); to use that name, "
                                            f"add `--http-allow-host {host[0][:80]}` to "
                                            "`p2pswarm join`")
        return host

    def _check_origin(self, headers: Mapping[str, list[str]],
                      host: tuple[str, int | None] | None) -> None:
        site = [s.strip().lower() for s in headers.get("sec-fetch-site", [])]
        if any(s not in ("same-origin", "none") for s in site):
            raise HttpError("foreign-origin", f"a {site[0]} request from a web page may not "
                                              "change anything on this agent")
        origins = headers.get("origin", [])
        if not origins:
            return  # not a browser: curl, the openai client, the CLI
        origin = origins[0].strip()
        if len(origins) > 1 or not _same_origin(origin, host):
            raise HttpError("foreign-origin", f"requests from the page {origin[:80]!r} may "
                                              "not change anything on this agent; only "
                                              "its own pages may")

    def _check_content_type(self, headers: Mapping[str, list[str]]) -> None:
        lengths = headers.get("content-length", [])
        has_body = "transfer-encoding" in headers or any(v.strip() != "0" for v in lengths)
        if not has_body:
            return
        kind = (headers.get("content-type") or [""])[0].partition(";")[0].strip().lower()
        if kind != JSON_TYPE:
            raise HttpError("unsupported-media-type",
                            f"the body must be JSON sent with `Content-Type: {JSON_TYPE}`, "
                            f"not {kind or 'no Content-Type'!r}")


def _same_origin(origin: str, host: tuple[str, int | None] | None) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the origin ``host`` is served as."""
    if host is None or origin == "null":
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or parts.path or parts.query or parts.username:
        return False
    try:
        name, port = split_host(parts.netloc)
    except ValueError:
        return False
    default = 443 if parts.scheme == "https" else 80
    return (name, port or default) == (host[0], host[1] or default)


# --- files a job names ---------------------------------------------------------------------


def job_paths(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, path)`` for every file or directory ``config`` (a job.json object) names
    on this fellow's disk; ConfigError for a job that is not valid."""
    from p2pswarm.training.job import JobConfig, local_data_files

    job = JobConfig.from_dict(config)
    out = [("data", p) for p in local_data_files(job.data)]
    if job.checkpoint.dir is not None:
        out.append(("checkpoint.dir", job.checkpoint.dir))
    return out


def job_paths_allowed(config: Mapping[str, Any], allow_dirs: tuple[Path, ...]) -> None:
    """Refuse (403 ``dir-not-allowed``) a job sent over HTTP that names a file outside
    ``allow_dirs``, the directories given to ``join --http-allow-dir``."""
    roots = [Path(os.path.realpath(d)) for d in allow_dirs]
    for field, raw in job_paths(config):
        path = Path(raw)
        if not path.is_absolute():
            raise HttpError("bad-request", f"{field} {raw[:200]!r} is a relative path: over "
                                           "HTTP give an absolute one")
        real = Path(os.path.realpath(path))  # symlinks followed: where it really is
        if any(real == root or root in real.parents for root in roots):
            continue
        where = (f"the directories it allows ({', '.join(map(str, allow_dirs))})" if roots
                 else "any directory: none is allowed")
        raise HttpError("dir-not-allowed", f"{field} {raw[:200]!r} is outside {where}. A job "
                                           "sent over HTTP may read and write files only in "
                                           "directories you allow: add `--http-allow-dir DIR`"
                                           " to `p2pswarm join`, or submit the job with "
                                           "`p2pswarm train`")


__all__ = ["COUNTED", "MAX_BODY_BYTES", "MAX_HEADER_BYTES", "SECURITY_HEADERS", "WebGuard",
           "job_paths", "job_paths_allowed", "split_host"]
