"""The contract between the runtime and an engine: what a caller says between steps (Control), what it is told
and asked during a run (Hooks), and what an engine offers (EngineLike: Engine and vision/serial.SerialEngine).
"""

from __future__ import annotations

import enum


class Control(enum.Enum):
    RUN = "run"
    DRAIN = "drain"  # admit nothing new; let in-flight requests finish
    STOP = "stop"  # stop now; unfinished requests stay pending (they run again later)
    CANCEL = "cancel"  # stop now; unfinished requests are reported for cancellation
