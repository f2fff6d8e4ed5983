//! A deterministic stand-in model for tests. It stores every written token in its K/V slot
//! (block, offset) and derives the next-token logits from the tokens it reads back through the
//! page table: every earlier position on full layers, the window on sliding ones. A wrong block
//! id, a stale page or a bad prefix attach therefore changes the output or fails the call, while
//! any correct schedule reproduces `MockModel::solo`, the request run alone.

use super::backend::{
    Backend, BackendError, DecodeInput, LaunchTimes, PrefillChunkInput, PrefillInput, PrefillResult, QueuedDecoder,
};
use crate::grammar::TokenMask;
use crate::kv::KvConfig;
use crate::sampling::{SampleSpec, Sampled, Sampler};
use crate::sched::{FinishReason, PageTable, Request, SamplingParams, Seq};

#[derive(Debug, Clone)]
pub struct MockModel {
    pub page: usize,
    pub window: usize,
    pub sliding: Vec<bool>,
    pub vocab: u32,
    pub eos: Option<u32>,
    /// Logits from the last this-many tokens of the first layer only (None: every visible
    /// position of every layer): a text that soon repeats itself, so that drafts are accepted.
    pub markov: Option<usize>,
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl MockModel {
    /// 3 layers (full, sliding, sliding), pages of 4 tokens, a window of 10, 32 tokens, EOS 0.
    pub fn small() -> Self {
        Self { page: 4, window: 10, sliding: vec![false, true, true], vocab: 32, eos: Some(0), markov: None }
    }

    /// `small` whose next token depends on the last two only.
    pub fn repetitive() -> Self {
        Self { markov: Some(2), ..Self::small() }
    }

    pub fn kv_config(&self, num_blocks: usize) -> KvConfig {
        KvConfig {
            sliding: self.sliding.clone(),
            window: self.window,
            page_size: self.page,
            num_blocks,
            salt: b"mock".to_vec(),
        }
    }

    /// Positions a query at `p` sees on `layer`.
    fn visible(&self, layer: usize, p: usize) -> std::ops::RangeInclusive<usize> {
        let lo = if self.sliding[layer] { (p + 1).saturating_sub(self.window) } else { 0 };
        lo..=p
    }

    /// Positions the logits after a query at `p` depend on, on `layer`.
    fn read_for_logits(&self, layer: usize, p: usize) -> std::ops::Range<usize> {
        let all = self.visible(layer, p);
        match self.markov {
            None => *all.start()..p + 1,
            Some(n) if layer == 0 => (p + 1).saturating_sub(n)..p + 1,
            Some(_) => p..p,
        }
    }

    /// Logits of the next token after a query at `p`, reading tokens through `read`.
    fn logits_with(
        &self,
        p: usize,
        mut read: impl FnMut(usize, usize) -> Result<u32, String>,
    ) -> Result<Vec<f32>, String> {
        let mut h = 0u64;
        for layer in 0..self.sliding.len() {
            for pos in self.read_for_logits(layer, p) {
                // (a Markov model sees how far back a token is, not where)
                let at = if self.markov.is_some() { p - pos } else { pos };
                h = mix(h, u64::from(read(layer, pos)?) | (at as u64) << 32 | (layer as u64) << 56);
            }
        }
        Ok((0..self.vocab).map(|v| (mix(h, u64::from(v)) >> 40) as f32 / (1u64 << 24) as f32 * 6.0).collect())
    }

    /// Logits after `tokens` (the reference, reading the tokens directly).
    pub fn logits(&self, tokens: &[u32]) -> Vec<f32> {
        self.logits_with(tokens.len() - 1, |_, pos| Ok(tokens[pos])).unwrap()
    }

    /// What one request generates run alone, and why it stops.
    pub fn solo(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        seed: u64,
        max_context: usize,
    ) -> (Vec<u32>, FinishReason) {
        self.solo_request(Request::new(0, prompt.to_vec(), params.clone()), seed, max_context)
    }

    /// The same for a whole request (its grammar's masks applied, as the engine does).
    pub fn solo_request(&self, req: Request, seed: u64, max_context: usize) -> (Vec<u32>, FinishReason) {
        let prompt_len = req.prompt.len();
        let seed = req.params.seed.unwrap_or(seed);
        let mut seq = Seq::new(req, seed, 0);
        let mut sampler = Sampler::new();
        let mut mask = TokenMask::default();
        loop {
            let allowed = seq.constraint.as_mut().map(|c| c.allowed(&mut mask).map(|()| &mask).unwrap());
            let s = sampler.sample_allowed(&self.logits(&seq.tokens), &seq.spec(), allowed).unwrap();
            if let Some(reason) = seq.accept(&s, self.eos, max_context).finish {
                return (seq.tokens[prompt_len..].to_vec(), reason);
            }
        }
    }
}

/// A queued step's logits (or why a row has none) and specs, its rows drawn when its masks come.
type Awaiting = (Vec<Result<Vec<f32>, String>>, Vec<SampleSpec>);

/// `MockModel` behind the backend trait, over its own slot store.
pub struct MockBackend {
    pub model: MockModel,
    /// Per (block, offset): the token written there and its position (u32::MAX: never written).
    store: Vec<(u32, u32)>,
    sampler: Sampler,
    /// Fail every prefill of this request.
    pub fail_request: Option<u64>,
    /// Fail, as a whole, every prefill call that packs this request with others.
    pub fail_packed_request: Option<u64>,
    /// Fail the decode call with this index (0-based).
    pub fail_decode_call: Option<usize>,
    pub prefill_calls: usize,
    /// Chunks per `prefill` call, in call order.
    pub prefill_batches: Vec<usize>,
    /// Prompt tokens per `prefill` call, in call order.
    pub prefill_tokens: Vec<usize>,
    /// Layers per `prefill` call (all of them, or a slice's), in call order.
    pub prefill_layers: Vec<usize>,
    /// Per `prefill` call: whether the next decode step had a row the call did not just finish
    /// prefilling (a stream that was decoding while the call was planned).
    pub prefill_decoding: Vec<bool>,
    /// Per `prefill` call: whether a queued step was still uncollected (in flight) when it came.
    pub prefill_behind_queued: Vec<bool>,
    /// The `prefill` calls since the last decode step (a failed packed call is retried chunk by
    /// chunk: several in one iteration), and the rows whose last chunk they ran.
    just_prefilled: Option<(Vec<usize>, std::collections::HashSet<usize>)>,
    pub decode_calls: usize,
    /// Largest decode batch seen.
    pub max_rows: usize,
    /// Take decode steps into a queue, as a device would (`QueuedDecoder::queue`): each step runs when
    /// it is queued, reading the tokens it follows from the step queued before (which the loop
    /// has not seen), and its tokens wait for `collect`.
    pub queueing: bool,
    /// Steps queued so far.
    pub queued_steps: usize,
    /// Queue at most this many steps, then refuse (a batch that stops being queueable).
    pub queue_limit: Option<usize>,
    /// Queue steps with rows under a grammar too, their masks delivered later
    /// (`QueuedDecoder::late_masks`): such a step's logits are computed when it is queued and its rows
    /// sampled when the masks come; collecting it before that fails it.
    pub late_masks: bool,
    /// The last queued step's logits and specs while its masks have not come.
    awaiting: Option<Awaiting>,
    /// `deliver_masks` calls so far.
    pub masks_delivered: usize,
    /// Fail the `deliver_masks` call with this index (0-based); the step still lands through
    /// `collect`, in queue order.
    pub fail_masks_call: Option<usize>,
    queued: std::collections::VecDeque<Result<Vec<Sampled>, BackendError>>,
    /// The tokens of the last queued step (None where it failed): the device's copy.
    last_queued: Option<Vec<u32>>,
}

impl MockBackend {
    pub fn new(model: MockModel, num_blocks: usize) -> Self {
        let store = vec![(u32::MAX, u32::MAX); num_blocks * model.page];
        Self {
            model,
            store,
            sampler: Sampler::new(),
            fail_request: None,
            fail_packed_request: None,
            fail_decode_call: None,
            prefill_calls: 0,
            prefill_behind_queued: Vec::new(),
            prefill_batches: Vec::new(),
            prefill_tokens: Vec::new(),
            prefill_layers: Vec::new(),
            prefill_decoding: Vec::new(),
            just_prefilled: None,
            decode_calls: 0,
            max_rows: 0,
            queueing: false,
            queued_steps: 0,
            queue_limit: None,
            late_masks: false,
            awaiting: None,
            masks_delivered: 0,
            fail_masks_call: None,
            queued: std::collections::VecDeque::new(),
            last_queued: None,
        }
    }

    fn slot(&self, table: &PageTable, row: usize, layer: usize, pos: usize) -> Result<usize, String> {
        let block = table.entries(layer, row)[pos / self.model.page];
        if block < 0 {
            return Err(format!("row {row} layer {layer} position {pos}: page unmapped"));
        }
        Ok(block as usize * self.model.page + pos % self.model.page)
    }

    fn write(&mut self, table: &PageTable, row: usize, token: u32, pos: usize) -> Result<(), String> {
        self.write_layers(table, row, token, pos, 0..self.model.sliding.len())
    }

    fn write_layers(
        &mut self,
        table: &PageTable,
        row: usize,
        token: u32,
        pos: usize,
        layers: std::ops::Range<usize>,
    ) -> Result<(), String> {
        for layer in layers {
            let slot = self.slot(table, row, layer, pos)?;
            self.store[slot] = (token, pos as u32);
        }
        Ok(())
    }

    fn next(
        &mut self,
        table: &PageTable,
        row: usize,
        p: usize,
        spec: &SampleSpec,
        allowed: Option<&TokenMask>,
    ) -> Result<Sampled, String> {
        let logits = self.logits_at(table, row, p)?;
        self.sampler.sample_allowed(&logits, spec, allowed).map_err(|e| e.to_string())
    }

    /// The logits of row `row`'s query at `p`, from the K/V its pages hold.
    fn logits_at(&self, table: &PageTable, row: usize, p: usize) -> Result<Vec<f32>, String> {
        self.model.logits_with(p, |layer, pos| {
            let (token, at) = self.store[self.slot(table, row, layer, pos)?];
            if at as usize != pos {
                return Err(format!("row {row} layer {layer} position {pos}: stale K/V (holds position {at})"));
            }
            Ok(token)
        })
    }
}

impl MockBackend {
    /// The call's layers of chunk `c` (all, or its slice's), and on the last slice its result.
    fn prefill_chunk(&mut self, input: &PrefillInput<'_>, c: &PrefillChunkInput<'_>) -> PrefillResult {
        let table = input.table;
        self.prefill_calls += 1;
        if self.fail_request == Some(c.request) {
            return Err(BackendError("injected failure".into()));
        }
        let layers = input.layers.map_or(0..self.model.sliding.len(), |s| s.start..s.end);
        // The chunk's first query attends to the cached keys in its window: they must be there.
        for layer in layers.clone() {
            for pos in self.model.visible(layer, c.start).filter(|&p| p < c.start) {
                let (_, at) = self.store[self.slot(table, c.row, layer, pos).map_err(BackendError)?];
                if at as usize != pos {
                    let e = format!("row {} layer {layer} position {pos}: stale K/V (holds position {at})", c.row);
                    return Err(BackendError(e));
                }
            }
        }
        for (i, &t) in c.tokens.iter().enumerate() {
            self.write_layers(table, c.row, t, c.start + i, layers.clone()).map_err(BackendError)?;
        }
        if !c.last || input.layers.is_some_and(|s| !s.last) {
            return Ok(None);
        }
        let last = c.start + c.tokens.len() - 1;
        self.next(table, c.row, last, &c.spec, input.allowed(c)).map(Some).map_err(BackendError)
    }

    /// One decode step over `input`, as `decode` runs it (counted, failing where injected).
    fn step(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.decode_calls += 1;
        if let Some((calls, fresh)) = self.just_prefilled.take() {
            let decoding = input.rows.iter().any(|r| !fresh.contains(r));
            for call in calls {
                self.prefill_decoding[call] = decoding;
            }
        }
        if self.fail_decode_call == Some(self.decode_calls - 1) {
            return Err(BackendError("injected failure".into()));
        }
        self.max_rows = self.max_rows.max(input.len());
        for i in 0..input.len() {
            let (row, pos) = (input.rows[i], input.positions[i] as usize);
            self.write(input.table, row, input.tokens[i], pos).map_err(BackendError)?;
        }
        for i in 0..input.len() {
            let (row, pos) = (input.rows[i], input.positions[i] as usize);
            out.push(self.next(input.table, row, pos, &input.specs[i], input.allowed(i)).map_err(BackendError)?);
        }
        Ok(())
    }
}

impl Backend for MockBackend {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        let rows: std::collections::HashSet<usize> = input.chunks.iter().map(|c| c.row).collect();
        assert_eq!(rows.len(), input.chunks.len(), "one chunk per sequence and call");
        let results_due = input.layers.is_none_or(|s| s.last);
        self.prefill_batches.push(input.chunks.len());
        self.prefill_tokens.push(input.chunks.iter().map(|c| c.tokens.len()).sum());
        self.prefill_layers.push(input.layers.map_or(self.model.sliding.len(), |s| s.end - s.start));
        self.prefill_decoding.push(false);
        self.prefill_behind_queued.push(!self.queued.is_empty());
        let (calls, rows) = self.just_prefilled.get_or_insert_with(Default::default);
        calls.push(self.prefill_tokens.len() - 1);
        rows.extend(input.chunks.iter().filter(|c| c.last && results_due).map(|c| c.row));
        let poisoned = input.chunks.iter().any(|c| self.fail_packed_request == Some(c.request));
        if poisoned && input.chunks.len() > 1 {
            return Err(BackendError("injected failure of the packed call".into()));
        }
        let results = input.chunks.iter().map(|c| self.prefill_chunk(input, c)).collect::<Vec<_>>();
        if results_due {
            out.extend(results);
        } else if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            return Err(e); // a slice before the last: the call fails as a whole
        }
        Ok(())
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.last_queued = None; // a step run now replaces the device's tokens (`queue` follows it)
        self.step(input, out)
    }

    fn queued(&mut self) -> Option<&mut dyn QueuedDecoder> {
        Some(self)
    }

    fn queued_ref(&self) -> Option<&dyn QueuedDecoder> {
        Some(self)
    }

    /// One launch per decode call (the only phase the mock can stand for: no time).
    fn launch_times(&self) -> LaunchTimes {
        LaunchTimes { launches: self.decode_calls as u64, ..LaunchTimes::default() }
    }
}

impl QueuedDecoder for MockBackend {
    fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        self.queueing
            && self.queue_limit.is_none_or(|limit| self.queued_steps < limit)
            && (0..input.len()).all(|i| !input.is_constrained(i) || self.late_masks)
    }

    fn late_masks(&self) -> bool {
        self.late_masks
    }

    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        let (logits, specs) = self.awaiting.take().ok_or_else(|| BackendError("no step waits for masks".into()))?;
        assert_eq!(masks.len(), specs.len(), "one mask (or none) per row");
        self.masks_delivered += 1;
        if self.fail_masks_call == Some(self.masks_delivered - 1) {
            // (as the launcher: the step runs with every token allowed, the call fails)
            let e = BackendError("injected failure of the masks".into());
            *self.queued.back_mut().expect("the step awaiting its masks") = Err(e.clone());
            self.last_queued = None;
            return Err(e);
        }
        let mut sampled = Vec::new();
        let mut result = Ok(());
        for ((l, spec), mask) in logits.iter().zip(&specs).zip(masks) {
            match l
                .as_ref()
                .map_err(|e| e.clone())
                .and_then(|l| self.sampler.sample_allowed(l, spec, *mask).map_err(|e| e.to_string()))
            {
                Ok(s) => sampled.push(s),
                Err(e) => result = Err(BackendError(e)),
            }
        }
        let step = result.map(|()| sampled);
        self.last_queued = step.as_ref().ok().map(|s| s.iter().map(|s| s.token).collect());
        *self.queued.back_mut().expect("the step awaiting its masks") = step;
        Ok(())
    }

    fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        assert!(self.queued.len() < 2, "the loop keeps at most one step queued behind another");
        assert!(self.awaiting.is_none(), "a step is queued behind one still waiting for its masks");
        assert!(previous.is_empty() || previous.len() == input.len(), "one source per row, or none");
        self.queued_steps += 1;
        let mut tokens = input.tokens.to_vec();
        let mut followed = true;
        for (i, p) in previous.iter().enumerate() {
            if let Some(j) = *p {
                match self.last_queued.as_ref().and_then(|last| last.get(j)) {
                    Some(&t) => tokens[i] = t,
                    None => followed = false,
                }
            }
        }
        if (0..input.len()).any(|i| input.is_constrained(i)) {
            // Rows under a grammar: K/V written and logits computed now, the tokens drawn when the
            // masks come (`deliver_masks`).
            self.decode_calls += 1;
            let step = DecodeInput { tokens: &tokens, ..*input };
            let mut logits = Vec::new();
            if followed {
                for i in 0..step.len() {
                    let (row, pos) = (step.rows[i], step.positions[i] as usize);
                    self.write(step.table, row, step.tokens[i], pos).map_err(BackendError)?;
                }
            }
            for i in 0..step.len() {
                logits.push(match followed {
                    true => self.logits_at(step.table, step.rows[i], step.positions[i] as usize),
                    false => Err("the step this one follows failed".into()),
                });
            }
            self.awaiting = Some((logits, step.specs.to_vec()));
            self.last_queued = None;
            self.queued.push_back(Err(BackendError("collected before its masks came".into())));
            return Ok(());
        }
        let mut out = Vec::new();
        let result = match followed {
            true => self.step(&DecodeInput { tokens: &tokens, ..*input }, &mut out).map(|()| out),
            false => Err(BackendError("the step this one follows failed".into())),
        };
        self.last_queued = result.as_ref().ok().map(|s| s.iter().map(|s| s.token).collect());
        self.queued.push_back(result);
        Ok(())
    }

    fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        out.extend(self.queued.pop_front().expect("collect follows queue")?);
        Ok(())
    }
}
