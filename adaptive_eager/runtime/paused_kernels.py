"""Do the kernels a pause keeps pay for the key they keep in? (Note [Kernels that do not pay
while paused])

# Note [Kernels that do not pay while paused]
A pause that keeps the thread's kernels (Note [Kernels while paused] in csrc/hot_path.cpp)
keeps the key in its dispatch set, and that costs every op of the program, fused or not:
- each op goes through the extension: boxed, ~1.7 us an op for transformers' decode ops
  (12,752 in a 32-token generate of the decode benchmark's small Llama: 8-14% of its time);
  since the most common ops pass unboxed (Note [Unboxed pass-through] in csrc/unboxed.cpp),
  ~0.1-0.3 us (2-6% of that generate, 2-3% of GPT-2's tiny training step);
- a run that starts a kernel's path and parts from it is deferred, then replayed: ~90-190 us
  each there. The decode loop's q/k/v/o/gate/up projections share their first calls, so ~50
  runs a generate started a path and none fused.
That decode loop ran 12-26% slower paused with its kernels than paused with the key out. So
while a pause keeps kernels it keeps a ledger: what their fused runs saved (each run the
saving its kernel's trial measured, else the predicted one), against the ops it passed
through and its divergences, at the costs below (the cheaper end of what was measured, so a
kernel that may pay is kept). Every LEDGER_OPS paused ops the ledger is read: if keeping
the kernels cost more than they saved, the pause goes on without them, the key out (plain
eager; the waker ends a bare loop's pause). The next pause keeps them again and is judged
again: LEDGER_OPS of ops cost at most ~14 ms in that decode loop, against pauses of 1-64 s.
A ledger is an estimate; where the program passes control points the step judge times paused
steps with and without the kernels (Note [Judged by the step]), and a pause it decides
plainly keeps none.
"""
from __future__ import annotations

import dataclasses

PASS_THROUGH_S_PER_OP = 0.2e-6
DIVERGENCE_S = 50e-6
LEDGER_OPS = 8192          # paused ops a verdict weighs (a multiple of RESUME_EVERY)


@dataclasses.dataclass
class KernelLedger:
    """One pause's account of its kernels (Note [Kernels that do not pay while paused])."""

    divergences_at: float          # the process's divergence count when the window began
    saved_s: float = 0.0
    ops: int = 0

    def credit(self, saving_s: float, runs: int) -> None:
        """``runs`` fused runs, each taken to save ``saving_s``."""
        self.saved_s += max(0.0, saving_s) * runs

    def count_ops(self, ops: int) -> bool:
        """``ops`` more paused ops; is a verdict due?"""
        self.ops += ops
        return self.ops >= LEDGER_OPS

    def cost_s(self, divergences_now: float) -> float:
        """What keeping the kernels cost this window."""
        return self.ops * PASS_THROUGH_S_PER_OP + \
            max(0.0, divergences_now - self.divergences_at) * DIVERGENCE_S

    def pays(self, divergences_now: float) -> bool:
        """The verdict on this window: did the kernels save what they cost? The next window
        starts empty."""
        paid = self.saved_s >= self.cost_s(divergences_now)
        self.divergences_at, self.saved_s, self.ops = divergences_now, 0.0, 0
        return paid
