"""Bandwidth cap: parse a rate, and run a command inside a capped network namespace.

A capped run happens in a private network namespace (``unshare -n``) whose only
interface, the loopback, gets a token-bucket filter (``tc qdisc ... tbf``). All
ranks of a configuration talk over that loopback, so every byte they exchange
pays the cap. MPI must be kept off shared memory (``--mca btl tcp,self``), or
it would bypass the network entirely; the launcher in ``__main__`` does that.
"""

from __future__ import annotations

import shutil
import subprocess

from ..collectives import parse_rate

# tc units are SI (1 kbit = 1000 bit); tc's "bps" means *bytes* per second, a classic
# source of 8x mistakes: the one rate grammar (`collectives.parse_rate`) refuses it.
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
UNLIMITED_NAMES = ("unlimited", "none", "inf", "")

# Token-bucket burst and queueing latency, as in DESIGN.md. The burst must
# exceed the loopback MTU (64 KiB) or large packets can never be sent.
TBF_BURST = "256kb"
TBF_LATENCY = "100ms"


class BandwidthCapError(RuntimeError):
    """The machine does not allow a capped network namespace."""


def parse_bandwidth(text: str) -> int | None:
    """Bits per second of a rate such as ``200mbit`` or ``1gbit`` (`collectives.parse_rate`);
    None for unlimited.

    Example:
        >>> parse_bandwidth("200mbit"), parse_bandwidth("1Gbit/s"), parse_bandwidth("unlimited")
        (200000000, 1000000000, None)
    """
    if text.strip().lower() in UNLIMITED_NAMES:
        return None
    try:
        bits = parse_rate(text) * 8
    except ValueError:
        raise ValueError(
            f"bad bandwidth {text!r}: expected a rate (e.g. 200mbit, 1gbit, 2.5gbit; "
            "collectives.parse_rate) or 'unlimited'"
        ) from None
    if bits < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit, too slow for tc tbf")
    return int(bits)


def format_bandwidth(bits_per_second: int | None) -> str:
    """The canonical short name of a rate: ``200mbit``, ``1gbit``, ``unlimited``.

    Example:
        >>> format_bandwidth(10**9), format_bandwidth(2_500_000_000), format_bandwidth(None)
        ('1gbit', '2500mbit', 'unlimited')
    """
    if bits_per_second is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _UNITS[unit]
        if bits_per_second % scale == 0:
            return f"{bits_per_second // scale}{unit}"
    return f"{bits_per_second}bit"


def tc_commands(bits_per_second: int) -> list[list[str]]:
    """The commands that bring the namespace's loopback up and cap it."""
    return [
        ["ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", "lo", "root", "tbf",
         "rate", f"{bits_per_second}bit", "burst", TBF_BURST, "latency", TBF_LATENCY],
    ]  # fmt: skip


def check_namespace_support() -> None:
    """Fail with a message that says what is missing if a capped namespace is impossible here.

    Raises:
        BandwidthCapError: ``unshare``, ``ip`` or ``tc`` is missing, or the kernel
            refuses a new network namespace or the qdisc (not root, no CAP_NET_ADMIN,
            a container without user namespaces, no sch_tbf).
    """
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise BandwidthCapError(
                f"--bandwidth needs `{tool}` (Debian package {package}); it is not on PATH. "
                "Install it (scripts/bootstrap.sh does) or run without --bandwidth."
            )
    probe = " && ".join(" ".join(c) for c in tc_commands(10**9))
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", probe], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BandwidthCapError(
            "--bandwidth needs a private network namespace with a tc-capped loopback, and this "
            f"machine refused it (`unshare -n sh -c '{probe}'` exited {proc.returncode}: "
            f"{proc.stderr.strip() or proc.stdout.strip()}). It needs root or CAP_SYS_ADMIN + "
            "CAP_NET_ADMIN (in a container: --cap-add NET_ADMIN,SYS_ADMIN or --privileged) "
            "and the kernel's sch_tbf. Run without --bandwidth to measure unlimited only."
        )
