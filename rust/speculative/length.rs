//! How many draft tokens a sequence verifies in a step: grown while drafts are accepted whole,
//! cut to one past what was accepted when one fails, and none for a while after drafts keep
//! failing, so that a sequence with nothing to copy decodes as it would without drafts.

/// The most draft tokens one sequence verifies in a step.
pub const MAX_DRAFT: usize = 8;
/// A new sequence's draft length.
pub const FIRST_DRAFT: usize = 4;
/// Steps in a row whose draft had nothing accepted after which a sequence stops drafting.
pub const MISSES_TO_PAUSE: u32 = 3;
/// Steps a paused sequence decodes without a draft before it tries one token again; doubled for
/// every pause in a row (up to `PAUSE_STEPS << MAX_BACKOFF`) until a draft token is accepted, so
/// that text with nothing to copy costs ever fewer verification rows.
pub const PAUSE_STEPS: u32 = 16;
pub const MAX_BACKOFF: u32 = 4;

/// One sequence's draft length, told every step's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftLength {
    next: usize,
    misses: u32,
    paused: u32,
    /// Pauses since a draft token was last accepted.
    pauses: u32,
}

impl Default for DraftLength {
    fn default() -> Self {
        Self { next: FIRST_DRAFT, misses: 0, paused: 0, pauses: 0 }
    }
}

impl DraftLength {
    /// The most draft tokens to try in the next step (0 while paused).
    pub fn get(&self) -> usize {
        if self.paused > 0 {
            0
        } else {
            self.next
        }
    }

    /// Once per step of the sequence, drafted or not: `drafted` tokens tried, `accepted` of them.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        debug_assert!(accepted <= drafted);
        if drafted == 0 {
            self.paused = self.paused.saturating_sub(1);
        } else if accepted == drafted {
            // (a draft shorter than asked, the text having no more to copy, leaves the length as it was)
            self.next = self.next.max(drafted + 1).min(MAX_DRAFT);
            self.misses = 0;
            self.pauses = 0;
        } else {
            self.next = accepted + 1;
            self.misses = if accepted == 0 { self.misses + 1 } else { 0 };
            if accepted > 0 {
                self.pauses = 0;
            }
            if self.misses >= MISSES_TO_PAUSE {
                let paused = PAUSE_STEPS << self.pauses.min(MAX_BACKOFF);
                *self = Self { next: 1, misses: 0, paused, pauses: self.pauses + 1 };
            }
        }
    }
}

/// A launch's `spare` rows (those its batch's own rows leave) shared among sequences that want
/// `wants[i]` draft rows each: one row per sequence in turn, so that none gets two more than
/// another that still wants one.
pub fn share_rows(wants: &[usize], spare: usize) -> Vec<usize> {
    let mut got = vec![0; wants.len()];
    let mut left = spare.min(wants.iter().sum());
    while left > 0 {
        for (g, &want) in got.iter_mut().zip(wants) {
            if left > 0 && *g < want {
                *g += 1;
                left -= 1;
            }
        }
    }
    got
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grows_while_whole_drafts_are_accepted_and_cuts_to_one_past_the_accepted() {
        let mut length = DraftLength::default();
        for want in FIRST_DRAFT..MAX_DRAFT {
            assert_eq!(length.get(), want);
            length.observe(want, want);
        }
        assert_eq!(length.get(), MAX_DRAFT);
        length.observe(MAX_DRAFT, MAX_DRAFT);
        assert_eq!(length.get(), MAX_DRAFT, "never past MAX_DRAFT");
        length.observe(2, 2); // (the text had only two tokens to copy)
        assert_eq!(length.get(), MAX_DRAFT);
        length.observe(MAX_DRAFT, 2);
        assert_eq!(length.get(), 3);
    }

    #[test]
    fn drafts_that_keep_failing_cost_few_rows() {
        // Every draft rejected: after MISSES_TO_PAUSE misses, PAUSE_STEPS steps without a draft,
        // then one token tried, and so on.
        let mut length = DraftLength::default();
        let steps = 5000;
        let mut rows = 0;
        let mut trace = Vec::new();
        for _ in 0..steps {
            let k = length.get();
            rows += k;
            trace.push(k);
            length.observe(k, 0);
        }
        assert_eq!(trace[..MISSES_TO_PAUSE as usize], [FIRST_DRAFT, 1, 1]);
        assert!(trace[3..3 + PAUSE_STEPS as usize].iter().all(|&k| k == 0));
        // The pauses double: 16, 32, 64, 128, 256, 256, ... steps between cycles of three misses.
        let at = 3 + PAUSE_STEPS as usize;
        assert_eq!(trace[at..at + 3], [1, 1, 1]);
        assert!(trace[at + 3..at + 3 + 2 * PAUSE_STEPS as usize].iter().all(|&k| k == 0));
        let cycles = MAX_BACKOFF as usize + 2 + steps / ((PAUSE_STEPS as usize) << MAX_BACKOFF);
        assert!(rows <= FIRST_DRAFT + cycles * MISSES_TO_PAUSE as usize, "{rows} draft rows");
        assert!(rows * 50 < steps, "{rows} draft rows over {steps} steps");
        // One accepted token ends the run of misses.
        let mut length = DraftLength::default();
        length.observe(4, 0);
        length.observe(1, 0);
        length.observe(1, 1);
        length.observe(2, 0);
        assert!(length.get() > 0);
    }

    proptest! {
        #[test]
        fn rows_are_shared_fairly_within_the_budget(
            wants in prop::collection::vec(0usize..10, 0..20),
            spare in 0usize..100,
        ) {
            let got = share_rows(&wants, spare);
            prop_assert_eq!(got.iter().sum::<usize>(), spare.min(wants.iter().sum()));
            prop_assert!(got.iter().zip(&wants).all(|(g, w)| g <= w));
            // Every sequence left short holds at least as many rows as any other, less one.
            let most = got.iter().copied().max().unwrap_or(0);
            for (g, w) in got.iter().zip(&wants) {
                prop_assert!(g == w || g + 1 >= most, "{:?} of {:?}", got, wants);
            }
        }
    }
}
