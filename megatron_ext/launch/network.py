"""Ports and network interfaces, checked on this node before anything is launched."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import socket
from pathlib import Path

from megatron_ext.errors import UserError

DEFAULT_MASTER_PORT = 29500  # torchrun's
# Ports claimed by the run.py processes of this machine, one lock file each, shared by all users and
# jobs: /tmp itself, not $TMPDIR, which a scheduler may set per job.
CLAIMS_DIR = Path("/tmp/megatron-ext-ports")
_claims: dict[int, int] = {}  # port -> the open descriptor holding its lock for this process's lifetime


def claim_port(port: int) -> bool:
    """Reserve `port` among the run.py processes of this machine until this one exits; False when
    another holds it. Two run.py started together both find a port free before either torchrun has
    bound it (seen: the second died with EADDRINUSE); the first to claim it keeps it."""
    if port in _claims:
        return True
    try:
        CLAIMS_DIR.mkdir()
        CLAIMS_DIR.chmod(0o1777)
    except FileExistsError:
        pass
    fd = os.open(CLAIMS_DIR / f"{port}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        # An flock ends with its holder however it ends: no stale claims.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _claims[port] = fd
    return True


def claimed(port: int) -> bool:
    """Whether a run.py process of this machine (this one included) holds `port`'s claim."""
    if port in _claims:
        return True
    try:
        fd = os.open(CLAIMS_DIR / f"{port}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if it was taken here
    return False


def port_free(port: int) -> bool:
    """Whether a server could listen on `port` here (as torchrun's TCPStore will, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A port free here and claimed by no run.py, outside the kernel's ephemeral range: a port from
    inside it (what binding port 0 gives) can be taken by any process's outgoing connection, gloo's
    among them, before torchrun listens on it (seen: EADDRINUSE on a busy machine)."""
    ephemeral = _ephemeral_ports()
    outside = max(range(max(1024, ephemeral.start - 16384), ephemeral.start), range(ephemeral.stop, 65536), key=len)
    candidates = outside or range(1024, 65536)
    for _ in range(1000):
        if port_free(port := random.choice(candidates)) and not claimed(port):
            return port
    raise UserError(f"no free TCP port between {candidates.start} and {candidates.stop - 1} on this machine")


def take_port(port: int) -> bool:
    """Whether `port` is free here and now claimed for this run."""
    return port_free(port) and claim_port(port)


def take_free_port() -> int:
    while not take_port(port := free_port()):
        pass
    return port


def check_port(port: int, flag: str) -> None:
    """`port` is free, and claimed for this run."""
    if not 0 < port < 65536:
        raise UserError(f"{flag} {port} is not a TCP port (1-65535)")
    if not port_free(port):
        raise UserError(f"{flag} {port} is in use on this machine; choose another, e.g. {flag} {free_port()}")
    if not claim_port(port):
        raise UserError(f"{flag} {port} is taken by another run.py starting on this machine; choose another, "
                        f"e.g. {flag} {free_port()}")


def is_this_host(host: str) -> bool:
    """Whether `host` names this machine (then the rendezvous server is started here)."""
    name = socket.gethostname()
    return host in ("localhost", "127.0.0.1", "::1", name, name.split(".")[0])


def _loopback(host: str) -> str | None:
    """The loopback address `host` resolves to on this machine; None for another address or none."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    return address if ipaddress.ip_address(address).is_loopback else None


def check_reachable(master: str, interface: str | None, nnodes: int, node_name: str | None = None,
                    this_node: bool = True) -> None:
    """On several nodes, no address the other nodes are given may be a loopback one: the master address
    (unless it names this node), nor, without --interface, this node's name (`node_name`, default the
    host name), which gloo advertises to its peers (Debian's /etc/hosts maps it to 127.0.1.1).
    `this_node` False: the command is for another machine (a dry run), whose name is not checked here."""
    name = node_name or socket.gethostname()
    if master not in (name, name.split(".")[0]) and (address := _loopback(master)):
        shown = master if master == address else f"{master} ({address})"
        raise UserError(f"-m/--master-addr {shown} is a loopback address, on a run of {nnodes} nodes; give the "
                        "address at which the other nodes reach the rank-0 node")
    if this_node and interface is None and (address := _loopback(name)):
        raise UserError(f"this node's name {name} resolves to {address}, a loopback address the other nodes cannot "
                        "reach; name the network interface they share with --interface (e.g. eth0)")


def check_interface(value: str) -> None:
    """--interface must match a network interface of this machine, in NCCL_SOCKET_IFNAME's syntax
    (comma-separated prefixes, `=name` for an exact name, `^name` to exclude)."""
    net = Path("/sys/class/net")
    interfaces = sorted(path.name for path in net.iterdir()) if net.is_dir() else []
    wanted = [item for item in value.split(",") if item and not item.startswith("^")]
    if not interfaces or not wanted:
        return
    for item in wanted:
        if not any(name == item[1:] if item.startswith("=") else name.startswith(item) for name in interfaces):
            raise UserError(f"--interface {value}: no network interface {item.lstrip('=')} on this machine "
                            f"(it has: {', '.join(interfaces)})")
