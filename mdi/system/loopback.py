"""Loopback addresses, and the requests a web browser makes on a page's behalf.

Without a shared secret a node listens on loopback only. That keeps other machines out, but not
a web page open in a browser on this machine: it may send simple requests (a `no-cors` POST
needs no preflight) to 127.0.0.1:PORT, and through DNS rebinding (its own name resolved to
127.0.0.1) read the answers as its own origin (h38: a page stopped a worker, read its run id
and served itself completions). Such a request names the page's host in `Host`, and a browser
marks a page's requests (`Origin`, `Sec-Fetch-Site`); mdi's own clients do neither.
"""
import ipaddress
import os
import socket
from typing import Any, Dict, FrozenSet, Mapping, Optional

# what a browser says of a request a page made (`none`: typed in the address bar)
PAGE_FETCH_SITES = ("cross-site", "same-site", "same-origin")
HOSTS_FILE = "/etc/hosts"
_local_names: Dict[str, Any] = {}  # the last read of local_names: its file and stamp, and its names


def is_loopback(host: str) -> bool:
    """Whether `host` only reaches this machine: binding anywhere else needs the secret."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # the short forms inet_aton accepts and the OS binds: 127.1, 127.0.1
        return ipaddress.ip_address(socket.inet_aton(host)).is_loopback
    except OSError:
        return False


def _host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def foreign_host(header: Optional[str]) -> Optional[str]:
    """Why a request to a server bound to loopback that names `header` as its Host is refused
    (None: a loopback address, localhost, this machine's name or a name /etc/hosts gives a
    loopback address: names no web page can point here). A request without one (HTTP/1.0) is
    let through: no browser leaves it out."""
    if not header:
        return None
    name = _host_name(header.strip()).lower().rstrip(".")
    if is_loopback(name) or name == "localhost" or name.endswith(".localhost") or name in local_names():
        return None
    return ("Host %r is not a name of this machine's loopback address (a web page's DNS rebinding?): name it "
            "127.0.0.1 or localhost, or, behind a proxy that passes its own Host, set a shared secret (MDI_TOKEN)"
            % header[:100])


def local_names(hosts: str = HOSTS_FILE) -> FrozenSet[str]:
    """This machine's name and the names `hosts` gives a loopback address (Debian's 127.0.1.1
    line, ip6-localhost, localhost.localdomain...), read again when the file changes."""
    try:
        stamp = os.stat(hosts).st_mtime_ns
    except OSError:
        stamp = None
    key = (hosts, stamp)
    if _local_names.get("key") != key:
        names = {socket.gethostname().lower()}
        try:
            with open(hosts, encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split("#", 1)[0].split()
                    if len(fields) > 1 and is_loopback(fields[0]):
                        names.update(n.lower().rstrip(".") for n in fields[1:])
        except OSError:
            pass
        _local_names.update(key=key, names=frozenset(names))
    return _local_names["names"]



def from_page(headers: Mapping[str, str]) -> Optional[str]:
    """Why a request a browser made for a page is refused by a server no page has reason to
    call (a worker's control plane); None where nothing marks it. `headers` keyed as waitress
    keys them ("ORIGIN", "SEC_FETCH_SITE")."""
    if headers.get("ORIGIN") is not None or headers.get("SEC_FETCH_SITE") in PAGE_FETCH_SITES:
        return "requests from web pages are refused here (Origin %s)" % (headers.get("ORIGIN") or "unsaid")[:100]
    return None
