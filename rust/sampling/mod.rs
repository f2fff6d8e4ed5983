//! Token selection from one row of logits, shared by every decode backend that returns logits
//! (the megakernel samples greedy rows on the GPU by the same argmax rule and hands every other
//! row back to this module):
//! - greedy when temperature is 0 or top_k is 1 (or so small that 1 / T is not finite): argmax,
//!   ties to the lowest token id;
//! - otherwise filter (top-k, then top-p over softmax(logits / T)), then Gumbel-max over what is
//!   left: argmax of logit / T + g, with g drawn by [`philox`] from (seed, index, token id), so a
//!   request's tokens depend on its seed and nothing else in the batch;
//! - log-probabilities come from log_softmax of the raw logits (before temperature and filters);
//! - a grammar's mask (`crate::grammar::TokenMask`), where a request has one, removes every token it
//!   does not allow before any of the above (the log-probabilities stay the model's own).
//!
//! NaN logits never win; a row without any finite logit is an error, not a silent token 0.

pub mod philox;

use std::cmp::Ordering;

use crate::grammar::TokenMask;

/// How to pick the token at generation step `index` (tokens generated before it) of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSpec {
    pub temperature: f32,
    /// 1.0 keeps everything.
    pub top_p: f32,
    /// 0 keeps everything.
    pub top_k: u32,
    pub seed: u64,
    pub index: u32,
    /// Alternatives to report besides the chosen token's log-probability (None: no logprobs).
    pub logprobs: Option<u32>,
}

impl SampleSpec {
    pub fn greedy(index: u32) -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, index, logprobs: None }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// One chosen token; `logprob` and `top` are filled only when the spec asks for logprobs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<f32>,
    /// The best `logprobs` tokens by log-probability, best first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl Sampled {
    pub fn token(token: u32) -> Self {
        Self { token, logprob: None, top: Vec::new() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    #[error("the logits row has no finite value")]
    NoFiniteLogit,
}

/// NaN sorts below everything and +inf becomes the largest finite value, so comparisons and the
/// softmax stay well defined.
fn key(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

/// Higher logit first, then lower id: the order of top-k and top-p, and of argmax ties (`argmax`
/// differs only in taking -0.0 and +0.0 as equal).
fn better(logits: &[f32], a: u32, b: u32) -> Ordering {
    key(logits[b as usize]).total_cmp(&key(logits[a as usize])).then(a.cmp(&b))
}

/// Rows at least this long are sampled on threads of their own when a call has several (a pass
/// over the real model's 262,144 logits costs far more than starting a thread; docs/PERF.md,
/// tuning decisions); shorter ones, the small models', stay on the caller's thread.
const PARALLEL_MIN_LOGITS: usize = 1 << 16;

/// One row to sample: its logits, its spec and the tokens its grammar allows (None: any).
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    pub logits: &'a [f32],
    pub spec: &'a SampleSpec,
    pub allowed: Option<&'a TokenMask>,
}

/// Samples every job into `out`, in order, as `Sampler::sample_allowed` would one after another:
/// several long rows are spread over threads (at most the machine's cores), each with a sampler
/// of `samplers` (grown as needed, kept for the next call).
pub fn sample_rows(samplers: &mut Vec<Sampler>, jobs: &[Job<'_>], out: &mut Vec<Result<Sampled, SampleError>>) {
    out.clear();
    let one = |s: &mut Sampler, j: &Job<'_>| s.sample_allowed(j.logits, j.spec, j.allowed);
    let long = jobs.iter().filter(|j| j.logits.len() >= PARALLEL_MIN_LOGITS).count();
    // The core count is read once (the standard library reads it from the OS on every call).
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads = if long < 2 {
        1
    } else {
        (*CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))).min(jobs.len())
    };
    if threads <= 1 {
        if samplers.is_empty() {
            samplers.push(Sampler::new());
        }
        out.extend(jobs.iter().map(|j| one(&mut samplers[0], j)));
        return;
    }
    if samplers.len() < threads {
        samplers.resize_with(threads, Sampler::new);
    }
    let per_thread = jobs.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .chunks(per_thread)
            .zip(samplers.iter_mut())
            .map(|(chunk, s)| scope.spawn(move || chunk.iter().map(|j| one(s, j)).collect::<Vec<_>>()))
            .collect();
        for h in handles {
            out.extend(h.join().expect("a sampling thread panicked"));
        }
    });
}

/// Reusable scratch, so sampling a row allocates nothing after warm-up.
#[derive(Debug, Default)]
pub struct Sampler {
    ids: Vec<u32>,
    masked: Vec<f32>,
}

impl Sampler {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn sample(&mut self, logits: &[f32], spec: &SampleSpec) -> Result<Sampled, SampleError> {
        self.sample_allowed(logits, spec, None)
    }

    /// `sample` among the tokens `allowed` allows (all where None).
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        spec: &SampleSpec,
        allowed: Option<&TokenMask>,
    ) -> Result<Sampled, SampleError> {
        let mut masked = std::mem::take(&mut self.masked);
        let choose_from = match allowed {
            None => logits,
            Some(mask) => {
                masked.clear();
                let kept = |(i, &x): (usize, &f32)| if mask.allows(i as u32) { x } else { f32::NEG_INFINITY };
                masked.extend(logits.iter().enumerate().map(kept));
                &masked[..]
            }
        };
        let token = if spec.is_greedy() { argmax(choose_from) } else { self.draw(choose_from, spec) };
        self.masked = masked;
        let mut out = Sampled::token(token?);
        if let Some(n) = spec.logprobs {
            self.logprobs(logits, n as usize, &mut out);
        }
        Ok(out)
    }

    /// Filter, then Gumbel-max over the survivors.
    fn draw(&mut self, logits: &[f32], spec: &SampleSpec) -> Result<u32, SampleError> {
        let Some(inv_t) = inverse_temperature(spec.temperature) else {
            return argmax(logits); // a temperature this small: greedy, its limit
        };
        if spec.top_k == 0 && spec.top_p >= 1.0 {
            return gumbel_draw(logits, inv_t, spec.seed, spec.index);
        }
        let ids = &mut self.ids;
        ids.clear();
        ids.extend(finite_ids(logits));
        if ids.is_empty() {
            return Err(SampleError::NoFiniteLogit);
        }
        let k = spec.top_k as usize;
        if k > 0 && k < ids.len() {
            ids.select_nth_unstable_by(k - 1, |&a, &b| better(logits, a, b));
            ids.truncate(k);
            ids.sort_unstable(); // id order again: the nucleus sums its total in it
        }
        if spec.top_p < 1.0 {
            nucleus(logits, ids, f64::from(spec.temperature), spec.top_p);
        }
        let first = *ids.iter().max_by(|&&x, &&y| better(logits, y, x)).expect("ids is not empty");
        Ok(gumbel_max(logits, ids.iter().copied(), first, inv_t, spec.seed, spec.index))
    }

    fn logprobs(&mut self, logits: &[f32], n: usize, out: &mut Sampled) {
        let top = logits.iter().map(|&x| f64::from(key(x))).fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|&x| (f64::from(key(x)) - top).exp()).sum();
        let lse = top + sum.ln();
        let lp = |i: u32| (f64::from(key(logits[i as usize])) - lse) as f32;
        out.logprob = Some(lp(out.token));
        let n = n.min(logits.len());
        if n == 0 {
            return;
        }
        let ids = &mut self.ids;
        ids.clear();
        ids.extend(0..logits.len() as u32);
        if n < ids.len() {
            ids.select_nth_unstable_by(n - 1, |&a, &b| better(logits, a, b));
            ids.truncate(n);
        }
        ids.sort_unstable_by(|&a, &b| better(logits, a, b));
        out.top.extend(ids.iter().map(|&i| (i, lp(i))));
    }
}

/// Keeps the fewest ids, best first (`better`), whose softmax mass at temperature `t` reaches
/// `top_p` of the mass of all of `ids` (given in id order, the order the total is summed in).
/// Only a growing head of the order is sorted (a selection, then a sort of the head), not every
/// id: a nucleus is usually a few hundred ids of 262,144.
fn nucleus(logits: &[f32], ids: &mut Vec<u32>, t: f64, top_p: f32) {
    let top = f64::from(ids.iter().map(|&i| key(logits[i as usize])).fold(f32::NEG_INFINITY, f32::max));
    let weight = |i: u32| ((f64::from(key(logits[i as usize])) - top) / t).exp();
    let goal = f64::from(top_p) * ids.iter().map(|&i| weight(i)).sum::<f64>();
    // ids[..sorted] holds the best ids in order, and `mass` their weight summed best first.
    let (mut sorted, mut mass) = (0, 0.0);
    let mut head = NUCLEUS_HEAD.min(ids.len());
    loop {
        let rest = &mut ids[sorted..];
        if head - sorted < rest.len() {
            rest.select_nth_unstable_by(head - sorted - 1, |&a, &b| better(logits, a, b));
        }
        ids[sorted..head].sort_unstable_by(|&a, &b| better(logits, a, b));
        for j in sorted..head {
            mass += weight(ids[j]);
            if mass >= goal {
                ids.truncate(j + 1);
                return;
            }
        }
        if head == ids.len() {
            return; // rounding kept the mass under the goal: every id stays
        }
        sorted = head;
        head = (head * 4).min(ids.len());
    }
}

/// The first head of the order `nucleus` sorts (docs/PERF.md, tuning decisions).
const NUCLEUS_HEAD: usize = 256;

/// The id among `ids` with the largest `key * inv_t` plus its Gumbel noise, the lower id on ties;
/// `first` is the one with the best key (its score is the likeliest best, which makes the skipping
/// below start early). The noise never exceeds `philox::gumbel_bound()`, so an id whose key
/// cannot reach the best score so far even with that much noise is passed over without drawing
/// it: on a real model's row most of the vocabulary lies that far below the top. The result is
/// the full maximum's, whatever is skipped.
fn gumbel_max(logits: &[f32], ids: impl Iterator<Item = u32>, first: u32, inv_t: f32, seed: u64, index: u32) -> u32 {
    let scaled = |i: u32| key(logits[i as usize]) * inv_t;
    let score = |i: u32| scaled(i) + philox::gumbel(seed, index, i);
    let bound = philox::gumbel_bound();
    let mut best = first;
    let mut best_score = score(best);
    for i in ids {
        if scaled(i) + bound < best_score {
            continue; // its score is below the best's: it cannot win, nor tie
        }
        let s = score(i);
        if s > best_score || (s == best_score && i < best) {
            best = i;
            best_score = s;
        }
    }
    best
}

/// The largest 1 / T a draw with noise takes: below T = 2^-32, logits 4e-9 apart already differ
/// by more than any noise, and scaled keys could overflow to -inf, where the host and the kernel
/// would settle ties differently.
const MAX_INVERSE_TEMPERATURE: f32 = 4_294_967_296.0;

/// 1 / T of a draw with noise, or None where temperature `t` (> 0) draws greedily: its inverse
/// is not finite in f32 or above `MAX_INVERSE_TEMPERATURE`. The one rule of the host sampler and
/// the kernel's rows (`engine::megakernel::kernel_draw`).
pub fn inverse_temperature(t: f32) -> Option<f32> {
    let inv_t = 1.0 / t;
    (inv_t.is_finite() && inv_t <= MAX_INVERSE_TEMPERATURE).then_some(inv_t)
}

/// Gumbel-max over every finite logit at temperature 1 / `inv_t` (finite, > 0), in one pass
/// without a list of ids: the draw of a spec with a temperature and no filter, and what the
/// megakernel's sample tasks compute for such a row (cuda/ops/step_sample.cuh), bit for bit.
pub fn gumbel_draw(logits: &[f32], inv_t: f32, seed: u64, index: u32) -> Result<u32, SampleError> {
    let first = argmax(logits)?;
    Ok(gumbel_max(logits, finite_ids(logits), first, inv_t, seed, index))
}

/// The ids whose logit can be drawn (not NaN, not -inf), in id order.
fn finite_ids(logits: &[f32]) -> impl Iterator<Item = u32> + '_ {
    (0..logits.len() as u32).filter(|&i| key(logits[i as usize]) > f32::NEG_INFINITY)
}

/// Index of the largest logit, lowest id on ties.
pub fn argmax(logits: &[f32]) -> Result<u32, SampleError> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        let x = key(x);
        if x > f32::NEG_INFINITY && best.is_none_or(|(_, b)| x > b) {
            best = Some((i as u32, x));
        }
    }
    best.map(|(i, _)| i).ok_or(SampleError::NoFiniteLogit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(temperature: f32, top_p: f32, top_k: u32, seed: u64, index: u32) -> SampleSpec {
        SampleSpec { temperature, top_p, top_k, seed, index, logprobs: None }
    }

    #[test]
    fn a_mask_limits_the_choice_but_not_the_logprobs() {
        let mut s = Sampler::new();
        let logits = [5.0, 1.0, 3.0, 4.0];
        let mask = TokenMask { words: vec![0b0110] }; // tokens 1 and 2
        let greedy = SampleSpec { logprobs: Some(1), ..SampleSpec::greedy(0) };
        let got = s.sample_allowed(&logits, &greedy, Some(&mask)).unwrap();
        assert_eq!(got.token, 2);
        let unmasked = s.sample(&logits, &greedy).unwrap();
        assert_eq!(unmasked.token, 0);
        assert_eq!(got.top, unmasked.top); // the model's own distribution
        for seed in 0..50 {
            let t = s.sample_allowed(&logits, &spec(2.0, 0.9, 0, seed, 3), Some(&mask)).unwrap().token;
            assert!(t == 1 || t == 2, "seed {seed} drew {t}");
        }
        let none = TokenMask { words: vec![0] };
        assert_eq!(s.sample_allowed(&logits, &greedy, Some(&none)), Err(SampleError::NoFiniteLogit));
    }

    #[test]
    fn greedy_takes_the_lowest_id_among_ties_and_skips_nan() {
        let mut s = Sampler::new();
        let logits = [1.0, 3.0, f32::NAN, 3.0, -2.0];
        assert_eq!(s.sample(&logits, &SampleSpec::greedy(0)).unwrap().token, 1);
        // top_k 1 is greedy whatever the temperature.
        assert_eq!(s.sample(&logits, &spec(5.0, 1.0, 1, 9, 0)).unwrap().token, 1);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), Err(SampleError::NoFiniteLogit));
        assert_eq!(s.sample(&[f32::NAN; 3], &spec(1.0, 1.0, 0, 1, 0)), Err(SampleError::NoFiniteLogit));
    }

    #[test]
    fn seeded_draws_are_pure_functions_of_seed_and_index() {
        let mut s = Sampler::new();
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32) / 50.0).collect();
        let draw = |s: &mut Sampler, seed, index| s.sample(&logits, &spec(1.0, 1.0, 0, seed, index)).unwrap().token;
        let a: Vec<u32> = (0..50).map(|i| draw(&mut s, 11, i)).collect();
        let b: Vec<u32> = (0..50).map(|i| draw(&mut s, 11, i)).collect();
        let c: Vec<u32> = (0..50).map(|i| draw(&mut s, 12, i)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Not stuck on the argmax: temperature 1 over a spread-out row varies.
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 10);
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // Two tokens with logits differing by ln 3: token 0 should win 3 times out of 4.
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new();
        let n = 20_000;
        let wins = (0..n).filter(|&i| s.sample(&logits, &spec(1.0, 1.0, 0, 5, i)).unwrap().token == 0).count();
        let p = wins as f64 / f64::from(n);
        assert!((p - 0.75).abs() < 0.015, "p = {p}");
        // Temperature 0.5 squares the odds: 9:1.
        let wins = (0..n).filter(|&i| s.sample(&logits, &spec(0.5, 1.0, 0, 5, i)).unwrap().token == 0).count();
        let p = wins as f64 / f64::from(n);
        assert!((p - 0.9).abs() < 0.015, "p = {p}");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [0.0, 2.0, 1.0, 2.0, -1.0, 1.5];
        let mut s = Sampler::new();
        let seen = |s: &mut Sampler, sp: SampleSpec| {
            let mut set: Vec<u32> =
                (0..2000).map(|i| s.sample(&logits, &SampleSpec { index: i, ..sp }).unwrap().token).collect();
            set.sort_unstable();
            set.dedup();
            set
        };
        // top-k 2: the two 2.0s (ids 1 and 3).
        assert_eq!(seen(&mut s, spec(1.0, 1.0, 2, 3, 0)), vec![1, 3]);
        // top-k 3: the 2.0s and 1.5 (id 5).
        assert_eq!(seen(&mut s, spec(1.0, 1.0, 3, 3, 0)), vec![1, 3, 5]);
        // A tiny top_p keeps only the best token (lowest id among ties).
        assert_eq!(seen(&mut s, spec(1.0, 0.01, 0, 3, 0)), vec![1]);
        // top_p just above the two best tokens' mass keeps exactly three.
        let e: Vec<f64> = logits.iter().map(|&x| f64::from(x).exp()).collect();
        let total: f64 = e.iter().sum();
        let p = ((e[1] + e[3]) / total + 1e-3) as f32;
        assert_eq!(seen(&mut s, spec(1.0, p, 0, 3, 0)), vec![1, 3, 5]);
        // -inf logits are never drawn.
        let masked = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        assert!((0..200).all(|i| s.sample(&masked, &spec(2.0, 1.0, 0, 1, i)).unwrap().token == 1));
    }

    #[test]
    fn logprobs_come_from_the_raw_logits() {
        let logits = [1.0f32, 2.0, 0.5, 2.0];
        let mut s = Sampler::new();
        let out = s.sample(&logits, &SampleSpec { logprobs: Some(3), ..spec(0.7, 0.5, 2, 1, 0) }).unwrap();
        let lse = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let lp = |i: usize| (f64::from(logits[i]) - lse) as f32;
        assert_eq!(out.logprob, Some(lp(out.token as usize)));
        assert_eq!(out.top, vec![(1, lp(1)), (3, lp(3)), (0, lp(0))]);
        // Zero alternatives: the chosen token's logprob only.
        let out = s.sample(&logits, &SampleSpec { logprobs: Some(0), ..SampleSpec::greedy(0) }).unwrap();
        assert_eq!((out.token, out.logprob, out.top.len()), (1, Some(lp(1)), 0));
        // More alternatives than the vocabulary: all of it.
        let out = s.sample(&logits, &SampleSpec { logprobs: Some(20), ..SampleSpec::greedy(0) }).unwrap();
        assert_eq!(out.top.len(), 4);
        let sum: f64 = out.top.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5);
    }

    /// The definition `draw` computes faster, written plainly: every finite id; top-k by a full
    /// sort; the nucleus by a full sort with the total summed in id order; the noisy maximum over
    /// every kept id.
    fn plain_draw(logits: &[f32], spec: &SampleSpec) -> Option<u32> {
        let mut ids: Vec<u32> =
            (0..logits.len() as u32).filter(|&i| key(logits[i as usize]) > f32::NEG_INFINITY).collect();
        ids.first()?;
        ids.sort_by(|&a, &b| better(logits, a, b));
        if spec.top_k > 0 {
            ids.truncate(spec.top_k as usize);
        }
        if spec.top_p < 1.0 {
            let t = f64::from(spec.temperature);
            let top = f64::from(key(logits[ids[0] as usize]));
            let weight = |i: u32| ((f64::from(key(logits[i as usize])) - top) / t).exp();
            let mut by_id = ids.clone();
            by_id.sort_unstable();
            let goal = f64::from(spec.top_p) * by_id.iter().map(|&i| weight(i)).sum::<f64>();
            let mut mass = 0.0;
            if let Some(j) = ids.iter().position(|&i| {
                mass += weight(i);
                mass >= goal
            }) {
                ids.truncate(j + 1);
            }
        }
        let inv_t = 1.0 / spec.temperature;
        let score = |i: u32| key(logits[i as usize]) * inv_t + philox::gumbel(spec.seed, spec.index, i);
        ids.iter().copied().max_by(|&a, &b| score(a).total_cmp(&score(b)).then(b.cmp(&a)))
    }

    fn row() -> impl Strategy<Value = Vec<f32>> {
        let value = prop_oneof![
            8 => -30.0f32..30.0,
            1 => Just(f32::NAN),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::INFINITY),
            1 => Just(2.5f32), // ties
        ];
        proptest::collection::vec(value, 1..2000)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn draws_equal_the_plain_definition(
            logits in row(),
            temperature in 0.05f32..4.0,
            top_p in prop_oneof![Just(1.0f32), 0.01f32..1.0],
            top_k in prop_oneof![Just(0u32), 1u32..300],
            seed in 0u64..1000,
            index in 0u32..1000,
        ) {
            let spec = spec(temperature, top_p, top_k, seed, index);
            let want = plain_draw(&logits, &spec);
            let got = Sampler::new().sample(&logits, &spec).ok().map(|s| s.token);
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn the_gumbel_bound_holds_for_every_draw_and_is_tight() {
        // Every distinct draw: the uniform takes the top 23 bits.
        let bound = philox::gumbel_bound();
        let mut most = f32::NEG_INFINITY;
        for top in 0..(1u32 << 23) {
            let g = philox::gumbel_of_bits(top << 9);
            assert!(g <= bound, "bits {:#x}: {g} > {bound}", top << 9);
            most = most.max(g);
        }
        assert!(bound - most < 0.01 && bound > 16.0, "{bound} against {most}");
    }

    #[test]
    fn rows_sampled_together_equal_rows_sampled_one_by_one() {
        // Long enough rows, several of them: the threaded path (on a machine with 2+ cores).
        let n = PARALLEL_MIN_LOGITS + 7;
        let rows: Vec<Vec<f32>> =
            (0..5u32).map(|r| (0..n as u32).map(|i| ((i * (37 + r) % 1009) as f32) / 97.0 - 3.0).collect()).collect();
        let mask = TokenMask { words: (0..n.div_ceil(32)).map(|w| if w % 3 == 0 { u32::MAX } else { 0 }).collect() };
        let specs = [
            SampleSpec::greedy(0),
            SampleSpec { logprobs: Some(3), ..spec(0.8, 0.9, 0, 7, 2) },
            spec(1.0, 1.0, 0, 8, 3),
            spec(0.6, 1.0, 40, 9, 4),
            spec(1.3, 0.5, 0, 10, 5),
        ];
        let masks = [None, None, Some(&mask), None, Some(&mask)];
        let jobs: Vec<Job<'_>> = (0..5).map(|r| Job { logits: &rows[r], spec: &specs[r], allowed: masks[r] }).collect();
        let (mut samplers, mut together) = (Vec::new(), Vec::new());
        sample_rows(&mut samplers, &jobs, &mut together);
        let one_by_one: Vec<_> =
            jobs.iter().map(|j| Sampler::new().sample_allowed(j.logits, j.spec, j.allowed)).collect();
        assert_eq!(together, one_by_one);
        assert!(together.iter().all(Result::is_ok));
        if std::thread::available_parallelism().map_or(1, |c| c.get()) > 1 {
            assert!(samplers.len() > 1, "the rows were not spread over threads");
        }
    }

    #[test]
    fn a_temperature_too_small_for_f32_or_below_2_to_the_minus_32_is_greedy() {
        let logits = [0.0f32, 3.0, -1.0, 3.0, 40.0, 39.5];
        for t in [1e-40f32, f32::MIN_POSITIVE / 4.0, 1e-12, 2.2e-10] {
            assert!(inverse_temperature(t).is_none(), "{t}");
            for (top_p, top_k) in [(0.9, 3), (1.0, 0)] {
                assert_eq!(Sampler::new().sample(&logits, &spec(t, top_p, top_k, 5, 1)).unwrap().token, 4);
            }
        }
        assert_eq!(inverse_temperature(2.4e-10), Some(1.0 / 2.4e-10));
    }
}
