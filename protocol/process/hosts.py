"""Several hosts: which local address and interface reach the head, and how a host is named in logs."""

import fcntl
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def source_address(master_addr: str) -> str:
    """The local IPv4 address this host's packets to master_addr leave from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, 9))
        return str(probe.getsockname()[0])


def interface_with(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 address, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def host_label(master_addr: str) -> str:
    """'hostname (address toward the head)': names a host in logs, also hosts that share a hostname."""
    return f"{socket.gethostname()} ({source_address(master_addr)})"


def pin_collective_interface(master_addr: str) -> None:
    """Make gloo and NCCL use the interface that reaches the head, unless the user chose one.

    gloo otherwise binds the address its hostname resolves to, often loopback, which no other host reaches."""
    name = interface_with(source_address(master_addr))
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
