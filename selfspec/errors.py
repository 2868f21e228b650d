"""User-facing errors: one line that names the parameter and what is allowed."""


class SelfSpecError(ValueError):
    """Bad input or an unusable file. Entry points print `error: <message>` and exit with status 2."""


def check(condition: bool, message: str) -> None:
    """Raise SelfSpecError(message) unless condition holds."""
    if not condition:
        raise SelfSpecError(message)
