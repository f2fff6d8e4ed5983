//! Property tests: random admit / grow / publish / release sequences on small pools, with shared
//! prompt families so prefix hits and evictions happen, checked after every step against the
//! manager's invariants and against a shadow model of what each block holds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::pool::Allocation;
use super::prefix::cacheable_pages;
use super::*;

const SLOTS: usize = 5;

#[derive(Debug, Clone)]
enum Op {
    /// Admit a prompt of `len` tokens from `family`, diverging from the family at `fork`, then
    /// prefill it in one chunk (if blocks allow).
    Admit {
        slot: usize,
        family: u32,
        len: usize,
        fork: Option<usize>,
    },
    Grow {
        slot: usize,
        by: usize,
    },
    Publish {
        slot: usize,
    },
    /// A verification step of speculative decoding: grow by `by`, then keep `keep` <= `by`.
    Verify {
        slot: usize,
        by: usize,
        keep: usize,
    },
    Release {
        slot: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS;
    prop_oneof![
        3 => (slot.clone(), 0..2u32, 0..40usize, proptest::option::weighted(0.3, 0..40usize))
            .prop_map(|(slot, family, len, fork)| Op::Admit { slot, family, len, fork }),
        5 => slot.clone().prop_map(|slot| Op::Grow { slot, by: 1 }),
        2 => (slot.clone(), 1..24usize).prop_map(|(slot, by)| Op::Grow { slot, by }),
        2 => slot.clone().prop_map(|slot| Op::Publish { slot }),
        2 => (slot.clone(), 1..12usize, 0..12usize).prop_map(|(slot, by, keep)| Op::Verify { slot, by, keep: keep.min(by) }),
        2 => slot.prop_map(|slot| Op::Release { slot }),
    ]
}

fn config() -> impl Strategy<Value = KvConfig> {
    (prop_oneof![Just(2usize), Just(4)], 1..14usize, proptest::collection::vec(any::<bool>(), 1..5), 4..64usize)
        .prop_map(|(page_size, window, sliding, num_blocks)| KvConfig {
            sliding,
            window,
            page_size,
            num_blocks,
            salt: b"proptest".to_vec(),
        })
}

/// A live sequence in the shadow model. Its tokens are a pure function of position, so the
/// "generated" ones of two sequences of one family agree, as greedy decoding would.
#[derive(Debug, Clone)]
struct Live {
    id: SeqId,
    family: u32,
    fork: Option<usize>,
    attached_pages: usize,
}

impl Live {
    fn token(&self, i: usize) -> u32 {
        match self.fork {
            Some(f) if i >= f => 1_000_000 + self.id as u32 * 1000 + i as u32,
            _ => self.family * 100_000 + i as u32,
        }
    }

    fn tokens(&self, n: usize) -> Vec<u32> {
        (0..n).map(|i| self.token(i)).collect()
    }
}

/// Oracle of the window rule, written out independently of `KvGeometry::keep_from`: a query at `q`
/// sees [q−W+1, q], so a sliding layer needs page j iff the page ends after q−W.
fn sees(geom: &KvGeometry, q: usize, page: usize) -> bool {
    ((page + 1) * geom.page()) as i64 - 1 > q as i64 - geom.window() as i64
}

fn digest(tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

struct Sim {
    kv: KvManager,
    slots: Vec<Option<Live>>,
    /// What each block holds once its page is full: (layer, digest of the prefix through it).
    content: HashMap<BlockId, (usize, u64)>,
    next_id: SeqId,
}

impl Sim {
    fn page(&self) -> usize {
        self.kv.geometry().page()
    }

    fn run(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Admit { slot, family, len, fork } => self.admit(slot, family, len, fork)?,
            Op::Grow { slot, by } => {
                if let Some(live) = &self.slots[slot] {
                    let len = self.kv.len(live.id).unwrap();
                    self.grow(slot, len + by)?;
                } else {
                    prop_assert_eq!(self.kv.grow(999, by), Err(KvError::UnknownSequence(999)));
                }
            }
            Op::Publish { slot } => self.publish(slot)?,
            Op::Verify { slot, by, keep } => self.verify(slot, by, keep)?,
            Op::Release { slot } => match self.slots[slot].take() {
                Some(live) => self.kv.release(live.id).map_err(|e| TestCaseError::fail(e.to_string()))?,
                None => prop_assert_eq!(self.kv.release(999), Err(KvError::UnknownSequence(999))),
            },
        }
        self.kv.check().map_err(TestCaseError::fail)?;
        self.check_sharing()
    }

    fn admit(&mut self, slot: usize, family: u32, len: usize, fork: Option<usize>) -> Result<(), TestCaseError> {
        if let Some(live) = &self.slots[slot] {
            let before = self.kv.stats();
            prop_assert_eq!(self.kv.admit(live.id, &[]), Err(KvError::DuplicateSequence(live.id)));
            prop_assert_eq!(self.kv.stats(), before);
            return Ok(());
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut live = Live { id, family, fork, attached_pages: 0 };
        let prompt = live.tokens(len);
        let page = self.page();
        let peeked = self.kv.cached_len(&prompt);
        let attached = self.kv.admit(id, &prompt).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(attached, peeked);
        prop_assert_eq!(attached % page, 0);
        prop_assert!(attached <= cacheable_pages(len, page) * page, "attached {} of {}", attached, len);
        let geom = self.kv.geometry().clone();
        let table = self.kv.block_table(id).unwrap();
        prop_assert_eq!(table.len(), attached);
        for (l, j, b) in table.blocks() {
            // Attached K/V must be exactly this prompt's prefix at this layer.
            let expect = (l, digest(&prompt[..(j + 1) * page]));
            prop_assert_eq!(self.content.get(&b), Some(&expect), "block {} at layer {} page {}", b, l, j);
        }
        let pages = attached / page;
        for l in 0..geom.num_layers() {
            for j in 0..pages {
                let want = !geom.is_sliding(l) || sees(&geom, attached, j);
                prop_assert_eq!(table.block(l, j).is_some(), want, "layer {} page {}", l, j);
            }
        }
        live.attached_pages = attached / page;
        self.slots[slot] = Some(live);
        if len > attached {
            self.grow(slot, len)?;
        }
        Ok(())
    }

    fn verify(&mut self, slot: usize, by: usize, keep: usize) -> Result<(), TestCaseError> {
        let Some(live) = self.slots[slot].clone() else {
            prop_assert_eq!(self.kv.rewind(999, 0), Err(KvError::UnknownSequence(999)));
            return Ok(());
        };
        let len = self.kv.len(live.id).unwrap();
        self.grow(slot, len + by)?;
        if self.kv.len(live.id).unwrap() != len + by {
            return Ok(()); // out of blocks: nothing was mapped
        }
        let (before, free) = (self.kv.block_table(live.id).unwrap().clone(), self.kv.free_blocks());
        let changed = self.kv.rewind(live.id, len + keep).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let geom = self.kv.geometry().clone();
        let table = self.kv.block_table(live.id).unwrap();
        prop_assert_eq!(table.len(), len + keep);
        let (kept, dropped) = (geom.pages_for(len + keep), geom.pages_for(len + by) - geom.pages_for(len + keep));
        prop_assert_eq!(changed, dropped > 0);
        for l in 0..geom.num_layers() {
            prop_assert_eq!(table.row(l).unwrap(), &before.row(l).unwrap()[..kept], "layer {}", l);
        }
        let released = dropped * geom.num_layers();
        prop_assert_eq!(self.kv.free_blocks(), free + released);
        Ok(())
    }

    fn grow(&mut self, slot: usize, new_len: usize) -> Result<(), TestCaseError> {
        let live = self.slots[slot].clone().unwrap();
        let before = self.kv.clone();
        let old = before.len(live.id).unwrap();
        match self.kv.grow(live.id, new_len) {
            Ok(changed) => {
                let (a, b) = (self.kv.block_table(live.id).unwrap(), before.block_table(live.id).unwrap());
                let same = (0..a.num_layers()).all(|l| a.row(l) == b.row(l));
                prop_assert_eq!(changed, !same, "grow reported changed = {}", changed);
            }
            Err(KvError::OutOfBlocks { needed, free }) => {
                prop_assert!(needed > free);
                prop_assert!(needed > before.free_blocks());
                prop_assert_eq!(self.kv.block_table(live.id), before.block_table(live.id));
                prop_assert_eq!(self.kv.stats(), before.stats());
                prop_assert!(self.kv.pool().free_list().eq(before.pool().free_list()));
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        }
        let geom = self.kv.geometry().clone();
        let page = geom.page();
        let old_blocks: HashSet<BlockId> = before.block_table(live.id).unwrap().blocks().map(|x| x.2).collect();
        let table = self.kv.block_table(live.id).unwrap();
        prop_assert_eq!(table.len(), new_len);
        // Freshly handed-out blocks hold nothing yet (a stale prefix entry would still point here).
        for (_, _, b) in table.blocks() {
            if !old_blocks.contains(&b) {
                self.content.remove(&b);
            }
        }
        let tokens = live.tokens(new_len);
        for (l, j, b) in table.blocks().filter(|&(_, j, _)| (j + 1) * page <= new_len) {
            let expect = (l, digest(&tokens[..(j + 1) * page]));
            let shared = self.kv.pool().refcount(b).unwrap() > 1;
            if j < live.attached_pages || shared {
                prop_assert_eq!(self.content.get(&b), Some(&expect), "shared block {} clobbered", b);
            } else {
                self.content.insert(b, expect);
            }
        }
        for l in (0..geom.num_layers()).filter(|&l| geom.is_sliding(l)) {
            for j in 0..geom.pages_for(new_len) {
                prop_assert_eq!(table.block(l, j).is_some(), sees(&geom, old, j), "layer {} page {}", l, j);
            }
            prop_assert!(table.mapped(l) <= geom.span_pages(geom.window() + (new_len - old) - 1));
            if new_len == old + 1 {
                prop_assert!(table.mapped(l) <= geom.window_pages(), "layer {} holds {}", l, table.mapped(l));
            }
        }
        for l in (0..geom.num_layers()).filter(|&l| !geom.is_sliding(l)) {
            prop_assert_eq!(table.mapped(l), geom.pages_for(new_len));
        }
        Ok(())
    }

    fn publish(&mut self, slot: usize) -> Result<(), TestCaseError> {
        let Some(live) = self.slots[slot].clone() else {
            prop_assert_eq!(self.kv.publish(999, &[1, 2, 3]), Err(KvError::UnknownSequence(999)));
            return Ok(());
        };
        let geom = self.kv.geometry().clone();
        let page = geom.page();
        let len = self.kv.len(live.id).unwrap();
        let tokens = live.tokens(len);
        self.kv.publish(live.id, &tokens).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Every prefix whose blocks this sequence holds is now attachable: the pages its first
        // recomputed query needs on every layer, and some block of each earlier page (an entry
        // lives while it holds a block; only a model without full layers can lack one).
        let table = self.kv.block_table(live.id).unwrap();
        let max = cacheable_pages(len, page).min(len / page);
        let held = |l: usize, from: usize, n: usize| (from..n).all(|j| table.block(l, j).is_some());
        let own = (0..=max)
            .rev()
            .find(|&n| {
                let keep = geom.keep_from(n * page);
                (0..geom.num_layers()).all(|l| held(l, if geom.is_sliding(l) { keep } else { 0 }, n))
                    && (0..n).all(|j| (0..geom.num_layers()).any(|l| table.block(l, j).is_some()))
            })
            .unwrap_or(0);
        prop_assert!(self.kv.cached_len(&tokens) >= own * page, "own prefix of {} pages not attachable", own);
        Ok(())
    }

    /// Blocks held by several live sequences sit at one (layer, page) and those sequences agree
    /// on every token through that page.
    fn check_sharing(&self) -> Result<(), TestCaseError> {
        let page = self.page();
        let mut seen: HashMap<BlockId, (usize, Vec<u32>)> = HashMap::new();
        for live in self.slots.iter().flatten() {
            for (_, j, b) in self.kv.block_table(live.id).unwrap().blocks() {
                let through = live.tokens((j + 1) * page);
                if let Some((_, other)) = seen.get(&b) {
                    prop_assert_eq!(other, &through, "block {} shared by different prefixes", b);
                } else {
                    seen.insert(b, (j, through));
                }
            }
        }
        Ok(())
    }
}

/// Runs `ops`, checking after each, then drains the manager and checks it is back to empty.
fn run_workload(cfg: KvConfig, ops: &[Op]) -> Result<(), TestCaseError> {
    let total = cfg.num_blocks;
    let mut sim =
        Sim { kv: KvManager::new(cfg).unwrap(), slots: vec![None; SLOTS], content: HashMap::new(), next_id: 0 };
    for op in ops {
        sim.run(op)?;
    }
    let s = sim.kv.stats();
    prop_assert!(s.hits <= s.lookups && s.hit_tokens <= s.lookup_tokens);
    let live = (0..total as BlockId).filter(|&b| sim.kv.pool().refcount(b) != Ok(0)).count();
    prop_assert_eq!(s.free_blocks + live, total);
    for slot in 0..SLOTS {
        sim.run(&Op::Release { slot })?;
    }
    let s = sim.kv.stats();
    prop_assert_eq!((s.free_blocks, s.sequences), (total, 0));
    prop_assert_eq!(s.cached_free_blocks, s.cached_blocks);
    Ok(())
}

fn cfg(sliding: &[bool], window: usize, page_size: usize, num_blocks: usize) -> KvConfig {
    KvConfig { sliding: sliding.to_vec(), window, page_size, num_blocks, salt: b"proptest".to_vec() }
}

/// Shrunk from a failure: on a model without full layers, a page that slid out everywhere has
/// no entry, so a prefix through it is not attachable (and the test must not expect it).
#[test]
fn regression_all_sliding_prefix_through_a_vanished_page() {
    let ops =
        [Op::Admit { slot: 4, family: 0, len: 2, fork: None }, Op::Grow { slot: 4, by: 1 }, Op::Publish { slot: 4 }];
    run_workload(cfg(&[true], 1, 2, 4), &ops).unwrap();
}

/// Shrunk from a failure: an attached table omits the sliding page that only its (never
/// computed) last attached position would have seen.
#[test]
fn regression_attached_table_starts_at_the_next_querys_window() {
    let ops = [
        Op::Admit { slot: 4, family: 0, len: 0, fork: None },
        Op::Grow { slot: 4, by: 5 },
        Op::Publish { slot: 4 },
        Op::Admit { slot: 0, family: 0, len: 13, fork: None },
    ];
    run_workload(cfg(&[false, false, true], 3, 2, 21), &ops).unwrap();
}

proptest! {
    // No regression files: a failure prints its shrunk input, which belongs in a named test.
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_every_invariant(cfg in config(), ops in proptest::collection::vec(op(), 1..80)) {
        run_workload(cfg, &ops)?;
    }

    /// The pool against a plain model: refcounts, LRU reuse order, double frees as errors.
    #[test]
    fn pool_matches_a_plain_model(n in 0..12usize, ops in proptest::collection::vec((0..3u8, 0..14u32), 0..120)) {
        let mut pool = BlockPool::new(n).unwrap();
        let mut refs = vec![0u32; n];
        let mut lru: VecDeque<u32> = (0..n as u32).collect();
        for (kind, b) in ops {
            match kind {
                0 => match lru.pop_front() {
                    Some(want) => {
                        prop_assert_eq!(pool.allocate().unwrap(), Allocation { block: want, evicted: None });
                        refs[want as usize] = 1;
                    }
                    None => prop_assert!(pool.allocate().is_err()),
                },
                1 => {
                    let got = pool.retain(b);
                    if (b as usize) < n {
                        prop_assert!(got.is_ok());
                        if refs[b as usize] == 0 {
                            lru.retain(|&x| x != b);
                        }
                        refs[b as usize] += 1;
                    } else {
                        prop_assert!(got.is_err());
                    }
                }
                _ => {
                    let got = pool.release(b);
                    match refs.get(b as usize) {
                        None => prop_assert!(got.is_err()),
                        Some(0) => prop_assert_eq!(got, Err(KvError::DoubleFree(b))),
                        Some(&r) => {
                            prop_assert_eq!(got, Ok(r == 1));
                            refs[b as usize] -= 1;
                            if r == 1 {
                                lru.push_back(b);
                            }
                        }
                    }
                }
            }
            pool.check().map_err(TestCaseError::fail)?;
            prop_assert!(pool.free_list().eq(lru.iter().copied()));
        }
    }
}
