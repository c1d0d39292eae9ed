"""Real hosts on one Linux machine, for the multi-node tests and the link benchmark: network namespaces, each
with its own interface, address, hostname and /etc/hosts, joined by veth pairs through a bridge. Needs root and
iproute2 (`ip`, `tc`); traffic goes only between the namespaces made here.

    with Hosts(2, rate="1gbit") as hosts:                     # host0 at 10.213.7.1, host1 at 10.213.7.2
        job = hosts.start(1, ["bash", "launch.sh", "1"], env)  # in host1: its network, its hostname "host1"
        hosts.cut(1)                                           # host1's link down: no reset, packets just vanish

Everything is removed on leaving the block, failure or not: the processes in the namespaces, the namespaces
(their links go with them) and their /etc/netns folders.
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.213.7"  # a private /24 that exists only inside the namespaces
SECOND_SUBNET = "10.213.8"  # the second network card's, when the hosts have two
IPV6_SUBNET = "fd00:213:7:"  # eth0's IPv6 /64, when the hosts have IPv6 addresses too


def available():
    """Why these hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"ip netns does not work here: {probe.stderr.strip()}"


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """`count` hosts named host0, host1, ... at SUBNET.1, SUBNET.2, ... on eth0; `rate` (e.g.
    "1gbit") caps each host's sending rate with tc's token bucket; `hosts_files[i]`, if given, replaces host i's
    /etc/hosts; `cards=2` adds eth1, at SECOND_SUBNET.1, .2, ..., on a network of its own; `default_route` (a card:
    "eth0") sends what has no other route there (name lookups then wait for a DNS server that never answers: only
    where a test needs it); `ipv6` gives eth0 IPV6_SUBNET:1, :2, ... too."""

    def __init__(self, count, rate=None, hosts_files=None, cards=1, default_route=None, ipv6=False):
        self.names = [f"ddp{os.getpid()}h{i}" for i in range(count)]
        self.switch = f"ddp{os.getpid()}sw"
        self.rate, self.hosts_files, self.cards = rate, hosts_files or {}, cards
        self.default_route, self.ipv6 = default_route, ipv6

    def address(self, i):
        return f"{SUBNET}.{i + 1}"

    def ipv6_address(self, i):
        return f"{IPV6_SUBNET}:{i + 1}"

    def hosts_file(self):
        """The /etc/hosts every host has unless told otherwise: each name at its own address."""
        return "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} host{i}\n" for i in range(len(self.names)))

    def __enter__(self):
        try:
            ip("netns", "add", self.switch)
            for card, subnet in enumerate([SUBNET, SECOND_SUBNET][:self.cards]):
                ip("-n", self.switch, "link", "add", f"br{card}", "type", "bridge")
                ip("-n", self.switch, "link", "set", f"br{card}", "up")
            for i, name in enumerate(self.names):
                ip("netns", "add", name)
                ip("-n", name, "link", "set", "lo", "up")
                for card, subnet in enumerate([SUBNET, SECOND_SUBNET][:self.cards]):
                    port = f"port{i}c{card}"
                    ip("-n", name, "link", "add", f"eth{card}", "type", "veth", "peer", "name", port, "netns",
                       self.switch)
                    ip("-n", self.switch, "link", "set", port, "master", f"br{card}", "up")
                    ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", f"eth{card}")
                    ip("-n", name, "link", "set", f"eth{card}", "up")
                if self.ipv6:  # nodad: usable at once, not after duplicate address detection
                    ip("-n", name, "addr", "add", f"{self.ipv6_address(i)}/64", "dev", "eth0", "nodad")
                if self.default_route:  # as on a real machine; the bridge has no way out
                    ip("-n", name, "route", "add", "default", "dev", self.default_route)
                if self.rate:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                    "rate", self.rate, "burst", "1mb", "latency", "100ms"], check=True, timeout=30)
                etc = Path("/etc/netns") / name
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(self.hosts_files.get(i, self.hosts_file()))
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, i, cmd, env=None, **popen):
        """Start cmd on host i, under its hostname, in a session of its own."""
        wrapped = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                   f"host{i}", *map(str, cmd)]
        return subprocess.Popen(wrapped, env=env, start_new_session=True, **popen)

    def pids(self, i):
        found = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, timeout=30)
        return [int(pid) for pid in found.stdout.split()]

    def kill(self, i, sig=signal.SIGKILL):
        """Signal every process on host i."""
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def cut(self, i):
        """Host i's link goes down: its packets, and those sent to it, are lost without a reset."""
        ip("-n", self.names[i], "link", "set", "eth0", "down")

    def __exit__(self, *exc):
        for i, name in enumerate(self.names):
            for _ in range(50):  # killed until none is left: a dying launcher may still start one
                if not self.pids(i):
                    break
                self.kill(i)
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=30)
