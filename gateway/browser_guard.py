"""What a web page may ask of a gateway that has no API key (`browser_guard`, a middleware).

A gateway without keys trusts whoever reaches its port: on the default 127.0.0.1, the programs of this
machine. A web browser on the same machine is one of them, driven by any page it opens, in two ways:

- **Cross-site requests.** A page may send a "simple" request (a POST whose body is `text/plain`, or a form)
  to any address without asking first, and the gateway reads any body as JSON whatever its Content-Type: a
  page could start completions, upload files, create batches. The page never reads the answer (the gateway
  sends no CORS headers), but the work is done. Browsers mark such a request: `Sec-Fetch-Site: cross-site`
  (or `same-site`, another port of localhost); older ones only by an `Origin` naming another host than the
  request's `Host`. Either is refused (403, param `origin`) unless the method is GET, HEAD or OPTIONS: those
  change nothing, a page cannot read their answer, and a link from another site to the dashboard is one. The
  dashboard's own requests are same-origin; SDKs and curl send neither header.
- **DNS rebinding.** A page at http://evil.example:8000 whose name then resolves to 127.0.0.1 is, for the
  browser, same-origin with the gateway, and may read what it answers: stored responses, files, batches.
  Its requests arrive over loopback naming `evil.example` in `Host`. So a request that reached the gateway
  over a loopback address must name a host of this machine (`local_name`): an IP address, `localhost`, a name
  under `.localhost`, `.local` or `.internal` (names no public DNS may serve), this machine's hostname or a
  name /etc/hosts gives a loopback address (`localhost.localdomain`, the FQDN on 127.0.1.1), or one of
  `gateway.allowed_hosts` (a reverse proxy on this machine that passes its own `Host` on; `"*"`: any).
  Otherwise 403, param `host`.

With API keys neither applies: a page knows no key, and every such request is a 401 already. Nor do they to
the probes, `/health` and `/ready` (so a refused proxy's name is logged, once, as a WARNING). A gateway with
no key bound beyond loopback (`host: 0.0.0.0`) is open to its network, a page that rebinds its name to the
machine's network address included: give it API keys.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from pathlib import Path

from aiohttp import web

from gateway.openai.errors import ApiError
from gateway.runtime import GATEWAY

log = logging.getLogger("cliffguard.gateway")

__all__ = ["browser_guard", "local_name", "loopback", "machine_names"]

LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
PROBES = {"/health", "/ready"}   # say nothing a page could use; a load balancer's check may send any Host
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
MAX_WARNED_NAMES = 64   # Host names whose refusal is logged (once each): a page may send any number
_WARNED: set[str] = set()
_CROSS_SITE = ("cross-site", "same-site")   # Sec-Fetch-Site; "same-origin" and "none" (typed in) are the user's


@web.middleware
async def browser_guard(request: web.Request, handler) -> web.StreamResponse:
    spec = request.app[GATEWAY].config.gateway
    if not spec.api_keys and request.path not in PROBES:
        _check_site(request)
        _check_host(request, spec.allowed_hosts)
    return await handler(request)


def _check_site(request: web.Request) -> None:
    """A browser's `Sec-Fetch-Site` decides where it is sent; else (an older browser) `Origin` against `Host`,
    the scheme aside (a TLS proxy in front: the page's is https, the gateway's http). Safe methods pass."""
    if request.method in _SAFE_METHODS:
        return
    site, origin = request.headers.get("Sec-Fetch-Site"), request.headers.get("Origin")
    if site is not None:
        cross = site.lower() in _CROSS_SITE
    else:
        cross = origin is not None and origin.partition("://")[2].lower() != request.host.lower()
    if cross:
        raise ApiError(403, f"origin: a web page of another site ({origin or site}) may not use this gateway: it "
                       "has no API key, so it answers only the programs of its machine and its own pages (set "
                       "gateway.api_keys to serve other sites' pages)", param="origin", code="cross_site_request")


def _check_host(request: web.Request, allowed: tuple[str, ...]) -> None:
    if "*" in allowed or not _over_loopback(request):
        return
    name = _host_name(request.headers.get("Host"))
    if name is None or local_name(name) or name in {_host_name(a) for a in allowed}:
        return
    if len(_WARNED) < MAX_WARNED_NAMES and name not in _WARNED:   # a proxy's name: /health stays 200, say it once
        _WARNED.add(name)
        log.warning("refusing requests over loopback that name host %r, not a name of this machine: a reverse "
                    "proxy here that passes its Host on needs it in gateway.allowed_hosts", name[:100])
    raise ApiError(403, f"host: {name!r} is not a name of this machine; a gateway without an API key reached "
                   "over loopback answers only its own names (a web page's name resolved to 127.0.0.1 must not "
                   "reach it). A reverse proxy that passes its Host on: list the name in gateway.allowed_hosts",
                   param="host", code="unknown_host")


def _over_loopback(request: web.Request) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    # not a tuple: a Unix socket, or a connection gone; no browser reaches it by a name
    return isinstance(sockname, tuple) and bool(sockname) and loopback(str(sockname[0]))


def loopback(address: str) -> bool:
    """Whether `address` (an IP address, in brackets or with a zone too; or a name) is this machine's loopback:
    a loopback IP, `localhost` or a name under `.localhost`."""
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        name = address.lower().rstrip(".")
        return name == "localhost" or name.endswith(".localhost")


def _host_name(header: str | None) -> str | None:
    """The name of a Host header, lowercased, without its port or brackets; None where there is no header
    (HTTP/1.0: no name was used)."""
    if not header:
        return None
    header = header.strip().lower()
    if header.startswith("["):   # [::1]:8000
        return header[1:header.find("]")] if "]" in header else header
    return (header.rsplit(":", 1)[0] if header.count(":") == 1 else header).rstrip(".")


def local_name(name: str) -> bool:
    """Whether `name` (lowercase, no port) names this machine for sure: an IP address (a browser that connects
    to an address names that address, never a page's domain), `localhost` or a name under LOCAL_SUFFIXES, or
    one of `machine_names`."""
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == "localhost" or name.endswith(LOCAL_SUFFIXES) or name in machine_names()


@functools.cache
def machine_names(hosts: Path = Path("/etc/hosts")) -> frozenset[str]:
    """This machine's hostname and the names `hosts` gives a loopback address (read once; no DNS lookup)."""
    names = {socket.gethostname().lower()}
    try:
        lines = hosts.read_text(errors="replace").splitlines()
    except OSError:
        return frozenset(names)
    for line in lines:
        address, *aliases = line.partition("#")[0].split() or [""]
        if loopback(address):
            names.update(alias.lower().rstrip(".") for alias in aliases)
    return frozenset(names)
