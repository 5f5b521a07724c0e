"""Who can reach a daemon: its listening sockets from /proc, and a connect from another host.

Real: the kernel's socket tables (/proc/<pid>/net/tcp{,6} joined with the socket inodes among
the pid's file descriptors) and a real network namespace joined to this one by a veth pair, so
"another host" is a peer at a non-loopback address whose packets arrive on an interface of
this machine, exactly as a neighbour's would. Not modelled: routing beyond one hop (a peer
further away only adds hops, not addresses a daemon could listen on).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _hex_addr(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.append(_hex_addr(fields[1]))
    return found


PROBE = """
import socket, sys
host = sys.argv[1]
for port in map(int, sys.argv[2:]):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); print(port, "open")
    except OSError as exc:
        print(port, type(exc).__name__)
    finally:
        s.close()
"""


@contextmanager
def neighbour() -> Iterator[tuple[str, callable]]:
    """A peer in a network namespace of its own, one veth hop away. Yields this machine's
    address as the peer sees it and `connect(ports) -> {port: "open" | error name}`."""
    tag = f"{os.getpid() % 100000:05d}"
    host_if, peer_if = f"vsa{tag}", f"vsb{tag}"
    net = ipaddress.ip_network(f"10.{200 + os.getpid() % 50}.{(os.getpid() // 50) % 256}.0/30")
    host_ip, peer_ip = (str(a) for a in net.hosts())
    holder = subprocess.Popen(["unshare", "--net", "sleep", "600"])
    ns = f"/proc/{holder.pid}/ns/net"

    def ip(*args: str, inside: bool = False) -> None:
        cmd = ["nsenter", f"--net={ns}", "ip", *args] if inside else ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    try:
        for _ in range(50):  # unshare has switched namespaces once its ns link differs from ours
            if os.readlink(ns) != os.readlink("/proc/self/ns/net"):
                break
            subprocess.run(["sleep", "0.05"])
        ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        ip("link", "set", peer_if, "netns", str(holder.pid))
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("addr", "add", f"{peer_ip}/30", "dev", peer_if, inside=True)
        ip("link", "set", peer_if, "up", inside=True)
        ip("link", "set", "lo", "up", inside=True)

        def connect(ports: list[int]) -> dict[int, str]:
            out = subprocess.run(["nsenter", f"--net={ns}", sys.executable, "-c", PROBE, host_ip,
                                  *map(str, ports)], capture_output=True, text=True, timeout=60, check=True)
            return {int(p): what for p, what in (line.split() for line in out.stdout.splitlines())}

        yield host_ip, connect
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        holder.kill()
        holder.wait()


def assert_reachable_from_this_machine_only(pids: dict[str, int]) -> None:
    """Every daemon listens, only on loopback addresses, and a neighbour is refused on each of
    its ports while a control listener on all addresses is open to it (so the path works)."""
    import socket

    sockets = {name: listening(pid) for name, pid in pids.items()}
    assert all(sockets.values()), f"a daemon listens on nothing: {sockets}"
    wide = {name: s for name, s in sockets.items() if any(not ipaddress.ip_address(a).is_loopback for a, _ in s)}
    assert not wide, f"listening beyond loopback: {wide}"
    ports = sorted({port for s in sockets.values() for _, port in s})
    with socket.socket() as control:
        control.bind(("0.0.0.0", 0))
        control.listen()
        control_port = control.getsockname()[1]
        with neighbour() as (_addr, connect):
            seen = connect([control_port, *ports])
    assert seen.pop(control_port) == "open", "the neighbour cannot reach even a listener on all addresses"
    assert seen == dict.fromkeys(ports, "ConnectionRefusedError"), seen
