//! Recompute-style preemption. The victim is always the youngest live sequence, so the oldest one
//! always progresses (alone it fits the arena, checked at start-up) and every request finishes.
//! Its emitted tokens are kept: on readmission it prefills prompt + emitted tokens and its next
//! token comes out of that prefill, so the client's stream just pauses. Its pages are published
//! before they are freed, so readmission attaches whatever the cache still holds.
//!
//! Anti-thrash: a preemption holds admission until some live sequence has left (or none is live):
//! until then the batch that ran out of blocks is still growing, and readmitting would only
//! preempt again.

use super::{Phase, Scheduler};

impl Scheduler {
    /// Frees the sequence in `row` and puts it back at the head of the queue.
    pub(super) fn preempt(&mut self, row: usize) {
        let mut seq = self.release(row, true);
        seq.computed = 0;
        seq.phase = Phase::Waiting;
        seq.planned = false;
        seq.in_flight = 0;
        seq.preemptions += 1;
        self.stats.preemptions += 1;
        self.hold = Some(self.left);
        // Live sequences all arrived before waiting ones, so the victim (youngest live) goes first.
        self.waiting.push_front(seq);
    }
}
