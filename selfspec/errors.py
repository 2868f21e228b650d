"""User-facing errors: one line that names the parameter and what is allowed."""


class SelfSpecError(ValueError):
    """Bad input or an unusable file. Entry points print `error: <message>` and exit with status 2."""


def check(condition: bool, message: str) -> None:
    """Raise SelfSpecError(message) unless condition holds."""
    if not condition:
        raise SelfSpecError(message)


def is_int(x) -> bool:
    """An integer, not a bool (YAML's `true` is not a size) and not a string ("64" from a hand-written file)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
