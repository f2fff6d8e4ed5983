//! Speculative decoding's host side: drafts taken from the sequence's own text, how many to try,
//! and which the step accepted.
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
