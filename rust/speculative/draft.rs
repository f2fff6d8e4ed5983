//! Drafts from a text (prompt lookup): the tokens that followed the latest earlier occurrence of
//! the longest n-gram that ends a sequence, trying n from `MAX_NGRAM` down to `MIN_NGRAM`, in the
//! sequence's own text or another's. The index is updated as tokens arrive, so a draft costs a few
//! hash lookups.

use std::collections::HashMap;

/// The shortest suffix matched: after a single token, too many continuations are equally likely.
pub const MIN_NGRAM: usize = 2;
/// The longest suffix matched: each length costs one index entry per token.
pub const MAX_NGRAM: usize = 5;

/// A sequence's tokens and, for each n-gram length, where each n-gram last occurred.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    tokens: Vec<u32>,
    /// Per length (from `MIN_NGRAM`): an n-gram's key to the position just after its latest
    /// occurrence that has a token after it.
    after: Vec<HashMap<u64, u32>>,
}

impl Default for NgramIndex {
    fn default() -> Self {
        Self { tokens: Vec::new(), after: vec![HashMap::new(); MAX_NGRAM - MIN_NGRAM + 1] }
    }
}

impl NgramIndex {
    pub fn with_tokens(tokens: &[u32]) -> Self {
        let mut index = Self::default();
        index.extend(tokens);
        index
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends tokens (the prompt, then each step's accepted ones).
    pub fn extend(&mut self, new: &[u32]) {
        for &token in new {
            // The n-grams ending just before this token now have a continuation: this position.
            let at = self.tokens.len();
            for n in MIN_NGRAM..=MAX_NGRAM.min(at) {
                self.after[n - MIN_NGRAM].insert(key_of(&self.tokens[at - n..at]), at as u32);
            }
            self.tokens.push(token);
        }
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram ending
    /// the sequence, with that n; (0, nothing) where no n-gram of `MIN_NGRAM` or more recurs.
    pub fn draft(&self, k: usize) -> (usize, &[u32]) {
        self.draft_for(&self.tokens, k)
    }

    /// Up to `k` tokens that followed, in this index's text, the latest occurrence of the longest
    /// n-gram ending `text` (another sequence's, or this one's own), with that n; (0, nothing)
    /// where none of `MIN_NGRAM` or more occurs here with a token after it.
    pub fn draft_for(&self, text: &[u32], k: usize) -> (usize, &[u32]) {
        let len = self.tokens.len();
        if k > 0 {
            for n in (MIN_NGRAM..=MAX_NGRAM.min(text.len())).rev() {
                let suffix = &text[text.len() - n..];
                if let Some(&at) = self.after[n - MIN_NGRAM].get(&key_of(suffix)) {
                    let at = at as usize;
                    if self.tokens[at - n..at] == *suffix {
                        // (a key shared by two n-grams is a miss at this length, never a wrong match)
                        return (n, &self.tokens[at..(at + k).min(len)]);
                    }
                }
            }
        }
        (0, &[])
    }
}

/// FNV-1a over the token ids.
fn key_of(gram: &[u32]) -> u64 {
    gram.iter().fold(0xcbf2_9ce4_8422_2325, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, by search: the latest start of the longest recurring suffix with a token
    /// after it.
    fn by_search(tokens: &[u32], k: usize) -> (usize, Vec<u32>) {
        let len = tokens.len();
        if k == 0 {
            return (0, Vec::new());
        }
        for n in (MIN_NGRAM..=MAX_NGRAM.min(len)).rev() {
            let suffix = &tokens[len - n..];
            if let Some(start) = (0..len - n).rev().find(|&s| tokens[s..s + n] == *suffix) {
                let at = start + n;
                return (n, tokens[at..(at + k).min(len)].to_vec());
            }
        }
        (0, Vec::new())
    }

    #[test]
    fn drafts_what_followed_the_longest_latest_match() {
        // "a b c d x a b c d y a b c": "a b c" (and "b c") recur; the latest "a b c" is followed by "d y".
        let [a, b, c, d, x, y] = [1, 2, 3, 4, 5, 6];
        let index = NgramIndex::with_tokens(&[a, b, c, d, x, a, b, c, d, y, a, b, c]);
        assert_eq!(index.draft(2), (3, &[d, y][..]));
        assert_eq!(index.draft(8), (3, &[d, y, a, b, c][..]));
        assert_eq!(index.draft(0), (0, &[][..]));
        // A suffix seen before only as itself, or a single repeated token, drafts nothing.
        assert_eq!(NgramIndex::with_tokens(&[a, b, c, a]).draft(4), (0, &[][..]));
        assert_eq!(NgramIndex::with_tokens(&[a, b, a, b]).draft(4), (2, &[a, b][..]));
    }

    #[test]
    fn a_longer_match_wins_over_a_later_shorter_one() {
        // "x b c" ends the sequence; "x b c" occurred first (then "q"), "b c" later (then "r").
        let [x, b, c, q, r, z] = [1, 2, 3, 4, 5, 6];
        let index = NgramIndex::with_tokens(&[x, b, c, q, z, b, c, r, x, b, c]);
        assert_eq!(index.draft(1), (3, &[q][..]));
    }

    proptest! {
        #[test]
        fn drafts_as_the_search_does_whatever_the_order_of_arrival(
            tokens in prop::collection::vec(0u32..4, 0..80),
            cut in 0usize..80,
            k in 0usize..10,
        ) {
            let cut = cut.min(tokens.len());
            let mut index = NgramIndex::with_tokens(&tokens[..cut]);
            index.extend(&tokens[cut..]);
            let (n, draft) = index.draft(k);
            prop_assert_eq!((n, draft.to_vec()), by_search(&tokens, k));
        }

        #[test]
        fn drafts_for_another_text_as_the_search_over_both_does(
            text in prop::collection::vec(0u32..4, 0..40),
            other in prop::collection::vec(0u32..4, 0..40),
            k in 0usize..10,
        ) {
            // The other text followed by the query's: a match whose continuation lies in the other
            // text is what the search over the two finds, where the longest such n-gram recurs there.
            let index = NgramIndex::with_tokens(&other);
            let (n, draft) = index.draft_for(&text, k);
            let len = other.len();
            let want = if k == 0 {
                (0, Vec::new())
            } else {
                (MIN_NGRAM..=MAX_NGRAM.min(text.len()))
                    .rev()
                    .find_map(|n| {
                        let suffix = &text[text.len() - n..];
                        (0..len.saturating_sub(n)).rev().find(|&s| other[s..s + n] == *suffix).map(|s| {
                            let at = s + n;
                            (n, other[at..(at + k).min(len)].to_vec())
                        })
                    })
                    .unwrap_or((0, Vec::new()))
            };
            prop_assert_eq!((n, draft.to_vec()), want);
        }
    }
}
