"""The emulated network: a bridge and one network namespace per node index, veth-linked,
each link shaped with `tc ... tbf` in both directions (the node's upload and download).

The kernel here lacks `netem`, so latency comes from a userspace delay proxy (delay_proxy.py):
in the sender's namespace the receiver's address is a local alias where a proxy listens, and
the proxy forwards from the root namespace over the bridge after the delay. Node configs keep
the real addresses. Needs root, `ip netns` and `tc`.
"""
import os
import re
from typing import Any, Dict, List, Optional

from mdi.lab.commands import EmulationError, command_text, is_root, run_checked, try_run
from mdi.lab.delay_proxy import NETNS_DIR, DelayProxy, listen_in_netns  # noqa: F401  (NETNS_DIR: for users of netns)


def network_unavailable_reason() -> Optional[str]:
    if not is_root():
        return "not running as root"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            return "the %r command is missing" % tool
    return None


def tbf_command(dev: str, mbit: float, netns: Optional[str] = None) -> List[str]:
    """`tc qdisc add ... tbf`: the bucket holds 4 ms of traffic (at least 16 KB) so the
    shaping works whatever the kernel's timer frequency; 50 ms of queue at most."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(16384, int(rate_bytes * 0.004))
    where = ["-n", netns] if netns else []
    return ["tc"] + where + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", "%dkbit" % int(mbit * 1000),
                             "burst", str(burst), "latency", "50ms"]


class NetworkLab:
    """A bridge and one namespace per node index, veth-linked, shaped, with delay proxies."""

    def __init__(self, tag: str, n_nodes: int, bandwidth_mbit: Optional[float], latency_ms: float) -> None:
        self.tag, self.n_nodes = tag, n_nodes
        self.bandwidth_mbit, self.latency_ms = bandwidth_mbit, latency_ms
        self.bridge = tag + "br"
        self.subnet: Optional[str] = None
        self.namespaces: List[str] = []
        self.proxies: List[DelayProxy] = []
        self._bridge_made = False

    def netns(self, k: int) -> str:
        return "%sn%d" % (self.tag, k)

    def address(self, k: int) -> str:
        return "%s.%d" % (self.subnet, 10 + k)

    def gateway(self) -> str:
        return "%s.1" % self.subnet

    def create(self) -> None:
        self.subnet = _free_subnet()
        run_checked(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        run_checked(["ip", "addr", "add", self.gateway() + "/24", "dev", self.bridge])
        run_checked(["ip", "link", "set", self.bridge, "up"])
        for k in range(self.n_nodes):
            self._add_node(k)
        if self.latency_ms > 0:
            self._add_aliases()

    def _add_node(self, k: int) -> None:
        ns, outer, inner = self.netns(k), "%sv%d" % (self.tag, k), "%sp%d" % (self.tag, k)
        run_checked(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        run_checked(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        run_checked(["ip", "link", "set", inner, "netns", ns])
        run_checked(["ip", "link", "set", outer, "master", self.bridge])
        run_checked(["ip", "link", "set", outer, "up"])
        run_checked(["ip", "-n", ns, "addr", "add", self.address(k) + "/24", "dev", inner])
        run_checked(["ip", "-n", ns, "link", "set", inner, "up"])
        run_checked(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Answer ARP only for addresses on the asking interface: the peer aliases on lo must
        # not capture the bridge's traffic (the proxy would then connect to itself, forever).
        run_checked(["ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/conf/all/arp_ignore"])
        if self.bandwidth_mbit:
            run_checked(tbf_command(outer, self.bandwidth_mbit))  # the node's download
            run_checked(tbf_command(inner, self.bandwidth_mbit, ns))  # the node's upload

    def _add_aliases(self) -> None:
        """The addresses each node sends to, made local in its namespace for the delay proxies:
        the starter (0) talks to every worker; worker k to k+1 and (when last) to the starter."""
        for k in range(self.n_nodes):
            peers = range(1, self.n_nodes) if k == 0 else sorted({0, k + 1} - {self.n_nodes})
            for peer in peers:
                run_checked(["ip", "-n", self.netns(k), "addr", "add", self.address(peer) + "/32", "dev", "lo"])

    def add_proxy(self, sender: int, receiver: int, port: int) -> None:
        """Delay what `sender` sends to `receiver`:port (and the replies) by latency_ms."""
        host = self.address(receiver)
        listener = listen_in_netns(self.netns(sender), host, port)
        self.proxies.append(DelayProxy(listener, (host, port), self.latency_ms / 1000.0,
                                       "delay-%d-%d-%d" % (sender, receiver, port)))

    def close_proxies(self) -> None:
        for p in self.proxies:
            p.close()
        self.proxies = []

    def exec_prefix(self, k: int) -> List[str]:
        return ["ip", "netns", "exec", self.netns(k)]

    def close(self) -> List[str]:
        self.close_proxies()
        problems = []
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth pair
            problems.extend(try_run(["ip", "netns", "del", ns]))
        self.namespaces = []
        if self._bridge_made:
            problems.extend(try_run(["ip", "link", "del", self.bridge]))
            self._bridge_made = False
        return problems

    def record(self) -> Dict[str, Any]:
        return {"bridge": self.bridge, "subnet": "%s.0/24" % self.subnet,
                "namespaces": [self.netns(k) for k in range(self.n_nodes)],
                "addresses": [self.address(k) for k in range(self.n_nodes)]}


def _free_subnet() -> str:
    """A 10.213.X.0/24 that no interface or route of this machine uses."""
    used = command_text(["ip", "-4", "-o", "addr", "show"]) + "\n" + command_text(
        ["ip", "-4", "route", "show", "table", "all"])
    for x in range(200, 255):
        prefix = "10.213.%d" % x
        if not re.search(re.escape(prefix + "."), used):
            return prefix
    raise EmulationError("no free 10.213.X.0/24 subnet for the emulated network")
