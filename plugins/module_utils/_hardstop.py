# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The module's hard stop, and the restores it must never interrupt (private helper, may change any time).

gpu_release arms an alarm a little after its `timeout`, should a wait overrun it: the alarm's handler raises
ReleaseTimeout wherever the module is. A restore (a daemon started again, persistence mode turned back on, a
stopped container started) runs inside held_off(): an alarm that lands there is remembered, and raised only once
the restore has ended. A stop and its restore run as one such section, entered before the stop: the hard stop
can then land only before anything was stopped, or after everything was restored. Each stop is bounded by the time
left beside its restore's reserve, and each restore by its own bound, so a restore may run past `timeout` by at
most that bound. Python runs signal handlers in the main thread only, where the release runs.
"""

from __future__ import annotations

import contextlib


class ReleaseTimeout(Exception):
    """The overall `timeout` was reached."""


class _State(object):
    held = 0          # depth of held_off() blocks now running
    pending = False   # an alarm landed while held


_STATE = _State()


def on_alarm(signum, frame):
    """The hard stop's SIGALRM handler: raise ReleaseTimeout, or, inside held_off(), remember it for its end."""
    if _STATE.held:
        _STATE.pending = True
        return
    raise ReleaseTimeout("the overall timeout was reached (hard stop)")


def check():
    """Inside held_off(): end the section now (its restores run in its finally) if the hard stop landed."""
    if _STATE.held and _STATE.pending:
        raise ReleaseTimeout("the overall timeout was reached (hard stop, landed while a stop was made: restored first)")


@contextlib.contextmanager
def held_off():
    """A section the hard stop never interrupts: a stop and its restore, each bounded by its own bound. An alarm
    that lands inside is remembered; check() ends the section early, and the outermost section's end raises it."""
    _STATE.held += 1
    try:
        yield
    except BaseException:
        _STATE.pending = _STATE.pending and _STATE.held > 1   # the run ends with this exception already
        raise
    finally:
        _STATE.held -= 1
    if not _STATE.held and _STATE.pending:
        _STATE.pending = False
        raise ReleaseTimeout("the overall timeout was reached (hard stop, held off until a restore had ended)")
