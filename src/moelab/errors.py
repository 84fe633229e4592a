"""Errors that mean "the user's input is wrong", as opposed to a bug in moelab."""


class UserError(Exception):
    """Bad input (a missing file, a corrupt database, an incompatible checkpoint).

    The CLI prints the message as one line and exits with status 2, so the message
    must name the cause and, where there is one, the fix.
    """
