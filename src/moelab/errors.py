"""The one error hierarchy and the CLI's exit codes.

Every `moelab` command ends with one of these codes, so scripts and the training
supervisor can tell a finished run from bad input, a divergence or an interruption
without parsing messages:

    0    finished
    1    failed for another reason (the supervisor gave up; a checkpoint failed verify)
    2    bad input: the one-line message names the cause and the fix (UserError)
    3    training diverged (a non-finite loss or gradient, or a save refused as implausible:
         loss above 3 ln(vocab), spike-rule divergence, parameters out of bound); nothing
         bad was saved
    130  stopped by SIGTERM/SIGINT after saving a checkpoint; rerun the command to resume
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)


class UserError(Exception):
    """Bad input (a missing file, a corrupt database, an incompatible checkpoint).

    The CLI prints the message as one line and exits with status 2, so the message
    must name the cause and, where there is one, the fix.
    """


class ConfigError(UserError, ValueError):
    """A config that cannot work; the message names the field and the fix."""


class DivergenceError(RuntimeError):
    """The loss, gradient or parameters became non-finite; the last good checkpoint is kept."""


class Interrupted(Exception):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint at `step` (None: it
    stopped before the first step, e.g. while preparing its data; `message` says where)."""

    def __init__(self, step: int | None, message: str | None = None):
        super().__init__(message or f"interrupted at step {step}; checkpoint {step} saved; "
                         "rerun the same command to resume")
        self.step = step
