"""Client-supplied values in log lines: escaped, so a newline cannot start a forged line, and cut short."""


def safe_for_log(value: object, limit: int = 200) -> str:
    """repr() of value (control characters escaped), at most `limit` characters; a cut one ends in '...'."""
    if isinstance(value, str | bytes):
        value = value[: limit + 1]  # enough to show that it is cut, without a repr of all of it
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
