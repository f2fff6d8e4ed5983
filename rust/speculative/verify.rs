//! The acceptance of one sequence's verification rows (the rule: the module doc of
//! `crate::speculative`).

/// How many of `draft` a step accepted: the longest prefix that matches `drawn`, the token each
/// of its `draft.len() + 1` rows drew (row i after `draft[..i]`). The sequence gains
/// `drawn[..=accepted]`: the accepted draft and the first row's own token past it.
pub fn accepted(draft: &[u32], drawn: &[u32]) -> usize {
    assert_eq!(drawn.len(), draft.len() + 1, "one drawn token per verification row");
    draft.iter().zip(drawn).take_while(|(d, t)| d == t).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{SampleSpec, Sampler};
    use crate::speculative::{DraftLength, NgramIndex};
    use proptest::prelude::*;

    const VOCAB: u32 = 24;

    /// A deterministic model of the last two tokens, peaked enough that its text repeats itself
    /// (drafts get accepted) and flat enough that a temperature changes what it draws.
    fn logits(context: &[u32]) -> Vec<f32> {
        let (a, b) = match context {
            [.., a, b] => (*a, *b),
            _ => (0, 0),
        };
        (0..VOCAB)
            .map(|v| {
                let h = (a.wrapping_mul(31) ^ b.wrapping_mul(17) ^ v.wrapping_mul(7)).wrapping_mul(2_654_435_761);
                (h >> 24) as f32 / 64.0
            })
            .collect()
    }

    fn spec(temperature: f32, seed: u64, index: usize) -> SampleSpec {
        SampleSpec { temperature, top_p: 1.0, top_k: 0, seed, index: index as u32, logprobs: None }
    }

    fn plain(prompt: &[u32], n: usize, temperature: f32, seed: u64) -> Vec<u32> {
        let mut sampler = Sampler::new();
        let mut context = prompt.to_vec();
        for i in 0..n {
            let token = sampler.sample(&logits(&context), &spec(temperature, seed, i)).unwrap().token;
            context.push(token);
        }
        context.split_off(prompt.len())
    }

    /// Decoding with drafts from the sequence's own text: (the tokens, the steps it took).
    fn speculative(prompt: &[u32], n: usize, temperature: f32, seed: u64) -> (Vec<u32>, usize) {
        let mut sampler = Sampler::new();
        let mut index = NgramIndex::with_tokens(prompt);
        let mut length = DraftLength::default();
        let mut out = Vec::new();
        let mut steps = 0;
        while out.len() < n {
            let k = length.get().min(n - out.len() - 1);
            let draft = index.draft(k).1.to_vec();
            let drawn: Vec<u32> = (0..=draft.len())
                .map(|i| {
                    let context = [prompt, &out[..], &draft[..i]].concat();
                    sampler.sample(&logits(&context), &spec(temperature, seed, out.len() + i)).unwrap().token
                })
                .collect();
            let a = accepted(&draft, &drawn);
            length.observe(draft.len(), a);
            index.extend(&drawn[..=a]);
            out.extend_from_slice(&drawn[..=a]);
            steps += 1;
        }
        (out, steps)
    }

    #[test]
    fn accepts_the_longest_matching_prefix() {
        assert_eq!(accepted(&[], &[7]), 0);
        assert_eq!(accepted(&[1, 2, 3], &[1, 2, 3, 4]), 3);
        assert_eq!(accepted(&[1, 2, 3], &[1, 5, 3, 4]), 1);
        assert_eq!(accepted(&[1, 2, 3], &[9, 2, 3, 4]), 0);
    }

    #[test]
    fn a_repetitive_text_gains_several_tokens_a_step() {
        let (out, steps) = speculative(&[1, 2, 3], 200, 0.0, 0);
        assert_eq!(out, plain(&[1, 2, 3], 200, 0.0, 0));
        assert!(steps * 3 <= 200, "{steps} steps for 200 tokens");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn the_tokens_are_those_of_decoding_without_drafts(
            prompt in prop::collection::vec(0..VOCAB, 1..40),
            temperature in prop::sample::select(vec![0.0f32, 0.5, 1.0, 2.0]),
            seed in any::<u64>(),
        ) {
            let (out, steps) = speculative(&prompt, 60, temperature, seed);
            prop_assert_eq!(out, plain(&prompt, 60, temperature, seed));
            prop_assert!(steps <= 60);
        }
    }

    /// A draft token is drawn with its probability under the row's distribution, and a row that
    /// does not draw it draws from the rest in proportion (the rejection rule's residual): counted
    /// over 20,000 seeds, each frequency within five standard deviations of its probability.
    #[test]
    fn a_draft_is_accepted_with_its_probability_and_rejected_to_the_residual() {
        let row = [1.5f32, 0.2, -0.7, 2.0, 0.0, -2.0];
        let temperature = 0.8;
        let weights: Vec<f64> = row.iter().map(|&x| (f64::from(x) / f64::from(temperature)).exp()).collect();
        let p: Vec<f64> = weights.iter().map(|w| w / weights.iter().sum::<f64>()).collect();
        let (draft, seeds) = (0usize, 20_000u64);
        let mut sampler = Sampler::new();
        let mut counts = [0u64; 6];
        for seed in 0..seeds {
            counts[sampler.sample(&row, &spec(temperature, seed, 5)).unwrap().token as usize] += 1;
        }
        let within = |hits: u64, trials: u64, prob: f64| {
            let sd = (prob * (1.0 - prob) / trials as f64).sqrt();
            (hits as f64 / trials as f64 - prob).abs() <= 5.0 * sd
        };
        assert!(within(counts[draft], seeds, p[draft]), "accepted {} of {seeds}, p {}", counts[draft], p[draft]);
        let rejected = seeds - counts[draft];
        for v in (0..6).filter(|&v| v != draft) {
            let residual = p[v] / (1.0 - p[draft]);
            assert!(
                within(counts[v], rejected, residual),
                "token {v}: {} of {rejected}, residual {residual}",
                counts[v]
            );
        }
    }
}
