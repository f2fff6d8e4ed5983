//! Whole-scheduler invariants, for tests and the engine's `check_invariants` mode: the KV manager
//! is consistent, the dense page table equals a fresh rewrite, and every sequence's state agrees
//! with the blocks it holds.

use super::{Phase, Scheduler};

impl Scheduler {
    pub fn check(&self) -> Result<(), String> {
        self.kv.check()?;
        let rows: Vec<Option<u64>> = self.rows.iter().map(|s| s.as_ref().map(|s| s.id)).collect();
        let mut fresh = vec![0; self.table.data().len()];
        self.kv.write_page_table(&rows, self.table.max_pages(), &mut fresh).map_err(|e| e.to_string())?;
        if fresh != self.table.data() {
            return Err("the dense page table differs from the sequences' block tables".into());
        }
        let live = self.rows.iter().filter(|s| s.is_some()).count();
        if live != self.order.len() || self.kv.stats().sequences != live {
            return Err(format!(
                "{live} rows, {} in order, {} KV sequences",
                self.order.len(),
                self.kv.stats().sequences
            ));
        }
        let mut last = None;
        for &row in &self.order {
            let seq = self.rows[row].as_ref().ok_or_else(|| format!("row {row} is ordered but empty"))?;
            if last.is_some_and(|a| a >= seq.arrival) {
                return Err(format!("row {row} breaks arrival order"));
            }
            last = Some(seq.arrival);
            let len = self.kv.len(seq.id).map_err(|e| e.to_string())?;
            let ok = match seq.phase {
                // (mapped past `computed`: a layer-sliced prefill call in progress, or dropped)
                Phase::Prefill { target } => seq.computed <= len && len <= target && seq.computed < target,
                Phase::Decode => len == seq.computed + seq.in_flight && seq.computed + 1 == seq.tokens.len(),
                Phase::Waiting => false,
            };
            if !ok {
                return Err(format!(
                    "request {}: phase {:?}, {} computed, {} tokens, {len} mapped",
                    seq.id,
                    seq.phase,
                    seq.computed,
                    seq.tokens.len()
                ));
            }
        }
        if let (Some(first), Some(&row)) = (self.waiting.front(), self.order.last()) {
            if self.rows[row].as_ref().is_some_and(|s| s.arrival >= first.arrival) {
                return Err("a waiting request arrived before a live one".into());
            }
        }
        if self.waiting.iter().zip(self.waiting.iter().skip(1)).any(|(a, b)| a.arrival >= b.arrival) {
            return Err("the queue is out of arrival order".into());
        }
        let ids = self.order.iter().filter_map(|&r| self.rows[r].as_ref()).chain(&self.waiting).map(|s| s.id);
        if ids.clone().count() != self.known.len() || ids.into_iter().any(|id| !self.known.contains(&id)) {
            return Err("the set of known ids differs from the live and waiting requests".into());
        }
        if self.waiting.iter().any(|s| s.phase != Phase::Waiting || s.computed != 0) {
            return Err("a waiting request holds state".into());
        }
        Ok(())
    }
}
