//! Speculative decoding's host side: drafts taken from the sequence's own text (or another live
//! sequence's), how many to try, and which the step accepted.
//!
//! A step verifies a sequence's draft `d[0..k]` as k + 1 rows at consecutive positions: row i
//! sees the sequence plus `d[..i]` and draws its token exactly as a plain decode step would draw
//! the sequence's token at that generation index (`crate::sampling`: argmax when greedy, else
//! Gumbel-max with noise keyed by (seed, index, token id)). The step accepts the longest prefix of
//! the draft that matches the drawn tokens, and the sequence gains `drawn[..=accepted]`.
//!
//! Because the draws are the plain step's own, the tokens are exactly those of decoding without
//! a draft, for greedy and sampled requests alike, seed for seed. For a sampled row this is the
//! standard rule for a deterministic draft: the draw equals `d[i]` with probability p(d[i]) (the
//! acceptance), and given that it does not, it is distributed as p with `d[i]` removed and
//! renormalised (the residual). Rejected rows' KV is simply overwritten by later steps: a
//! sequence's block table grows only by what was accepted.
//!
//! - [`draft`]: an n-gram index over a sequence's prompt and output, proposing what followed the
//!   latest earlier occurrence of its longest matching suffix;
//! - [`length`]: the draft length of each sequence, adapted to its recent acceptance (none while
//!   drafts keep failing), and a launch's spare rows shared among the batch;
//! - [`verify`]: the acceptance of one sequence's rows.

pub mod draft;
pub mod length;
pub mod verify;

pub use draft::NgramIndex;
pub use length::{share_rows, DraftLength};
pub use verify::accepted;

/// One sequence's drafting: its text's index and its draft length, told each step's outcome.
#[derive(Debug, Clone, Default)]
pub struct Speculator {
    index: NgramIndex,
    length: DraftLength,
}

impl Speculator {
    /// Over a prompt (the text drafts are copied from, until the output adds to it).
    pub fn new(prompt: &[u32]) -> Self {
        Self { index: NgramIndex::with_tokens(prompt), length: DraftLength::default() }
    }

    /// The draft for the next step: at most `most` tokens (the rows the launch leaves this
    /// sequence), fewer where its length or the texts say so, none while it is paused. It is
    /// copied from the sequence's own text or, where one of `others` (the live sequences'
    /// indices; its own among them or not) holds a longer match of its ending, from that text:
    /// sequences that share text (samples of one prompt, agents editing one file) draft from
    /// each other.
    pub fn draft<'a>(&'a self, most: usize, others: &[&'a NgramIndex]) -> &'a [u32] {
        let k = self.length.get().min(most);
        let own = self.index.draft(k);
        let text = self.index.tokens();
        let others = others.iter().filter(|other| !std::ptr::eq(**other, &self.index));
        others.map(|other| other.draft_for(text, k)).fold(own, |best, d| if d.0 > best.0 { d } else { best }).1
    }

    /// Whether the next step would verify a draft: not paused, and the texts offer one.
    pub fn would_draft(&self, others: &[&NgramIndex]) -> bool {
        !self.draft(1, others).is_empty()
    }

    /// The sequence's text, indexed.
    pub fn index(&self) -> &NgramIndex {
        &self.index
    }

    /// After a step that verified `drafted` draft tokens: `gained` is what the sequence gained
    /// (the accepted draft and the row's own token past it).
    pub fn advance(&mut self, drafted: usize, gained: &[u32]) {
        assert!(!gained.is_empty() && gained.len() <= drafted + 1, "a step gains 1 to drafted + 1 tokens");
        self.length.observe(drafted, gained.len() - 1);
        self.index.extend(gained);
    }
}
