//! The decode half of the megakernel backend: one kernel launch per step of at most
//! `max_rows` rows (the engine's rows are split into consecutive launches when there are more),
//! then one `Sampled` per row.
//!
//! Sampling: the kernel draws a row's token itself when its spec is greedy (argmax, ties to the
//! lowest id) or a temperature alone (Gumbel-max with the same Philox noise and logarithm as
//! `Sampler`, bit for bit: `kernel_draw`), which is what `Sampler` does for that spec. Rows that ask
//! for top-k / top-p or logprobs get their fp32 logits copied back and go through the shared
//! `Sampler`. A row under a grammar does too, unless `kernel_masks` is on: then a row the kernel
//! can draw gets its mask uploaded and the kernel draws among the tokens it allows (what `Sampler`
//! does with the mask), without its logits coming back. Either way a seed gives the same tokens on
//! every backend.

use super::backend::{
    Backend, BackendError, DecodeInput, LaunchTimes, PrefillInput, PrefillResult, QueuedDecoder, UnseenRows,
};
use crate::gpu::step::{GpuLauncher, StepRows};
use crate::gpu::MkRowSample;
use crate::grammar::TokenMask;
use crate::sampling::{inverse_temperature, sample_rows, Job, SampleError, SampleSpec, Sampled, Sampler};

/// Runs one launch (the GPU's `GpuLauncher`; a mock in tests).
pub trait StepLauncher {
    fn max_rows(&self) -> usize;
    fn vocab(&self) -> usize;
    /// `sampled` gets every row's greedy token, `logits` the logits of each wanted row in order.
    fn launch(
        &mut self,
        step: &StepRows<'_>,
        sampled: &mut Vec<u32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), BackendError>;

    /// Queues one launch behind those before it and returns once it is launched: a row with
    /// `previous[i] = Some(j)` takes the token the launch queued just before samples for its row
    /// j (copied on the device). Greedy tokens only, no logits; `collect` returns them.
    fn queue(&mut self, step: &StepRows<'_>, previous: &[Option<usize>]) -> Result<(), BackendError>;

    /// Waits for the oldest queued launch; `sampled` gets its rows' tokens.
    fn collect(&mut self, sampled: &mut Vec<u32>) -> Result<(), BackendError>;

    /// The masks of the launch queued last with `late_masks`, one per row (None for a masked row:
    /// every token; read only for its masked rows), once the launch before it has been collected.
    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError>;

    /// Where the launches' host time went so far.
    fn launch_times(&self) -> LaunchTimes {
        LaunchTimes::default()
    }
}

impl StepLauncher for GpuLauncher {
    fn max_rows(&self) -> usize {
        GpuLauncher::max_rows(self)
    }

    fn vocab(&self) -> usize {
        GpuLauncher::vocab(self)
    }

    fn launch(
        &mut self,
        step: &StepRows<'_>,
        sampled: &mut Vec<u32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.run(step, sampled, logits).map_err(|e| BackendError(format!("megakernel step: {e}")))
    }

    fn queue(&mut self, step: &StepRows<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        GpuLauncher::queue(self, step, previous).map_err(|e| BackendError(format!("megakernel step: {e}")))
    }

    fn collect(&mut self, sampled: &mut Vec<u32>) -> Result<(), BackendError> {
        GpuLauncher::collect(self, sampled).map_err(|e| BackendError(format!("megakernel step: {e}")))
    }

    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        GpuLauncher::deliver_masks(self, masks).map_err(|e| BackendError(format!("megakernel step: {e}")))
    }

    fn launch_times(&self) -> LaunchTimes {
        GpuLauncher::launch_times(self)
    }
}

/// How the kernel draws a row's token, where it can: greedy, or a temperature with nothing else
/// (no top-k or top-p filter). None: the host sampler must (and so needs the row's logits).
pub fn kernel_draw(spec: &SampleSpec) -> Option<MkRowSample> {
    if spec.logprobs.is_some() {
        return None;
    }
    if spec.is_greedy() {
        return Some(MkRowSample::default());
    }
    // `Sampler::draw`'s rule: greedy where the temperature is too small for noise.
    match (spec.top_k == 0 && spec.top_p >= 1.0, inverse_temperature(spec.temperature)) {
        (false, _) => None,
        (true, None) => Some(MkRowSample::default()),
        (true, Some(inv_t)) => Some(MkRowSample::draw(inv_t, spec.seed, spec.index)),
    }
}

/// Whether a row's token needs the host sampler (and so its logits).
pub fn needs_logits(spec: &SampleSpec) -> bool {
    kernel_draw(spec).is_none()
}

/// The kernel's greedy token of `row`: `vocab` says the kernel found no finite logit.
fn kernel_token(row: usize, token: u32, vocab: usize) -> Result<Sampled, BackendError> {
    match (token as usize) < vocab {
        true => Ok(Sampled::token(token)),
        false => Err(BackendError(format!("row {row}: the logits row has no finite value"))),
    }
}

pub struct MegakernelDecoder<L> {
    pub launcher: L,
    /// The host sampler's scratch, one per thread `sample_rows` uses.
    samplers: Vec<Sampler>,
    host_sampled: Vec<Result<Sampled, SampleError>>,
    want: Vec<bool>,
    /// Each row's `kernel_draw` (greedy for the rows the host samples).
    draws: Vec<MkRowSample>,
    /// Rows under a grammar that the kernel can draw are drawn there, among their mask's tokens
    /// (uploaded before the launch), instead of on the host from their logits. The launch then
    /// waits for the masks, which the host path computes while the step runs; that costs less than
    /// the logits' copy and the host draw it saves (docs/PERF.md, tuning decisions). Its tokens
    /// equal the host path's. Off here; `mk.engine.engine.Engine` turns it on by default.
    pub kernel_masks: bool,
    /// With `kernel_masks`: a step with rows under a grammar is queued too, its masks delivered
    /// while it runs (`deliver_masks`; the kernel's sample tasks wait for them), so that the masks
    /// of step n + 1 are computed while it runs instead of between the steps. Off here;
    /// `mk.engine.engine.Engine` turns it on by default (docs/PERF.md, tuning decisions).
    pub late_masks: bool,
    sampled: Vec<u32>,
    logits: Vec<f32>,
    /// The rows of each queued step, oldest first.
    queued: std::collections::VecDeque<Vec<usize>>,
}

impl<L: StepLauncher> MegakernelDecoder<L> {
    pub fn new(launcher: L) -> Self {
        Self {
            launcher,
            samplers: Vec::new(),
            host_sampled: Vec::new(),
            want: Vec::new(),
            draws: Vec::new(),
            kernel_masks: false,
            late_masks: false,
            sampled: Vec::new(),
            logits: Vec::new(),
            queued: std::collections::VecDeque::new(),
        }
    }

    /// Whether `queue` takes this step: one launch's rows at most, every token drawn on the GPU
    /// (`kernel_draw`), and no row under a grammar unless their masks may come late.
    pub fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        let late = self.kernel_masks && self.late_masks;
        input.len() <= self.launcher.max_rows()
            && (0..input.len()).all(|i| !needs_logits(&input.specs[i]) && (late || !input.is_constrained(i)))
    }

    /// The masks of the step queued last with rows under a grammar (`QueuedDecoder::deliver_masks`; a
    /// masked row whose request has left gets None: the launcher allows it every token).
    pub fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        self.launcher.deliver_masks(masks)
    }

    /// Queues the step as one launch (`QueuedDecoder::queue`).
    pub fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        if !self.can_queue(input) {
            return Err(BackendError("this step cannot be queued".into()));
        }
        self.want.clear();
        self.want.resize(input.len(), false);
        self.draws.clear();
        for (i, spec) in input.specs.iter().enumerate() {
            let draw = kernel_draw(spec).expect("can_queue checked it");
            self.draws.push(if input.is_constrained(i) { draw.with_mask() } else { draw });
        }
        let late_masks = (0..input.len()).any(|i| input.is_constrained(i));
        let step = StepRows {
            rows: input.rows,
            tokens: input.tokens,
            positions: input.positions,
            table: input.table,
            want_logits: &self.want,
            samples: &self.draws,
            masks: &[],
            late_masks,
            launch: 0,
        };
        self.launcher.queue(&step, previous)?;
        self.queued.push_back(input.rows.to_vec());
        Ok(())
    }

    /// The oldest queued step's tokens (`QueuedDecoder::collect`).
    pub fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        let rows = self.queued.pop_front().ok_or_else(|| BackendError("no step is queued".into()))?;
        self.sampled.clear();
        self.launcher.collect(&mut self.sampled)?;
        if self.sampled.len() != rows.len() {
            return Err(BackendError("the launch returned the wrong number of tokens".into()));
        }
        let vocab = self.launcher.vocab();
        for (&row, &t) in rows.iter().zip(&self.sampled) {
            out.push(kernel_token(row, t, vocab)?);
        }
        Ok(())
    }

    /// Where the launches' host time went so far.
    pub fn launch_times(&self) -> LaunchTimes {
        self.launcher.launch_times()
    }

    /// One decode step of `input`'s rows: launches of at most `max_rows` consecutive rows each.
    pub fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        let per_launch = self.launcher.max_rows().max(1);
        let vocab = self.launcher.vocab();
        for start in (0..input.len()).step_by(per_launch) {
            let r = start..(start + per_launch).min(input.len());
            let specs = &input.specs[r.clone()];
            // Each row's draw, or the host's (its logits come back; the kernel's token is unused).
            // A masked draw waits here for the row's mask.
            self.want.clear();
            self.draws.clear();
            let mut masks = Vec::new();
            for (i, spec) in specs.iter().enumerate() {
                let constrained = input.is_constrained(start + i);
                let draw = match kernel_draw(spec) {
                    Some(d) if constrained && self.kernel_masks => Some(d.with_mask()),
                    _ if constrained => None,
                    d => d,
                };
                if draw.is_some_and(|d| d.masked != 0) {
                    masks.resize(i, None);
                    masks.push(input.allowed(start + i));
                }
                self.want.push(draw.is_none());
                self.draws.push(draw.unwrap_or_default());
            }
            if !masks.is_empty() {
                masks.resize(specs.len(), None);
            }
            self.sampled.clear();
            self.logits.clear();
            let step = StepRows {
                rows: &input.rows[r.clone()],
                tokens: &input.tokens[r.clone()],
                positions: &input.positions[r.clone()],
                table: input.table,
                want_logits: &self.want,
                samples: &self.draws,
                masks: &masks,
                late_masks: false,
                launch: start / per_launch,
            };
            self.launcher.launch(&step, &mut self.sampled, &mut self.logits)?;
            if self.sampled.len() != specs.len()
                || self.logits.len() != vocab * self.want.iter().filter(|&&w| w).count()
            {
                return Err(BackendError("the launch returned the wrong number of tokens or logits".into()));
            }
            // The rows the kernel did not sample, together (on several threads where they are many).
            let mut logits = self.logits.chunks_exact(vocab);
            let jobs: Vec<Job<'_>> = (0..specs.len())
                .filter(|&i| self.want[i])
                .map(|i| Job {
                    logits: logits.next().expect("counted above"),
                    spec: &specs[i],
                    allowed: input.allowed(start + i),
                })
                .collect();
            sample_rows(&mut self.samplers, &jobs, &mut self.host_sampled);
            let mut host = self.host_sampled.drain(..);
            for i in 0..specs.len() {
                let row = input.rows[start + i];
                if self.want[i] {
                    let sampled = host.next().expect("one result per job");
                    out.push(sampled.map_err(|e| BackendError(format!("row {row}: {e}")))?);
                } else {
                    out.push(kernel_token(row, self.sampled[i], vocab)?);
                }
            }
        }
        Ok(())
    }
}

/// The megakernel backend: prompts prefill through `P` (PyTorch on the GPU, writing the K/V pool
/// the kernel reads), decode steps run as launches of `L`. `P` never sees a decode call, so the
/// rows whose table changed in decode steps reach it with its next prefill (`UnseenRows`).
pub struct MegakernelBackend<P, L> {
    // Declared first so it drops first: its device buffers are freed on the stream the
    // prefilling side owns (and keeps alive until it drops, after).
    decoder: MegakernelDecoder<L>,
    prefiller: P,
    unseen: UnseenRows,
}

impl<P: Backend, L: StepLauncher + Send> MegakernelBackend<P, L> {
    pub fn new(decoder: MegakernelDecoder<L>, prefiller: P) -> Self {
        Self { decoder, prefiller, unseen: UnseenRows::default() }
    }
}

impl<P: Backend, L: StepLauncher + Send> Backend for MegakernelBackend<P, L> {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        let dirty_rows = self.unseen.pending(input.table.rows(), input.dirty_rows);
        self.prefiller.prefill(&PrefillInput { dirty_rows, ..*input }, out)?;
        self.unseen.sent();
        Ok(())
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.unseen.note(input.table.rows(), input.dirty_rows);
        self.decoder.decode(input, out)
    }

    fn queued(&mut self) -> Option<&mut dyn QueuedDecoder> {
        Some(self)
    }

    fn queued_ref(&self) -> Option<&dyn QueuedDecoder> {
        Some(self)
    }

    fn launch_times(&self) -> LaunchTimes {
        self.decoder.launch_times()
    }
}

impl<P: Backend, L: StepLauncher + Send> QueuedDecoder for MegakernelBackend<P, L> {
    fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        self.decoder.can_queue(input)
    }

    fn late_masks(&self) -> bool {
        self.decoder.kernel_masks && self.decoder.late_masks
    }

    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        self.decoder.deliver_masks(masks)
    }

    fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        self.unseen.note(input.table.rows(), input.dirty_rows);
        self.decoder.queue(input, previous)
    }

    fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.decoder.collect(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::gumbel_draw;
    use crate::sched::PageTable;

    /// Logits that depend on (token, position): greedy picks (token + position) % vocab.
    fn fake_logits(token: u32, pos: u32, vocab: usize) -> Vec<f32> {
        let best = (token + pos) as usize % vocab;
        (0..vocab).map(|v| if v == best { 5.0 } else { (v % 7) as f32 * 0.5 }).collect()
    }

    /// A queued launch's rows, tokens, positions and draws, run when its masks come.
    type Awaiting = (Vec<usize>, Vec<u32>, Vec<u32>, Vec<MkRowSample>);

    struct Mock {
        max_rows: usize,
        vocab: usize,
        launches: Vec<Vec<usize>>,
        /// Tokens of the queued launches not yet collected, oldest first.
        queued: Vec<Vec<u32>>,
        /// The rows the kernel drew with noise, in launch order.
        drawn: Vec<usize>,
        /// The rows the kernel drew among their mask's tokens, in launch order.
        masked: Vec<usize>,
        /// A queued launch with late masks, run when they come: its rows, tokens, positions and draws.
        awaiting: Option<Awaiting>,
    }

    fn mock(max_rows: usize, vocab: usize) -> Mock {
        let (launches, queued, drawn, masked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        Mock { max_rows, vocab, launches, queued, drawn, masked, awaiting: None }
    }

    impl StepLauncher for Mock {
        fn max_rows(&self) -> usize {
            self.max_rows
        }
        fn vocab(&self) -> usize {
            self.vocab
        }
        fn launch(
            &mut self,
            s: &StepRows<'_>,
            sampled: &mut Vec<u32>,
            logits: &mut Vec<f32>,
        ) -> Result<(), BackendError> {
            assert!(s.rows.len() <= self.max_rows && s.rows.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(s.launch, self.launches.len(), "launches of one step are numbered in order");
            self.launches.push(s.rows.to_vec());
            for i in 0..s.rows.len() {
                let mut l = fake_logits(s.tokens[i], s.positions[i], self.vocab);
                // The kernel's rule: greedy, or Gumbel-max as the host sampler defines it, among
                // the tokens of the row's mask where it is masked.
                let d = &s.samples[i];
                assert_eq!(d.masked != 0, s.masks.get(i).is_some_and(Option::is_some), "row {i}: masked iff a mask");
                if d.masked != 0 {
                    assert!(!s.want_logits[i], "a row the kernel draws needs no logits");
                    self.masked.push(s.rows[i]);
                    let mask = s.masks[i].expect("checked above");
                    for (t, x) in l.iter_mut().enumerate() {
                        if !mask.allows(t as u32) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                let token = if d.is_greedy() {
                    argmax(&l)
                } else {
                    assert!(!s.want_logits[i], "a row the kernel draws needs no logits");
                    self.drawn.push(s.rows[i]);
                    let seed = u64::from(d.seed_lo) | (u64::from(d.seed_hi) << 32);
                    gumbel_draw(&l, d.inv_temperature, seed, d.index).unwrap()
                };
                sampled.push(if s.tokens[i] == 999 { self.vocab as u32 } else { token });
                if s.want_logits[i] {
                    logits.extend_from_slice(&l);
                }
            }
            Ok(())
        }
        fn queue(&mut self, s: &StepRows<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
            let mut tokens = s.tokens.to_vec();
            for (t, p) in tokens.iter_mut().zip(previous) {
                if let Some(j) = p {
                    *t = self.queued.last().expect("a queued launch to follow")[*j];
                }
            }
            assert!(self.awaiting.is_none(), "no launch is queued behind one waiting for its masks");
            if s.late_masks {
                self.awaiting = Some((s.rows.to_vec(), tokens, s.positions.to_vec(), s.samples.to_vec()));
                return Ok(());
            }
            let (mut sampled, mut logits) = (Vec::new(), Vec::new());
            self.launch(&StepRows { tokens: &tokens, launch: self.launches.len(), ..*s }, &mut sampled, &mut logits)?;
            assert!(logits.is_empty(), "a queued launch returns no logits");
            self.queued.push(sampled);
            Ok(())
        }
        fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
            let (rows, tokens, positions, samples) =
                self.awaiting.take().ok_or_else(|| BackendError("no launch waits for masks".into()))?;
            // As the launcher: a masked row without a mask allows every token, the others read none.
            let all = TokenMask { words: vec![u32::MAX; TokenMask::words_for(self.vocab)] };
            let masks: Vec<Option<&TokenMask>> = samples
                .iter()
                .zip(masks.iter().chain(std::iter::repeat(&None)))
                .map(|(s, &m)| (s.masked != 0).then(|| m.unwrap_or(&all)))
                .collect();
            let table = PageTable::new(1, self.max_rows.max(rows.iter().max().map_or(0, |r| r + 1)), 1);
            let want = vec![false; rows.len()];
            let step = StepRows {
                rows: &rows,
                tokens: &tokens,
                positions: &positions,
                table: &table,
                want_logits: &want,
                samples: &samples,
                masks: &masks,
                late_masks: false,
                launch: self.launches.len(),
            };
            let (mut sampled, mut logits) = (Vec::new(), Vec::new());
            self.launch(&step, &mut sampled, &mut logits)?;
            self.queued.push(sampled);
            Ok(())
        }
        fn collect(&mut self, sampled: &mut Vec<u32>) -> Result<(), BackendError> {
            sampled.extend(self.queued.remove(0));
            Ok(())
        }
    }

    fn argmax(l: &[f32]) -> u32 {
        (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32
    }

    fn seeded(index: u32) -> SampleSpec {
        SampleSpec { temperature: 0.8, top_p: 0.9, top_k: 20, seed: 42, index, logprobs: None }
    }

    /// A temperature alone: the kernel draws it (a seed with both halves set).
    fn heated(index: u32) -> SampleSpec {
        SampleSpec { temperature: 0.7, top_p: 1.0, top_k: 0, seed: (7 << 40) | 5, index, logprobs: None }
    }

    #[test]
    fn sparse_rows_split_into_launches_and_sample_like_the_host() {
        let vocab = 64;
        let rows: Vec<usize> = vec![0, 2, 3, 5, 8, 9, 11, 15, 16, 20];
        let tokens: Vec<u32> = (0..10).map(|i| 3 * i + 1).collect();
        let positions: Vec<u32> = (0..10).map(|i| 100 + 7 * i).collect();
        let mut specs: Vec<SampleSpec> = (0..10).map(SampleSpec::greedy).collect();
        specs[1] = seeded(1);
        specs[4] = SampleSpec { logprobs: Some(3), ..SampleSpec::greedy(4) };
        specs[9] = seeded(9);
        specs[6] = heated(6);
        specs[7] = heated(7);
        let table = PageTable::new(2, 21, 4);
        let input = DecodeInput {
            rows: &rows,
            tokens: &tokens,
            positions: &positions,
            specs: &specs,
            masks: &crate::grammar::NO_MASKS,
            table: &table,
            dirty_rows: &[],
        };
        let mut dec = MegakernelDecoder::new(mock(4, vocab));
        let mut out = Vec::new();
        dec.decode(&input, &mut out).unwrap();
        assert_eq!(dec.launcher.launches, vec![vec![0, 2, 3, 5], vec![8, 9, 11, 15], vec![16, 20]]);
        let mut sampler = Sampler::new();
        let want: Vec<Sampled> =
            (0..10).map(|i| sampler.sample(&fake_logits(tokens[i], positions[i], vocab), &specs[i]).unwrap()).collect();
        assert_eq!(out, want);
        assert_eq!(out[4].top.len(), 3);
        assert_eq!(dec.launcher.drawn, vec![11, 15], "the temperature-only rows are drawn by the kernel");
    }

    /// A mask allowing the tokens `allow` says yes to.
    fn mask_of(vocab: usize, allow: impl Fn(u32) -> bool) -> crate::grammar::TokenMask {
        let mut words = vec![0u32; crate::grammar::TokenMask::words_for(vocab)];
        for t in (0..vocab as u32).filter(|&t| allow(t)) {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        crate::grammar::TokenMask { words }
    }

    #[test]
    fn with_kernel_masks_the_kernel_draws_constrained_rows_among_their_masks_tokens() {
        use crate::grammar::MaskSet;
        let vocab = 64;
        let rows: Vec<usize> = vec![0, 1, 2, 3, 4, 5];
        let tokens: Vec<u32> = vec![3, 8, 13, 21, 30, 40];
        let positions: Vec<u32> = vec![5, 9, 2, 7, 11, 4];
        // Constrained: a greedy row, a temperature row, one with top-k (the host's), an
        // unconstrained temperature row, and two greedy rows whose masks exclude their best token.
        let specs =
            [SampleSpec::greedy(0), heated(1), seeded(2), heated(3), SampleSpec::greedy(4), SampleSpec::greedy(5)];
        let constrained = vec![true, true, true, false, true, true];
        let masks: Vec<_> = (0..6)
            .map(|i| {
                let best = argmax(&fake_logits(tokens[i], positions[i], vocab));
                mask_of(vocab, |t| t != best && (t % 3 != i as u32 % 3 || t % 5 == 0))
            })
            .collect();
        let set = MaskSet::pending(constrained.clone());
        set.fill(masks.clone());
        let table = PageTable::new(1, 8, 4);
        let input = DecodeInput {
            rows: &rows,
            tokens: &tokens,
            positions: &positions,
            specs: &specs,
            masks: &set,
            table: &table,
            dirty_rows: &[],
        };
        let host = |i: usize| {
            let allowed = constrained[i].then_some(&masks[i]);
            Sampler::new().sample_allowed(&fake_logits(tokens[i], positions[i], vocab), &specs[i], allowed).unwrap()
        };
        let want: Vec<Sampled> = (0..6).map(host).collect();
        for kernel_masks in [false, true] {
            let mut dec = MegakernelDecoder::new(mock(4, vocab));
            dec.kernel_masks = kernel_masks;
            let mut out = Vec::new();
            dec.decode(&input, &mut out).unwrap();
            assert_eq!(out, want, "kernel_masks {kernel_masks}");
            let masked: Vec<usize> = if kernel_masks { vec![0, 1, 4, 5] } else { vec![] };
            assert_eq!(dec.launcher.masked, masked, "kernel_masks {kernel_masks}: the rows drawn under a mask");
            let drawn: Vec<usize> = if kernel_masks { vec![1, 3] } else { vec![3] };
            assert_eq!(dec.launcher.drawn, drawn, "kernel_masks {kernel_masks}: the rows drawn with noise");
            // Steps with a constrained row still run synchronously.
            assert!(!dec.can_queue(&input));
        }
        for i in [0, 4, 5] {
            assert!(masks[i].allows(want[i].token), "row {i} keeps to its mask");
        }
    }

    #[test]
    fn with_late_masks_a_step_under_a_grammar_queues_and_draws_among_masks_delivered_later() {
        use crate::grammar::MaskSet;
        let vocab = 64;
        let (rows, tokens, positions) = (vec![0, 2, 5], vec![3u32, 8, 13], vec![5u32, 9, 2]);
        let specs = [SampleSpec::greedy(0), heated(1), SampleSpec::greedy(2)];
        let constrained = vec![true, false, true];
        let set = MaskSet::pending(constrained.clone()); // never filled: the masks come later
        let table = PageTable::new(1, 8, 4);
        let input = DecodeInput {
            rows: &rows,
            tokens: &tokens,
            positions: &positions,
            specs: &specs,
            masks: &set,
            table: &table,
            dirty_rows: &[],
        };
        let mut dec = MegakernelDecoder::new(mock(4, vocab));
        dec.kernel_masks = true;
        assert!(!dec.can_queue(&input), "without late masks a step under a grammar runs synchronously");
        dec.late_masks = true;
        assert!(dec.can_queue(&input));
        dec.queue(&input, &[None; 3]).unwrap();
        assert!(dec.launcher.queued.is_empty(), "nothing is drawn before the masks come");
        // Row 0's mask excludes its best token; row 2's request has left (None: every token).
        let best = |i: usize| argmax(&fake_logits(tokens[i], positions[i], vocab));
        let mask0 = mask_of(vocab, |t| t != best(0));
        dec.deliver_masks(&[Some(&mask0), None, None]).unwrap();
        let mut out = Vec::new();
        dec.collect(&mut out).unwrap();
        let host = |i: usize, mask: Option<&TokenMask>| {
            Sampler::new().sample_allowed(&fake_logits(tokens[i], positions[i], vocab), &specs[i], mask).unwrap()
        };
        assert_eq!(out, vec![host(0, Some(&mask0)), host(1, None), host(2, None)]);
        assert_ne!(out[0].token, best(0));
        assert_eq!(dec.launcher.masked, vec![0, 5], "rows 0 and 2 were drawn under masks");
        assert!(dec.deliver_masks(&[None, None, None]).is_err(), "no step waits for masks");
    }

    #[test]
    fn a_row_without_a_finite_logit_is_an_error() {
        let table = PageTable::new(1, 2, 1);
        let specs = [SampleSpec::greedy(0), SampleSpec::greedy(0)];
        let input = DecodeInput {
            rows: &[0, 1],
            tokens: &[1, 999],
            positions: &[0, 0],
            specs: &specs,
            masks: &crate::grammar::NO_MASKS,
            table: &table,
            dirty_rows: &[],
        };
        let mut dec = MegakernelDecoder::new(mock(8, 16));
        let err = dec.decode(&input, &mut Vec::new()).unwrap_err();
        assert!(err.0.contains("row 1"), "{err}");
    }

    #[test]
    fn a_queued_step_follows_the_tokens_of_the_one_before_on_the_device() {
        let (vocab, table) = (64, PageTable::new(1, 8, 4));
        let specs: Vec<SampleSpec> = (0..3).map(SampleSpec::greedy).collect();
        let input = |tokens: &'static [u32], positions: &'static [u32]| DecodeInput {
            rows: &[1, 4, 6],
            tokens,
            positions,
            specs: &specs,
            masks: &crate::grammar::NO_MASKS,
            table: &table,
            dirty_rows: &[],
        };
        let mut dec = MegakernelDecoder::new(mock(4, vocab));
        let first = input(&[5, 9, 13], &[10, 20, 30]);
        assert!(dec.can_queue(&first));
        dec.queue(&first, &[None; 3]).unwrap();
        // The second step's rows feed the first's tokens, crossed (its tokens here are ignored).
        dec.queue(&input(&[0, 0, 0], &[11, 21, 31]), &[Some(2), Some(0), Some(1)]).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        dec.collect(&mut a).unwrap();
        dec.collect(&mut b).unwrap();
        let greedy = |t: u32, p: u32| argmax(&fake_logits(t, p, vocab));
        let want_a: Vec<u32> = [(5, 10), (9, 20), (13, 30)].iter().map(|&(t, p)| greedy(t, p)).collect();
        assert_eq!(a.iter().map(|s| s.token).collect::<Vec<_>>(), want_a);
        let crossed = [(want_a[2], 11), (want_a[0], 21), (want_a[1], 31)];
        assert_eq!(b.iter().map(|s| s.token).collect::<Vec<_>>(), crossed.map(|(t, p)| greedy(t, p)));
        assert!(dec.collect(&mut a).is_err(), "nothing is queued");
        // Rows sampled on the host, or more rows than one launch, are not queued; rows the kernel
        // draws with noise are, and draw as the host would.
        let seeded_specs = [seeded(0), SampleSpec::greedy(1), SampleSpec::greedy(2)];
        assert!(!dec.can_queue(&DecodeInput { specs: &seeded_specs, ..first }));
        let heated_specs = [heated(0), SampleSpec::greedy(1), heated(2)];
        let hot = DecodeInput { specs: &heated_specs, ..first };
        assert!(dec.can_queue(&hot));
        dec.queue(&hot, &[None; 3]).unwrap();
        let mut c = Vec::new();
        dec.collect(&mut c).unwrap();
        let host =
            |i: usize, t: u32, p: u32| Sampler::new().sample(&fake_logits(t, p, vocab), &heated_specs[i]).unwrap();
        assert_eq!(c, vec![host(0, 5, 10), host(1, 9, 20), host(2, 13, 30)]);
        let five: Vec<SampleSpec> = (0..5).map(SampleSpec::greedy).collect();
        let wide = DecodeInput { rows: &[0, 1, 2, 3, 4], tokens: &[1; 5], positions: &[1; 5], specs: &five, ..first };
        assert!(!dec.can_queue(&wide) && dec.queue(&wide, &[None; 5]).is_err());
    }

    #[test]
    fn the_kernel_draws_greedy_and_temperature_only_rows_and_the_host_the_rest() {
        assert_eq!(kernel_draw(&SampleSpec::greedy(0)), Some(MkRowSample::default()));
        assert_eq!(kernel_draw(&SampleSpec { top_k: 1, ..seeded(0) }), Some(MkRowSample::default())); // top-1 is greedy
        let d = kernel_draw(&heated(9)).unwrap();
        assert_eq!((d.inv_temperature, d.seed_lo, d.seed_hi, d.index), (1.0 / 0.7, 5, 7 << 8, 9));
        // 1 / T not finite in f32, or above 2^32: the host's limit, greedy.
        for temperature in [1e-45, 1e-12] {
            assert_eq!(kernel_draw(&SampleSpec { temperature, ..heated(0) }), Some(MkRowSample::default()));
        }
        assert!(needs_logits(&seeded(0)));
        assert!(needs_logits(&SampleSpec { top_p: 0.9, ..heated(0) }));
        assert!(needs_logits(&SampleSpec { top_k: 5, ..heated(0) }));
        assert!(needs_logits(&SampleSpec { logprobs: Some(0), ..SampleSpec::greedy(0) }));
        assert!(needs_logits(&SampleSpec { logprobs: Some(0), ..heated(0) }));
    }
}
