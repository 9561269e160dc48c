"""What dispatch/ calls in the layers above it, which put their functions here when they are
imported (``adaptive_eager.thread_state`` through ``adaptive_eager.api``, and
``runtime.engine``): so dispatch/ imports nothing above it, and what it calls is named in one
place. Until then no runtime exists anywhere, and the defaults say so.
"""
from __future__ import annotations

from typing import Callable


def _nothing(*_args, **_kwargs) -> None:
    return None


# adaptive_eager.thread_state: where a thread's runtime pauses, resumes and sits out.
control_point: Callable[[], None] = _nothing
end_segment: Callable[[], None] = _nothing
sit_out: Callable[..., None] = _nothing
stop_sitting_out: Callable[..., None] = _nothing
pauses_between_ops: Callable[[], bool] = lambda: False
pause_point_reached: Callable[[], bool] = lambda: True
# runtime.engine: every runtime alive in this process.
live_runtimes: Callable[[], list] = lambda: []
