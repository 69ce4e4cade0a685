"""Size arithmetic both sides share: ceiling division, and byte counts written for people."""

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0), e.g. the blocks that hold a tokens."""
    return -(-a // b)


def format_bytes(n: int) -> str:
    """n bytes in the largest binary unit it reaches, one decimal: 1000 B, 640 KiB, 1.5 MiB, -3.2 GiB."""
    exponent = 0
    while exponent < len(_BYTE_UNITS) - 1 and abs(n) >= 1024 ** (exponent + 1):
        exponent += 1
    if exponent == 0:
        return f"{n} B"
    return f"{n / 1024**exponent:.1f}".removesuffix(".0") + f" {_BYTE_UNITS[exponent]}"
