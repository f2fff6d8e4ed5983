//! What a client asks for (`Request`, `SamplingParams`), what it gets back (`Event`), and the
//! scheduler's record of one request over its life (`Seq`).

use crate::grammar::Constraint;
use crate::sampling::{SampleSpec, Sampled};
use crate::speculative::Speculator;

/// The client's name for a request (the Python face hands out unique ones).
pub type RequestId = u64;

/// Per-request decoding settings (mirror of `mk.SamplingParams`; `stop` strings are the
/// detokenizing layer's business and never reach the engine).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f32,
    /// 1.0 disables the nucleus filter.
    pub top_p: f32,
    /// 0 disables the top-k filter.
    pub top_k: u32,
    /// None: the engine draws a random seed at submission.
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Alternatives to report with each token's log-probability (None: no logprobs).
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { max_tokens, temperature: 0.0, ..Self::default() }
    }

    pub fn with_ignore_eos(self) -> Self {
        Self { ignore_eos: true, ..self }
    }

    /// The first setting the engine cannot honour, named.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The grammar the output must follow (compiled by the caller, `crate::grammar`), if any.
    pub constraint: Option<Constraint>,
}

impl Request {
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Self {
        Self { id, prompt, params, constraint: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS or a stop token.
    Stop,
    /// max_tokens or the context limit.
    Length,
    Cancelled,
    /// The engine failed this request; the event's `error` says why.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        }
    }
}

/// One step of one request's stream, in order; the last carries `finish`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Event {
    pub id: RequestId,
    /// None only on cancel/error endings.
    pub token: Option<u32>,
    pub logprob: Option<f32>,
    /// Present when the request asked for at least one alternative.
    pub top: Option<Vec<(u32, f32)>>,
    pub finish: Option<FinishReason>,
    pub error: Option<String>,
    /// On the first token only: prompt tokens served from the prefix cache.
    pub cached_tokens: Option<usize>,
    /// On the first token only: seconds the request waited from submission to its first admission.
    pub queue_seconds: Option<f64>,
}

impl Event {
    pub fn ended(id: RequestId, finish: FinishReason, error: Option<String>) -> Self {
        Self { id, finish: Some(finish), error, ..Self::default() }
    }
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// In the queue, holding no blocks.
    Waiting,
    /// Admitted: computing K/V for positions up to `target` (the prompt, plus the tokens already
    /// emitted if it was preempted).
    Prefill { target: usize },
    /// In the decode batch: each step feeds its last token.
    Decode,
}

/// A request as the scheduler tracks it. `tokens` is the prompt followed by every emitted token;
/// K/V is written for positions [0, computed).
#[derive(Debug, Clone)]
pub struct Seq {
    pub id: RequestId,
    /// Submission order: admission is FIFO in it, preemption takes the youngest.
    pub arrival: u64,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub seed: u64,
    pub computed: usize,
    pub phase: Phase,
    /// Never admitted yet (it still counts against the waiting-queue limit).
    pub fresh: bool,
    /// Prompt tokens attached from the prefix cache at first admission, until reported.
    pub cached: Option<usize>,
    /// When the engine took the request, and the seconds it then waited for its first admission
    /// (until reported with the first token).
    pub submitted: std::time::Instant,
    pub queued: Option<f64>,
    pub preemptions: u32,
    /// Scratch of `plan_decode`: grown for this step.
    pub planned: bool,
    /// Decode steps launched for this sequence and not yet `decoded` (0 or 1; 2 with
    /// launch-ahead): its K/V is mapped that many positions past `computed`.
    pub in_flight: usize,
    /// Where the output is in its grammar; `constraint_error` ends the request at its next token.
    pub constraint: Option<Constraint>,
    pub constraint_error: Option<String>,
    /// Speculative decoding's drafting over its tokens (built when it first decodes with drafts
    /// on), and the draft of the step in flight (verified by that step's rows after its own).
    pub speculator: Option<Speculator>,
    pub draft: Vec<u32>,
}

impl Seq {
    pub fn new(req: Request, seed: u64, arrival: u64) -> Self {
        Self {
            id: req.id,
            arrival,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            params: req.params,
            seed,
            computed: 0,
            phase: Phase::Waiting,
            fresh: true,
            cached: None,
            submitted: std::time::Instant::now(),
            queued: None,
            preemptions: 0,
            planned: false,
            in_flight: 0,
            constraint: req.constraint,
            constraint_error: None,
            speculator: None,
            draft: Vec::new(),
        }
    }

    /// Whether a launched step's entry for request `id` (planned in this sequence's row where
    /// `same_row`) is this sequence's: it decodes and has a step in flight. A request finished or
    /// cancelled since, or one resubmitted under the same id (prefilling: a step in flight always
    /// lands before a prefill), is not.
    pub fn landing(&self, same_row: bool, id: RequestId) -> bool {
        same_row && self.id == id && self.phase == Phase::Decode && self.in_flight > 0
    }

    /// Whether its tokens are sampled under a grammar (whose mask needs every earlier token; one
    /// that failed keeps its state until the error ends the request).
    pub fn constrained(&self) -> bool {
        self.constraint.is_some()
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// How to sample the next token (generation step `generated()`).
    pub fn spec(&self) -> SampleSpec {
        let p = &self.params;
        SampleSpec {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            seed: self.seed,
            index: self.generated() as u32,
            logprobs: p.logprobs,
        }
    }

    /// Appends a sampled token and says whether the request ends with it. Under a grammar, EOS
    /// (which the grammar allowed) and the grammar's end stop it; a token the grammar refuses
    /// (a backend that ignored the mask) ends it with an error.
    pub fn accept(&mut self, s: &Sampled, eos: Option<u32>, max_context: usize) -> Event {
        self.tokens.push(s.token);
        let mut error = self.constraint_error.take();
        let (mut grammar_done, mut released) = (false, false);
        if let (Some(c), None) = (self.constraint.as_mut(), &error) {
            if eos == Some(s.token) {
                grammar_done = true;
            } else {
                match c.commit(s.token) {
                    Ok(()) => (grammar_done, released) = (c.is_stopped(), c.released()),
                    Err(e) => error = Some(format!("the output left its grammar: {e}")),
                }
            }
        }
        if released {
            self.constraint = None; // (a step already planned under it gets every token allowed)
        }
        let p = &self.params;
        let finish = if error.is_some() {
            Some(FinishReason::Error)
        } else if grammar_done || (!p.ignore_eos && eos == Some(s.token)) || p.stop_token_ids.contains(&s.token) {
            Some(FinishReason::Stop)
        } else if self.generated() >= p.max_tokens || self.tokens.len() >= max_context {
            Some(FinishReason::Length)
        } else {
            None
        };
        Event {
            id: self.id,
            token: Some(s.token),
            logprob: s.logprob,
            top: (p.logprobs.unwrap_or(0) > 0).then(|| s.top.clone()),
            finish,
            error,
            cached_tokens: self.cached.take(),
            queue_seconds: self.queued.take(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(params: SamplingParams) -> Seq {
        Seq::new(Request::new(7, vec![5, 6, 7], params), 99, 0)
    }

    #[test]
    fn validation_names_the_setting() {
        assert!(SamplingParams::default().validate().is_ok());
        let bad = |p: SamplingParams| p.validate().unwrap_err();
        assert!(bad(SamplingParams { max_tokens: 0, ..Default::default() }).contains("max_tokens"));
        assert!(bad(SamplingParams { temperature: -1.0, ..Default::default() }).contains("temperature"));
        assert!(bad(SamplingParams { temperature: f32::NAN, ..Default::default() }).contains("temperature"));
        assert!(bad(SamplingParams { top_p: 0.0, ..Default::default() }).contains("top_p"));
        assert!(bad(SamplingParams { top_p: 1.5, ..Default::default() }).contains("top_p"));
    }

    #[test]
    fn stop_conditions() {
        let mut s = seq(SamplingParams { max_tokens: 3, stop_token_ids: vec![9], ..SamplingParams::greedy(3) });
        s.cached = Some(0);
        let e = s.accept(&Sampled::token(4), Some(2), 100);
        assert_eq!((e.token, e.finish, e.cached_tokens), (Some(4), None, Some(0)));
        assert_eq!(s.spec().index, 1);
        assert_eq!(s.accept(&Sampled::token(2), Some(2), 100).finish, Some(FinishReason::Stop));
        let mut s = seq(SamplingParams { ignore_eos: true, stop_token_ids: vec![9], ..SamplingParams::greedy(3) });
        assert_eq!(s.accept(&Sampled::token(2), Some(2), 100).finish, None);
        assert_eq!(s.accept(&Sampled::token(9), Some(2), 100).finish, Some(FinishReason::Stop));
        let mut s = seq(SamplingParams::greedy(2));
        assert_eq!(s.accept(&Sampled::token(4), None, 100).finish, None);
        assert_eq!(s.accept(&Sampled::token(4), None, 100).finish, Some(FinishReason::Length));
        // The context limit ends a request even below max_tokens.
        let mut s = seq(SamplingParams::greedy(50));
        assert_eq!(s.accept(&Sampled::token(4), None, 4).finish, Some(FinishReason::Length));
    }

    #[test]
    fn alternatives_only_when_asked() {
        let sampled = Sampled { token: 3, logprob: Some(-0.5), top: vec![(3, -0.5)] };
        let mut s = seq(SamplingParams { logprobs: Some(0), ..Default::default() });
        let e = s.accept(&sampled, None, 100);
        assert_eq!((e.logprob, e.top), (Some(-0.5), None));
        let mut s = seq(SamplingParams { logprobs: Some(1), ..Default::default() });
        assert_eq!(s.accept(&sampled, None, 100).top, Some(vec![(3, -0.5)]));
    }
}
