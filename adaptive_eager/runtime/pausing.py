"""Pausing: where nothing is worth fusing, the runtime stops intercepting (Note [Pausing],
``Pausing._watch``). The part of a ``Runtime`` (runtime/engine.py) that weighs each segment
it ends and decides when to pause; the pause itself starts and ends at control points
(thread_state.control_point, dispatch/control.py).
"""
from __future__ import annotations

import math

from adaptive_eager.config import config
from adaptive_eager.dispatch import control
from adaptive_eager.runtime import clock, native_plans, scheduling
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.paused_kernels import KernelLedger
from adaptive_eager.runtime.policy import KeyState
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.step_judge import Judge

PAUSE_FIRST_S = 1.0       # the first pause; each fruitless probe doubles it...
PAUSE_LONGEST_S = 64.0    # ...up to this
# How much one segment counts toward PAUSE_WINDOW (Note [Pausing]): a new key 1; a key judged
# never to fuse is stronger evidence; a new shape of a structure that keeps changing shapes
# stronger still, and four times that when it is too cheap to compile even if its shape came
# back (a loop of ever-new small shapes pauses after 4 steps, not ~10: each watched step costs
# about 3-5x a plain one there; large ones keep the plain weight, so bucketed lengths that recur
# reach their generic kernel first). A loop that runs a kernel empties the window each
# iteration, as long as the kernel pays for the interception around it (Runtime._watch_kernel),
# and beside it a few small dynamic segments must not fill it (pausing would stop the kernel
# too): so no pause comes from fewer than MIN_QUIET_SEGMENTS segments, which lets up to 3 of
# them sit beside a kernel. A key compiling or due to, where a pause ends by itself (a program
# that passes control points, or the C++ backend's waker), is the whole window at once: the
# loop's kernel is coming (keys not yet hot are found after the pause). A key waiting, not yet
# due, keeps the runtime watching if its runs save more than watching them costs
# (scheduling.worth_watching: ~10 us an op on the C++ backend, ~55 through Python's mode), else
# it too is the whole window. Through Python's mode, a program that passes no control point (a
# bare loop) never pauses while compiles wait or run: Note [No pause without a way back].
HOPELESS_WEIGHT = 8
CHURN_WEIGHT = 32
CHEAP_CHURN_WEIGHT = 4 * CHURN_WEIGHT
MIN_QUIET_SEGMENTS = 4
# A pause needs the program to have passed this many control points since the runtime last
# resumed (or started), where it passes any: a whole-window key in a step's forward (GPT-2's
# 64-op chunks, waiting and not worth watching) paused the runtime before that step's
# optimizer step every time, so AdamW's key, which turns hot on its second watched step (its
# scalars lift first: Note [Lifted scalars]), was seen once in 90 s and never compiled. Three
# points (backward, optimizer step, backward) watch each phase of a step at least once.
POINTS_BEFORE_PAUSE = 3
# Interception charged to a per-op segment (Runtime._watch_kernel) is its wall time beyond its
# ops' own, at most this per op: about twice what recording costs here (~40-75 us an op), so
# the program's own code between two ops of a segment (data loading, logging) is not taken
# for interception.
MOST_INTERCEPTION_S_PER_OP = 100e-6
# Interception charged to a run of a cold plan (Note [Cold plans] in csrc/plans.cpp), per op:
# they cost ~0.5-2 us an op beside eager (~1.5 measured over GPT-2's tiny training step,
# harvests included). Their wall time would not do: it spans the program's own code between
# ops, which costs eager as much and is far more on a small model. Uncharged, that step stayed
# intercepting at 1.1-1.27x eager's time beside an AdamW kernel credited ~0.03 ms a step.
COLD_PLAN_S_PER_OP = 1e-6


class Pausing:
    """Mixed into ``Runtime``: its pausing state and decisions (it needs ``table`` and
    ``flush``)."""

    def _init_pausing(self) -> None:
        self.quiet_segments = 0                   # their weight, see Note [Pausing]
        self.quiet_count = 0                      # and how many
        self.unpaid_s = 0.0                       # interception kernels have not paid for
        self._points_at_resume = control.points_passed()   # (POINTS_BEFORE_PAUSE)
        self._points_seen = control.points_passed()   # at the last segment end, and the
        self._segments_since_point = config.PAUSE_WINDOW   # segments since it moved (none yet)
        self._segments_since_kernel = config.PAUSE_WINDOW  # and since a kernel last ran
        self.pause_requested = False
        self.pause_backoff_s = PAUSE_FIRST_S
        self.awaited_answers: int | None = None   # see awaited_kernel_landed()
        self.judge = Judge.starting_at(clock.monotonic())   # Note [Judged by the step]
        self.kernel_ledger: KernelLedger | None = None   # a pause keeping its kernels
        self.kernels_unpaid = False              # this pause's kernels did not pay: dropped

    def _watch_kernel(self, variant, runs: int = 1) -> None:
        """Note [Pausing]: a kernel keeps the runtime intercepting only while what its runs
        save pays for the interception of the per-op segments around them (their wall time
        beyond their ops' own, up to MOST_INTERCEPTION_S_PER_OP an op). A kernel saving
        ~1.4 ms a step beside ~50 intercepted ops a step held off every pause of a wide MLP's
        training, which ran 11-15% slower than eager. A kernel not yet judged (Note [Side by
        side]) is given the benefit of the doubt."""
        self._segments_since_kernel = 0
        saving = variant.entry.saving_s
        if self.kernel_ledger is not None:
            self.kernel_ledger.credit(scheduling.predicted_saving_s(variant.entry)
                                      if saving is None else saving, runs)
        if saving is None:
            self.unpaid_s = 0.0
            self._watch(None)                  # news: a probe that finds it was fruitful
            return
        self.unpaid_s -= saving * runs
        if self.unpaid_s <= 0:                 # paid: the quiet window starts over, and
            self.unpaid_s = 0.0                # a pause would still back off (a known kernel
            self.quiet_segments = self.quiet_count = 0   # is no news)

    def ran_cold(self, entry, runs: int) -> None:
        """The extension ran ``runs`` of ``entry``'s segment per-op (Note [Cold plans] in
        csrc/plans.cpp): they count toward a pause as Python's own per-op runs do, and their
        interception is charged to the kernels (_watch_kernel) as theirs is."""
        self.unpaid_s += runs * len(entry.segment.ops) * COLD_PLAN_S_PER_OP
        self._watch(entry, runs)

    def _watch(self, entry, runs: int = 1) -> None:
        """Note [Pausing]: a Python dispatch mode costs more than a tiny op itself. Once
        segments with nothing fused or worth compiling add up to PAUSE_WINDOW, ask to stop
        intercepting; the pause takes effect, and ends, at control points outside the mode
        (dispatch/control.py), since a mode cannot take itself off the stack.

        ``entry`` is the key of a segment that ran per-op (None: one ran fused). Each counts
        by the strength of its evidence (the weights above): dynamic shapes pause within a
        few steps. A pause while kernels compile (nothing else to do: a training loop's first
        steps) lasts until one lands, which a control point notices; a loop that passes no
        control point would never notice, so there it does not pause while compiles wait or
        run."""
        self._count_control_points(runs)
        self._segments_since_kernel += runs
        if entry is None or entry.promising(self._backend()):
            self.quiet_segments = self.quiet_count = 0
            self.pause_backoff_s = PAUSE_FIRST_S
            return
        if self._kernels_pending_without_way_back():
            self.quiet_segments = self.quiet_count = 0
            return
        weight = self._weight(entry)
        self.quiet_segments += weight * runs
        self.quiet_count += runs
        enough = self.quiet_count >= MIN_QUIET_SEGMENTS or weight >= config.PAUSE_WINDOW
        if self.quiet_segments >= config.PAUSE_WINDOW and enough and config.PAUSE and \
                not self.pause_requested and self._watched_each_phase():
            self.pause_requested = True
            decide("pause_requested", segments=self.quiet_segments)
            control.pause_requested()

    def _watched_each_phase(self) -> bool:
        """POINTS_BEFORE_PAUSE: has the program passed enough control points since the last
        resume (or passed none lately: a bare loop)?"""
        passed = control.points_passed() - self._points_at_resume
        return passed >= POINTS_BEFORE_PAUSE or not self.control_points_pass()

    def _kernels_pending_without_way_back(self) -> bool:
        """Note [No pause without a way back]: Python's mode pauses and resumes at control
        points; a program that passed none since the quiet segments began (a bare loop of
        tensor ops) would pause for good, and a waiting compile starts only at a segment end,
        which a paused loop never reaches: its hot key would wait for ever. So while compiles
        are due or run there, the runtime keeps intercepting (a key still banking keeps it
        intercepting as long as it comes back: KeyEntry.promising). On the C++ backend a
        paused bare loop is woken (Note [Waking a paused thread] in csrc/intercept.cpp): its
        pause banks, starts compiles and ends when a kernel lands as any other."""
        if self.has_way_back():
            return False
        table = self.table               # compiles_due walks the waiting keys: last
        return bool(table.compiles_in_flight or table.compiles_due)

    def has_way_back(self) -> bool:
        """Would a pause end by itself: the program passed a control point lately, or the
        C++ backend wakes its paused thread?"""
        return self.native is not None or self.control_points_pass()

    def _backend(self) -> str:
        return "python" if self.native is None else "cpp"

    def _weight(self, entry) -> int:
        if entry.state is KeyState.COMPILING or (entry.state is KeyState.WAITING and (
                scheduling.is_due(entry) or not scheduling.worth_watching(entry,
                                                                          self._backend()))):
            # its kernel is coming, or it banks better paused: at once where a pause ends
            # by itself, unless a kernel runs (a pause would stop it): then as a hopeless key
            if not self.has_way_back():
                return 1
            return HOPELESS_WEIGHT if self._kernel_ran_lately() else config.PAUSE_WINDOW
        if entry.churning:
            return CHEAP_CHURN_WEIGHT if entry.too_cheap else CHURN_WEIGHT
        return HOPELESS_WEIGHT if entry.hopeless else 1

    def _kernel_ran_lately(self) -> bool:
        return self._segments_since_kernel < config.PAUSE_WINDOW

    def _count_control_points(self, segments: int = 1) -> None:
        points = control.points_passed()
        if points != self._points_seen:
            self._points_seen, self._segments_since_point = points, 0
        else:
            self._segments_since_point += segments

    def control_points_pass(self) -> bool:
        """Has the program passed a control point within the last PAUSE_WINDOW segments
        (so a pause would end)?"""
        return self._segments_since_point < config.PAUSE_WINDOW

    def paused_for(self) -> float:
        """Start a pause (at a control point): flush, and return how long it lasts. While
        kernels compile or are due to (Note [When to compile] in runtime/scheduling.py), until
        one of them lands (awaited_kernel_landed); else for the back-off, which each fruitless
        pause doubles, or until a kernel lands (keys banking while paused start compiles)."""
        self.flush()
        self.pause_requested, self.quiet_segments, self.quiet_count = False, 0, 0
        self.unpaid_s = 0.0
        self._forget_kernel_verdict()
        counters.add("pauses")
        if (self.table.compiles_in_flight or self.table.compiles_due) and \
                self.has_way_back():
            self.awaited_answers = self.table.compiles_answered
            return PAUSE_LONGEST_S
        self.awaited_answers = self.table.compiles_answered
        seconds, self.pause_backoff_s = self.pause_backoff_s, min(self.pause_backoff_s * 2,
                                                                   PAUSE_LONGEST_S)
        return seconds

    def paused_by_judge(self, window: bool) -> float:
        """Start a pause of the step judge's (Note [Judged by the step]): one of its paused
        windows (until it says, math.inf), or the pause it decided. Either ends if a kernel
        lands meanwhile (awaited_kernel_landed), as any pause."""
        self.awaited_answers = self.table.compiles_answered
        if window:
            self._forget_kernel_verdict()
            return math.inf               # (the verdict's pause goes on from the last window)
        self.unpaid_s = 0.0
        counters.add("pauses")
        return self.judge.paused_for()

    def keeps_kernels_paused(self) -> None:
        """A pause began that keeps the thread's kernels: open its ledger (Note [Kernels
        that do not pay while paused] in runtime/paused_kernels.py), or go on with the one
        open (an ``ae.paused()`` block came between)."""
        if self.kernel_ledger is None:
            self.kernel_ledger = KernelLedger(divergences_at=counters.value("divergences"))

    def kernels_pay_while_paused(self, ops: int) -> bool:
        """``ops`` more ops passed the paused thread that keeps its kernels: do they still
        pay for it? Once a verdict says no, the ledger is closed (the caller drops them)."""
        ledger = self.kernel_ledger
        if ledger is None or not ledger.count_ops(ops):
            return True
        native_plans.touch_pending(self.table)        # the fused runs C++ made: credited
        native_plans.publish_counts()                 # and the divergences
        divergences = counters.value("divergences")
        saved_s, cost_s = ledger.saved_s, ledger.cost_s(divergences)
        if ledger.pays(divergences):
            return True
        self.kernel_ledger, self.kernels_unpaid = None, True
        counters.add("pauses_without_kernels")
        decide("paused_without_kernels", saved_ms=round(saved_s * 1e3, 2),
               cost_ms=round(cost_s * 1e3, 2))
        return False

    def resumed(self, kernel_landed: bool) -> None:
        """A pause ended. One that ended because a kernel landed gives the kernel a chance
        to run before keys still due may pause again: they weigh as beside a running kernel
        (_weight) for PAUSE_WINDOW segments. Without that, a training loop resumed at its
        optimizer step paused again within that step, before its forward, whose kernel had
        landed, ever ran fused."""
        self._forget_kernel_verdict()
        self._points_at_resume = control.points_passed()
        if kernel_landed:
            self._segments_since_kernel = 0

    def judge_keeps_kernels(self, keep: bool) -> None:
        """The step judge's plain window or verdict (Note [Judged by the step]): this pause
        runs without its kernels, the key out, also after an ``ae.paused()`` block within it;
        or (``keep``) with them again, weighed by a new ledger."""
        self.kernel_ledger, self.kernels_unpaid = None, not keep

    def _forget_kernel_verdict(self) -> None:
        """A pause begins or ends: no ledger of its kernels, no verdict on them yet."""
        self.kernel_ledger, self.kernels_unpaid = None, False

    def awaited_kernel_landed(self) -> bool:
        """Did the compile this pause waits for end (a kernel, or a failure)? Collects it."""
        if self.awaited_answers is None:
            return False
        table = self.table
        if table.compiles.has_news():      # (paused control points ask: most find none)
            table.poll_compiles()
        return table.compiles_answered != self.awaited_answers
