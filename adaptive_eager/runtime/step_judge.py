"""Judging the runtime by the program's own steps: intercepting against paused, side by side.

# Note [Judged by the step]
Each mechanism judges its own part: a kernel's trial times its fused runs against its per-op
runs (Note [Side by side]), pausing weighs interception against what kernels save (Note
[Pausing]). What neither sees is what intercepting costs the ops themselves: deferred outputs
and replays allocated beside eager's, tensors held to a segment's end, so that freed memory is
not reused and pages fault in again (Note [Allocator thresholds]). On GPT-2's training step a
kernel saving ~1 ms a step kept the runtime intercepting while its steps ran 7-20% slower
than paused ones. So once nothing compiles or is due to and no kernel is on trial (its first
runs pay one-time costs, and its trial runs per-op beside it; a kernel whose key stopped
coming is on none: KeyTable.kernels_on_trial), the runtime times the program
between its control points (an optimizer step, ``backward()``, ``ae.sync()``) in windows of WINDOW
points, in rounds of the states it may run in: intercepting; paused keeping its kernels (Note
[Kernels while paused] in csrc/hot_path.cpp), where C++ knows any; paused plainly, the key out
of the dispatch set. The fastest state wins, by more than MARGIN over the best before it in
the order PREFERRED (intercepting, plain, kernels kept): a state that is not clearly faster
is not worth the switch. A paused state that wins makes the runtime pause, for PAUSE_FIRST_S, doubling to
PAUSE_LONGEST_S while verdicts stay the same (a kernel landing meanwhile ends the pause, as any
pause); else it probes again after KEEP_FIRST_S, doubling to KEEP_LONGEST_S. A compile that
starts or ends during a probe abandons it (the windows would not compare like with like).
Counting control points rather than seconds keeps the windows whole steps' worth of each
phase however long a step is; a window also lasts SHORTEST_WINDOW_S at least, in multiples of
WINDOW points, and states are compared by their time per point: 16 points of a small MLP's
0.4 ms training step (~4 ms) left the verdict to the jitter of a 2-core machine, which timed
kernels kept within 2% of plain where blocks of 200 steps differed by 12-15%. A loop that
passes no control point is never judged. The first probe waits FIRST_PROBE_S after enable():
a program's first steps record and compile.

A paused window that already took LOSING times the probe's fastest whole window (per point)
ends there, untimed: timing a state costs the program what that state loses. A pointwise loop
whose kernel runs 9x faster than its ops spent 32 steps of every probe at eager's speed in
plain windows (the bench's chain8 large measured 0.47 of eager, not 0.11). A state is judged
by its whole windows, and is out only when it lost in every round: one lost window may be the
machine's, not the state's. On a 2-core machine whose speed moves 2x within seconds, a small
MLP's training step lost both its paused windows to one slow stretch and went on
intercepting, 1.38x slower than paused, until the next probe.

Kernels kept while paused come after plain in that order, so they must be faster than plain
by MARGIN too: where they are not, the pause goes on plainly, the key out. They keep the key in for all of the program, not only the
steps between the control points timed, and a tie timed in windows was not one in steady
state: a small MLP's training step, kernels timed within 2.5% of plain, then ran 20-25%
slower kept with them than its plain pauses in other runs.

A pause of pausing's own that keeps kernels (Note [Pausing], runtime/pausing.py) is judged too,
between its two states only: once a probe is due, windows kept with the kernels and plain
ones, in turn; the faster, by MARGIN over keeping them, is how the pause goes on (its length
is pausing's). Otherwise only the ledger of Note [Kernels that do not pay while paused] would
weigh them, and a program that pauses again at every resume would never be probed.

The plain window is measured, not inferred: keeping kernels while paused costs every op of the
program a pass through the extension, each kernel a launch and its ops their deferral, and the
kernels' own trials (Note [Side by side]) time a segment, not the step around it. A small
MLP's training step (batch 8, width 32: every op of its forward and backward in two kernels)
ran 13-20% slower paused with its kernels than plainly, while the ledger of Note [Kernels that
do not pay while paused], crediting each run with its trial's saving (14x), kept them; where
pausing paused it before the judge's first probe, it ran so (12-17% slower than eager, in 2
bench runs of 3) until a probe that only its pauses' ends could start.
"""
from __future__ import annotations

import dataclasses
import enum
import math

WINDOW = 16               # control points a window lasts (a multiple of 1, 2 or 4 points a step)
SHORTEST_WINDOW_S = 0.05  # and seconds at least (in multiples of WINDOW points)
ROUNDS = 2                # windows of each state, taken in turn
MARGIN = 0.03             # a state must win by this share of the time of the one it replaces
LOSING = 1.25             # a paused window this much slower than the fastest one is lost
PAUSE_FIRST_S, PAUSE_LONGEST_S = 8.0, 128.0
KEEP_FIRST_S, KEEP_LONGEST_S = 16.0, 256.0
FIRST_PROBE_S = 4.0


class Action(enum.Enum):
    NONE = "none"
    PAUSE_WINDOW = "pause_window"     # pause, kernels kept, until the judge says otherwise
    PLAIN_WINDOW = "plain_window"     # go on paused without the kernels, the key out
    KERNELS_WINDOW = "kernels_window"  # a paused probe: go on paused with the kernels again
    RESUME = "resume"                 # a paused window is over
    PAUSE = "pause"                   # the verdict: pause for ``paused_for()``, kernels kept
    PAUSE_PLAIN = "pause_plain"       # the verdict: pause so, without the kernels


class State(enum.Enum):
    """What a window times (Note [Judged by the step])."""
    INTERCEPTING = "intercepting"
    KERNELS = "kernels"               # paused, the kernels C++ knows still running
    PLAIN = "plain"                   # paused, the key out of the dispatch set


# The order states must win in, each by MARGIN over the best before it (Note [Judged by the
# step]): staying as it is, then the plain pause, then kernels kept while paused.
PREFERRED = (State.INTERCEPTING, State.PLAIN, State.KERNELS)


# The action that starts a window of each state, and the verdict that keeps one.
_STARTS = {State.INTERCEPTING: Action.RESUME, State.KERNELS: Action.PAUSE_WINDOW,
           State.PLAIN: Action.PLAIN_WINDOW}
_VERDICTS = {State.INTERCEPTING: Action.RESUME, State.KERNELS: Action.PAUSE,
             State.PLAIN: Action.PAUSE_PLAIN}


@dataclasses.dataclass
class Judge:
    """Note [Judged by the step]: one runtime's probes and verdicts. ``at_point`` is called at
    each control point the program passes, with the clock's time."""

    probe_at: float                   # when the next probe may start
    pause_s: float = PAUSE_FIRST_S    # the next verdict's pause
    keep_s: float = KEEP_FIRST_S      # the next wait after a verdict to keep intercepting
    schedule: list = dataclasses.field(default_factory=list)   # windows to time, running first
    totals: dict = dataclasses.field(default_factory=dict)     # the probe's seconds per state
    timed_points: dict = dataclasses.field(default_factory=dict)   # in its whole windows
    fastest_point_s: float = math.inf   # the probe's fastest whole window, per point
    window_start: float | None = None     # None: no probe running
    points: int = 0
    answers: int = 0                  # the table's compiles_answered when the probe began
    verdicts: int = 0                 # how many pauses it decided (for stats and tests)
    last_totals: dict = dataclasses.field(default_factory=dict)   # the last verdict's seconds
    paused_probe: bool = False        # the probe times a pause's two states only

    @classmethod
    def starting_at(cls, now: float) -> "Judge":
        return cls(probe_at=now + FIRST_PROBE_S)

    @property
    def probing(self) -> bool:
        return self.window_start is not None

    @property
    def last_times(self) -> tuple:
        """(intercepting, fastest paused) seconds of the last verdict; zeros before one."""
        totals = self.last_totals
        if not totals:
            return (0.0, 0.0)
        return (totals[State.INTERCEPTING],
                min(seconds for state, seconds in totals.items()
                    if state is not State.INTERCEPTING))

    @property
    def window(self) -> State | None:
        """The state the running window times (None: no probe)."""
        return self.schedule[0] if self.probing else None

    @property
    def paused_window(self) -> bool:
        return self.window not in (None, State.INTERCEPTING)

    def at_point(self, now: float, settled: bool, answers: int, kernels: bool = False,
                 paused: bool = False) -> Action:
        """``settled``: nothing compiles or is due to, no kernel is on trial; ``answers``:
        compiles answered so far; ``kernels``: would a pause keep kernels (a probe that
        starts here then times a plain paused window too); ``paused``: the thread is in a
        pause of pausing's own that keeps its kernels (a probe that starts here times that
        pause with and without them)."""
        if not self.probing:
            if settled and now >= self.probe_at:
                self._start(now, kernels, paused)
                self.answers = answers
            return Action.NONE
        if not settled or answers != self.answers:
            return self.abandon(now)
        self.points += 1
        elapsed = now - self.window_start
        if self.points % WINDOW or elapsed < SHORTEST_WINDOW_S:
            if self.paused_window and \
                    elapsed > LOSING * self.fastest_point_s * max(self.points, WINDOW):
                return self._next_window(now, lost=True)
            return Action.NONE
        self.totals[self.window] += elapsed
        self.timed_points[self.window] += self.points
        self.fastest_point_s = min(self.fastest_point_s, elapsed / self.points)
        return self._next_window(now, lost=False)

    def _start(self, now: float, kernels: bool, paused: bool) -> None:
        if paused:
            states = (State.KERNELS, State.PLAIN)
        else:
            states = (State.INTERCEPTING, State.KERNELS) + ((State.PLAIN,) if kernels else ())
        self.paused_probe = paused
        self.schedule, self.totals = list(states) * ROUNDS, dict.fromkeys(states, 0.0)
        self.timed_points = dict.fromkeys(states, 0)
        self.window_start, self.points, self.fastest_point_s = now, 0, math.inf

    def _next_window(self, now: float, lost: bool) -> Action:
        """The running window is over: whole, or ``lost`` (a paused state already slower than
        the fastest window by LOSING: not timed; the state's next round times it again)."""
        self.schedule.pop(0)
        self.window_start, self.points = now, 0
        if not self.schedule:
            self.window_start = None            # the probe is over
            return self._paused_verdict(now) if self.paused_probe else self._verdict(now)
        if self.paused_probe and self.schedule[0] is State.KERNELS:
            return Action.KERNELS_WINDOW
        return _STARTS[self.schedule[0]]

    def abandon(self, now: float) -> Action:
        """Stop the probe; RESUME if it was in a paused window of an intercepting one (a
        paused probe's pause goes on as it is)."""
        resume = self.paused_window and not self.paused_probe
        self.window_start, self.schedule = None, []
        self.probe_at = now
        return Action.RESUME if resume else Action.NONE

    def _best(self) -> State:
        """The probe's verdict state: the fastest, by MARGIN over the best before it in
        PREFERRED; each by its whole windows' time per point, counted as ROUNDS windows of
        WINDOW points (a state lost in every round: inf). Kept as ``last_totals``."""
        points = self.timed_points
        self.last_totals = totals = {
            state: seconds * ROUNDS * WINDOW / points[state] if points[state] else math.inf
            for state, seconds in self.totals.items()}
        ranked = [state for state in PREFERRED if state in totals]
        best = ranked[0]
        for state in ranked[1:]:
            if totals[state] < totals[best] * (1.0 - MARGIN):
                best = state
        return best

    def _paused_verdict(self, now: float) -> Action:
        """A paused probe's: keep the kernels, or go on plainly; probed again KEEP_FIRST_S on."""
        best = self._best()
        self.probe_at = now + KEEP_FIRST_S
        return Action.PAUSE if best is State.KERNELS else Action.PAUSE_PLAIN

    def _verdict(self, now: float) -> Action:
        best = self._best()
        if best is not State.INTERCEPTING:
            self.verdicts += 1
            self.probe_at = now + self.pause_s      # probed again once the pause is over
            self.keep_s = KEEP_FIRST_S
            return _VERDICTS[best]
        self.probe_at = now + self.keep_s
        self.keep_s = min(self.keep_s * 2, KEEP_LONGEST_S)
        self.pause_s = PAUSE_FIRST_S
        return Action.RESUME            # (the last window was a paused one)

    def paused_for(self) -> float:
        """The verdict's pause, doubling the next one."""
        seconds, self.pause_s = self.pause_s, min(self.pause_s * 2, PAUSE_LONGEST_S)
        return seconds
