//! Grammar-constrained decoding: which tokens a request may produce next, from a JSON schema, a
//! regular expression or a Lark grammar, with llguidance (the grammar engine vLLM, SGLang and
//! llama.cpp use) against the model's own vocabulary.
//!
//! `Grammars` is built once per engine from the tokenizer (its `tokenizer.json`); `compile` turns
//! a request's `ConstraintSpec` into a `Constraint`, its parser state. Per step a constrained
//! row's `Constraint::allowed` fills a `TokenMask` (bit t of word t / 32: 32 KB at 262,144
//! tokens) that sampling applies; the sampled token then goes to `commit`. A grammar that has
//! ended allows only EOS, so the request stops there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ConstraintSpec {
    /// Any JSON object (OpenAI `response_format` `json_object`).
    JsonObject,
    /// A JSON schema, as JSON text (`response_format` `json_schema`).
    JsonSchema(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect, or (text starting with `{`) a JSON list of named
    /// grammars, llguidance's `TopLevelGrammar`, whose first may refer to the others as `@name`.
    Lark(String),
    /// Output that begins with this text and is free once it has (token healing: the text a
    /// prompt was backed up by). The request drops its grammar there (`Constraint::released`), so
    /// its later steps are those of a request without one.
    Prefix(String),
}

/// A constraint that cannot be compiled or followed; the message names the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// How constrained JSON is laid out unless a schema says otherwise (its own `x-guidance`):
/// `json.dumps`'s separators and no other whitespace, so a model cannot wander into endless
/// blanks between tokens.
pub const JSON_LAYOUT: &str = r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

/// `schema` with `JSON_LAYOUT` where it names no layout of its own.
fn with_layout(schema: &str) -> Result<serde_json::Value, GrammarError> {
    let mut v: serde_json::Value = serde_json::from_str(schema).map_err(err)?;
    if let Some(obj) = v.as_object_mut() {
        if !obj.contains_key("x-guidance") {
            obj.insert("x-guidance".into(), serde_json::from_str(JSON_LAYOUT).expect("valid JSON"));
        }
    }
    Ok(v)
}

fn err(e: impl std::fmt::Display) -> GrammarError {
    GrammarError(e.to_string())
}

/// Allowed tokens of one row: bit t of word t / 32.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    /// Words of a mask over a vocabulary of `vocab` tokens.
    pub fn words_for(vocab: usize) -> usize {
        vocab.div_ceil(32)
    }

    pub fn allows(&self, token: u32) -> bool {
        self.words.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// The masks of one decode step's rows, which may still be being computed while the step runs:
/// which rows have one is known up front (a backend copies those rows' logits back), the masks
/// themselves arrive with `fill`, and `get` waits for them.
#[derive(Debug)]
pub struct MaskSet {
    constrained: Vec<bool>,
    masks: OnceLock<Vec<TokenMask>>,
}

/// A step without constrained rows.
pub static NO_MASKS: MaskSet = MaskSet { constrained: Vec::new(), masks: OnceLock::new() };

impl MaskSet {
    /// Masks to come for the rows marked in `constrained`.
    pub fn pending(constrained: Vec<bool>) -> Self {
        Self { constrained, masks: OnceLock::new() }
    }

    /// The masks, one per row (those of unconstrained rows are not read).
    pub fn fill(&self, masks: Vec<TokenMask>) {
        let _ = self.masks.set(masks);
    }

    pub fn is_constrained(&self, row: usize) -> bool {
        self.constrained.get(row).copied().unwrap_or(false)
    }

    pub fn any_constrained(&self) -> bool {
        self.constrained.contains(&true)
    }

    /// Row `row`'s mask, waiting until the masks are filled; None for an unconstrained row.
    pub fn get(&self, row: usize) -> Option<&TokenMask> {
        self.is_constrained(row).then(|| &self.masks.wait()[row])
    }
}

/// The vocabulary as llguidance sees it and the compiler of constraints against it.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab_size", &self.vocab_size).finish()
    }
}

impl Grammars {
    /// From a Hugging Face `tokenizer.json` (byte-level or byte-fallback BPE); `vocab_size` is the
    /// model's (ids the tokenizer lacks are never allowed), `eos` the token that ends a request.
    pub fn from_tokenizer_json(json: &str, vocab_size: usize, eos: u32) -> Result<Self, GrammarError> {
        let value: serde_json::Value = serde_json::from_str(json).map_err(err)?;
        let words = llguidance::token_bytes_from_tokenizer_json(&value).map_err(err)?;
        Self::from_token_bytes(words, vocab_size, eos)
    }

    /// From each token's bytes (special tokens start with `TokTrie::SPECIAL_TOKEN_MARKER`).
    pub fn from_token_bytes(mut words: Vec<Vec<u8>>, vocab_size: usize, eos: u32) -> Result<Self, GrammarError> {
        if words.len() > vocab_size || eos as usize >= vocab_size {
            return Err(GrammarError(format!(
                "the tokenizer has {} tokens and EOS {eos}, the model a vocabulary of {vocab_size}",
                words.len()
            )));
        }
        // Ids past the tokenizer's own, and holes in its numbering, become special tokens no
        // grammar names: never allowed.
        let unused = |i: usize| [&[TokTrie::SPECIAL_TOKEN_MARKER][..], format!("<[unused {i}]>").as_bytes()].concat();
        for (i, w) in words.iter_mut().enumerate().filter(|(_, w)| w.is_empty()) {
            *w = unused(i);
        }
        let missing = words.len()..vocab_size;
        words.extend(missing.map(unused));
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(err)?;
        factory.quiet();
        Ok(Self { factory: Arc::new(factory), vocab_size })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The parser state of a new request under `spec`, or the reason it cannot be followed.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, GrammarError> {
        let grammar = match spec {
            ConstraintSpec::JsonObject => TopLevelGrammar::from_json_schema(with_layout(r#"{"type": "object"}"#)?),
            ConstraintSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_layout(s)?),
            ConstraintSpec::Regex(s) => TopLevelGrammar::from_regex(s),
            ConstraintSpec::Lark(s) => TopLevelGrammar::from_lark_or_grammar_list(s).map_err(err)?,
            // (a JSON string is a Lark string literal: the text, escaped)
            ConstraintSpec::Prefix(s) => TopLevelGrammar::from_lark(format!(
                "start: PREFIX\nPREFIX: {} /(?s:.*)/",
                serde_json::Value::from(&**s)
            )),
        };
        let parser = self.factory.create_parser(grammar).map_err(err)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(e));
        }
        let prefix_left = match spec {
            ConstraintSpec::Prefix(s) => Some(s.len()),
            _ => None,
        };
        Ok(Constraint { matcher, words: TokenMask::words_for(self.vocab_size), prefix_left })
    }
}

/// The constraints compiled lately, by spec, so that a request's grammar compiled while it is
/// prepared (off the server's event loop) is not compiled again when it is submitted, and an
/// agent's tools, the same every turn, compile once. A hit is a copy of the parser at its start.
#[derive(Default)]
pub struct CompiledConstraints {
    entries: Mutex<(Kept, u64)>,
}

/// Each spec's parser and when it was last used (the count of uses so far, then).
type Kept = HashMap<ConstraintSpec, (Constraint, u64)>;

/// Constraints `CompiledConstraints` keeps (the least recently used goes first).
pub const COMPILED_CONSTRAINTS: usize = 64;

impl CompiledConstraints {
    /// `spec`'s parser at its start: a copy of the one kept, else compiled (outside the lock) and kept.
    pub fn get(&self, grammars: &Grammars, spec: &ConstraintSpec) -> Result<Constraint, GrammarError> {
        if let Some(hit) = self.touch(spec) {
            return Ok(hit);
        }
        let compiled = grammars.compile(spec)?;
        let mut guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let (entries, clock) = &mut *guard;
        *clock += 1;
        if entries.len() >= COMPILED_CONSTRAINTS && !entries.contains_key(spec) {
            let oldest = entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone());
            entries.remove(&oldest.expect("the cache is not empty"));
        }
        entries.insert(spec.clone(), (compiled.clone(), *clock));
        Ok(compiled)
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn touch(&self, spec: &ConstraintSpec) -> Option<Constraint> {
        let mut guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let (entries, clock) = &mut *guard;
        *clock += 1;
        let (constraint, used) = entries.get_mut(spec)?;
        *used = *clock;
        Some(constraint.clone())
    }
}

/// One request's position in its grammar.
pub struct Constraint {
    matcher: Matcher,
    words: usize,
    /// A `Prefix` constraint's bytes still to be produced.
    prefix_left: Option<usize>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self { matcher: self.matcher.deep_clone(), words: self.words, prefix_left: self.prefix_left }
    }
}

impl Constraint {
    /// The tokens allowed next into `mask` (only EOS once the grammar has ended).
    pub fn allowed(&mut self, mask: &mut TokenMask) -> Result<(), GrammarError> {
        let vob = self.matcher.compute_mask_or_eos().map_err(err)?;
        let bits = vob.as_slice();
        mask.words.clear();
        mask.words.extend_from_slice(&bits[..bits.len().min(self.words)]);
        mask.words.resize(self.words, 0);
        Ok(())
    }

    /// Advances past the sampled `token` (which `allowed` allowed).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher.consume_token(token).map_err(err)?;
        if let Some(left) = self.prefix_left {
            let bytes = self.matcher.tok_env().map_err(err)?.tok_trie().token_len(token);
            self.prefix_left = Some(left.saturating_sub(bytes));
        }
        Ok(())
    }

    /// A `Prefix` constraint whose text has been produced: it allows anything from here on, and
    /// the request drops it.
    pub fn released(&self) -> bool {
        self.prefix_left == Some(0)
    }

    /// The grammar has ended: nothing but EOS may follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Why a constraint gave no mask.
#[derive(Debug, Clone, PartialEq)]
pub enum MaskError {
    Grammar(GrammarError),
    /// The grammar engine panicked.
    Panicked,
}

/// `states[i]`'s allowed tokens into `masks[i]`, or why there are none. Several states compute at
/// once, one thread each, so a batch of constrained rows waits for about its slowest mask rather
/// than for every mask in turn (`cargo bench --bench grammar`).
pub fn allowed_all(states: &mut [&mut Constraint], masks: &mut [TokenMask]) -> Vec<Option<MaskError>> {
    fn one(c: &mut Constraint, mask: &mut TokenMask) -> Option<MaskError> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.allowed(mask))) {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(MaskError::Grammar(e)),
            Err(_) => Some(MaskError::Panicked),
        }
    }
    use rayon::prelude::*;
    if let ([c], [mask]) = (&mut *states, &mut *masks) {
        return vec![one(c, mask)];
    }
    states.par_iter_mut().zip(masks.par_iter_mut()).map(|(c, mask)| one(c, mask)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_holds_the_output_to_its_text_then_is_released() {
        let (grammars, eos) = bytes_vocab();
        let ab = |c: &mut Constraint| {
            let mut mask = TokenMask::default();
            c.allowed(&mut mask).unwrap();
            (0..300u32).filter(|&t| mask.allows(t)).collect::<Vec<_>>()
        };
        let mut c = grammars.compile(&ConstraintSpec::Prefix("ab".into())).unwrap();
        let ab_token = 256 + 4; // "ab", after "{\"", "\":", "true", "false"
        assert_eq!(ab(&mut c), [u32::from(b'a'), ab_token], "only what starts the text, no EOS");
        c.commit(u32::from(b'a')).unwrap();
        assert!(!c.released());
        assert_eq!(ab(&mut c), [u32::from(b'b')]);
        c.commit(u32::from(b'b')).unwrap();
        assert!(c.released());
        // One token covering the whole text releases it at once; the text is escaped, not read as
        // a grammar (quotes, a backslash, a newline).
        let mut c = grammars.compile(&ConstraintSpec::Prefix("ab".into())).unwrap();
        c.commit(ab_token).unwrap();
        assert!(c.released());
        let odd = "\n\"\\/*";
        let mut c = grammars.compile(&ConstraintSpec::Prefix(odd.into())).unwrap();
        for b in odd.bytes() {
            assert_eq!(ab(&mut c), [u32::from(b)]);
            assert!(!c.released());
            c.commit(u32::from(b)).unwrap();
        }
        assert!(c.released() && ab(&mut c).contains(&eos));
    }

    #[test]
    fn compiled_constraints_are_kept_as_parsers_at_their_start_least_recently_used_dropped() {
        let (grammars, eos) = bytes_vocab();
        let cache = CompiledConstraints::default();
        let ab = ConstraintSpec::Regex("ab|ba".into());
        let mut first = cache.get(&grammars, &ab).unwrap();
        // A copy advanced by one request leaves the kept parser at its start.
        first.commit(u32::from(b'a')).unwrap();
        assert_eq!(follow(&mut first, |t| -(t as i64), eos, 8), b"b");
        let mut again = cache.get(&grammars, &ab).unwrap();
        assert_eq!(follow(&mut again, |t| -(t as i64), eos, 8), b"ab");
        assert_eq!(cache.len(), 1);
        // A spec that does not compile is an error, and is not kept.
        assert!(cache.get(&grammars, &ConstraintSpec::Regex("(".into())).is_err());
        assert_eq!(cache.len(), 1);
        // Past the bound the least recently used goes: `ab`, used again just now, stays.
        for i in 0..COMPILED_CONSTRAINTS {
            cache.get(&grammars, &ConstraintSpec::Regex(format!("x{{{i}}}"))).unwrap();
            cache.get(&grammars, &ab).unwrap();
        }
        assert_eq!(cache.len(), COMPILED_CONSTRAINTS);
        assert!(cache.touch(&ab).is_some());
        assert!(cache.touch(&ConstraintSpec::Regex("x{0}".into())).is_none());
    }

    /// One token per byte (ids 0..=255), a few multi-byte ones, then EOS.
    fn bytes_vocab() -> (Grammars, u32) {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in ["{\"", "\":", "true", "false", "ab"] {
            words.push(w.as_bytes().to_vec());
        }
        let eos = words.len() as u32;
        words.push(b"\xff<eos>".to_vec());
        (Grammars::from_token_bytes(words, 300, eos).unwrap(), eos)
    }

    /// Greedy "decoding" that always takes the allowed token with the highest preference.
    fn follow(c: &mut Constraint, prefer: impl Fn(u32) -> i64, eos: u32, limit: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut mask = TokenMask::default();
        for _ in 0..limit {
            c.allowed(&mut mask).unwrap();
            let tok = (0..300u32).filter(|&t| mask.allows(t)).max_by_key(|&t| prefer(t)).expect("some token allowed");
            if tok == eos {
                return out;
            }
            c.commit(tok).unwrap();
            if tok < 256 {
                out.push(tok as u8);
            }
        }
        panic!("no EOS within {limit} tokens: {:?}", String::from_utf8_lossy(&out));
    }

    #[test]
    fn a_regex_is_followed_to_its_end_and_then_only_eos_is_allowed() {
        let (g, eos) = bytes_vocab();
        let mut c = g.compile(&ConstraintSpec::Regex("[0-9]{3}-x".into())).unwrap();
        let out = follow(&mut c, |t| t as i64, eos, 20);
        assert_eq!(out, b"999-x");
        let mut mask = TokenMask::default();
        c.allowed(&mut mask).unwrap();
        assert_eq!(mask.count(), 1);
        assert!(mask.allows(eos));
        assert_eq!(mask.words.len(), 300usize.div_ceil(32));
    }

    #[test]
    fn masks_computed_together_are_each_states_own() {
        let (g, _) = bytes_vocab();
        let specs = [
            ConstraintSpec::Regex("[0-9]{3}-x".into()),
            ConstraintSpec::JsonObject,
            ConstraintSpec::Regex("(ab|cd){3}z".into()),
            ConstraintSpec::Regex("[a-f]+".into()),
        ];
        let mut states: Vec<Constraint> = specs.iter().map(|s| g.compile(s).unwrap()).collect();
        for step in 0..3 {
            let mut together = vec![TokenMask::default(); states.len()];
            let errors = allowed_all(&mut states.iter_mut().collect::<Vec<_>>(), &mut together);
            assert!(errors.iter().all(Option::is_none), "{errors:?}");
            for (c, mask) in states.iter_mut().zip(&together) {
                let mut alone = TokenMask::default();
                c.allowed(&mut alone).unwrap();
                assert_eq!(mask.words, alone.words, "step {step}");
                let next = (0..256u32).find(|&t| mask.allows(t)).expect("a token to follow");
                c.commit(next).unwrap();
            }
        }
        assert_ne!(
            {
                let mut m = vec![TokenMask::default(); 2];
                allowed_all(&mut states.iter_mut().take(2).collect::<Vec<_>>(), &mut m);
                m[0].words.clone()
            },
            {
                let mut m = vec![TokenMask::default(); 2];
                allowed_all(&mut states.iter_mut().skip(1).take(2).collect::<Vec<_>>(), &mut m);
                m[0].words.clone()
            },
            "different grammars' masks differ (the slots are not mixed up)"
        );
    }

    #[test]
    fn a_json_schema_allows_only_conforming_output() {
        let (g, eos) = bytes_vocab();
        let schema =
            r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}"#;
        let mut c = g.compile(&ConstraintSpec::JsonSchema(schema.into())).unwrap();
        // Prefer closing the object, then digits, then anything but whitespace (which JSON allows
        // anywhere) by id: the output must still be the schema's object.
        let prefer = |t: u32| match t {
            125 => 2000,
            48..=57 => 1000,
            9 | 10 | 13 | 32 => -10_000,
            _ => -(t as i64),
        };
        let out = follow(&mut c, prefer, eos, 60);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(v["n"].is_i64(), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 1);
    }

    #[test]
    fn json_is_laid_out_like_json_dumps_unless_the_schema_says_otherwise() {
        let (g, eos) = bytes_vocab();
        let schema = r#"{"type":"object","properties":{"a":{"type":"boolean"},"b":{"type":"boolean"}},"required":["a","b"],"additionalProperties":false}"#;
        let mut c = g.compile(&ConstraintSpec::JsonSchema(schema.into())).unwrap();
        // Prefer whitespace where allowed: none is, but after ':' and ','.
        let prefer = |t: u32| match t {
            32 | 9 | 10 => 1000,
            125 => 900,
            _ => -(t as i64),
        };
        assert_eq!(String::from_utf8(follow(&mut c, prefer, eos, 40)).unwrap(), r#"{"a": false, "b": false}"#);
        let flexible = r#"{"type":"object","x-guidance":{"whitespace_flexible":true}}"#;
        let mut c = g.compile(&ConstraintSpec::JsonSchema(flexible.into())).unwrap();
        let mut mask = TokenMask::default();
        c.allowed(&mut mask).unwrap();
        c.commit(u32::from(b'{')).unwrap();
        c.allowed(&mut mask).unwrap();
        assert!(mask.allows(32), "the schema's own layout allows blanks inside the object");
    }

    #[test]
    fn json_object_rejects_a_non_object_start() {
        let (g, eos) = bytes_vocab();
        let mut c = g.compile(&ConstraintSpec::JsonObject).unwrap();
        let mut mask = TokenMask::default();
        c.allowed(&mut mask).unwrap();
        assert!(mask.allows(u32::from(b'{')) && !mask.allows(u32::from(b'[')) && !mask.allows(u32::from(b'1')));
        assert!(!mask.allows(eos));
        assert!(!mask.allows(299)); // past the tokenizer: never
        assert!(c.commit(u32::from(b'[')).is_err());
    }

    #[test]
    fn a_grammar_list_embeds_one_grammar_in_another_by_name() {
        let (g, _) = bytes_vocab();
        let list = serde_json::json!({"grammars": [
            {"name": "outer", "lark_grammar": "start: \"<\" @inner \">\""},
            {"name": "inner", "lark_grammar": "start: \"ab\" | \"cd\""},
        ]});
        let mut c = g.compile(&ConstraintSpec::Lark(list.to_string())).unwrap();
        let mut mask = TokenMask::default();
        for byte in [b'<', b'c', b'd', b'>'] {
            c.allowed(&mut mask).unwrap();
            assert!(mask.allows(u32::from(byte)), "{}", byte as char);
            assert!(!mask.allows(u32::from(b'x')));
            c.commit(u32::from(byte)).unwrap();
        }
        assert!(g.compile(&ConstraintSpec::Lark(r#"{"grammars": []}"#.into())).is_err());
    }

    #[test]
    fn bad_constraints_are_errors_that_say_why() {
        let (g, _) = bytes_vocab();
        let e = g.compile(&ConstraintSpec::JsonSchema("{not json".into())).unwrap_err();
        assert!(!e.0.is_empty());
        assert!(g.compile(&ConstraintSpec::Regex("(unclosed".into())).is_err());
        assert!(g.compile(&ConstraintSpec::Lark("start: undefined_rule".into())).is_err());
        assert!(g.compile(&ConstraintSpec::JsonSchema(r#"{"type":"nonsense"}"#.into())).is_err());
    }

    #[test]
    fn the_built_in_models_tokenizer_loads_and_constrains() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/python/mk/embedded/tokenizer.json");
        let json = std::fs::read_to_string(path).unwrap();
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/python/mk/embedded/config.json")).unwrap(),
        )
        .unwrap();
        let vocab = config["vocab_size"].as_u64().unwrap() as usize;
        let eos = config["eos_token_id"].as_u64().unwrap() as u32;
        let g = Grammars::from_tokenizer_json(&json, vocab, eos).unwrap();
        let mut c = g.compile(&ConstraintSpec::Regex("(yes|no)".into())).unwrap();
        let mut mask = TokenMask::default();
        c.allowed(&mut mask).unwrap();
        // Some tokens start "yes" or "no"; most of a code vocabulary does not, and EOS cannot yet.
        assert!(mask.count() >= 2 && mask.count() < vocab / 10, "{} allowed", mask.count());
        assert!(!mask.allows(eos));
        assert!(Grammars::from_tokenizer_json("{}", vocab, eos).is_err());
    }

    #[test]
    fn a_tokenizer_larger_than_the_model_is_refused() {
        let words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        assert!(Grammars::from_token_bytes(words.clone(), 100, 0).is_err());
        assert!(Grammars::from_token_bytes(words, 256, 256).is_err());
    }
}
