"""bench/machine.py's run_main: a benchmark stopped by bad input or by a signal that saved
its work ends in one line and the CLI's exit codes, as `moelab` does, not a traceback."""

from __future__ import annotations

import pytest
from conftest import import_bench

from moelab.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, Interrupted, UserError


@pytest.fixture(scope="module")
def machine():
    return import_bench("machine")


def _raises(error: BaseException):
    def main():
        raise error

    return main


@pytest.mark.parametrize(("error", "code", "words"), [
    (UserError("corpus runs/data/ladder not prepared"), EXIT_USER_ERROR,
     "error: corpus runs/data/ladder not prepared"),
    (Interrupted(810), EXIT_INTERRUPTED, "interrupted at step 810"),
    (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted"),
])
def test_a_stopped_bench_ends_in_one_line(machine, capsys, error, code, words):
    with pytest.raises(SystemExit) as stop:
        machine.run_main(_raises(error))
    assert stop.value.code == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_main_exit_code_passes_through(machine):
    for returned, code in ((None, 0), (0, 0), (1, 1)):
        with pytest.raises(SystemExit) as stop:
            machine.run_main(lambda r=returned: r)
        assert stop.value.code == code


def test_a_bug_still_shows_its_traceback(machine):
    # run_main turns only the errors moelab's CLI turns into one line; a bug is not hidden
    with pytest.raises(ZeroDivisionError):
        machine.run_main(lambda: 1 / 0)
