//! The decode loop thread. Between iterations it takes the commands clients queued (submit,
//! cancel), applies them, and runs one iteration; with nothing to do it sleeps on the inbox's
//! condition variable. Clients never touch the scheduler: they only push commands and read
//! events and stats, each behind its own short lock, so a client holding the GIL never blocks
//! the loop for longer than a push.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::backend::Backend;
use super::core::Core;
use super::{Command, EngineStats, Shared};
use crate::sched::{Event, FinishReason};

pub(super) fn run<B: Backend>(shared: Arc<Shared>, mut core: Core<B>) {
    let mut out = Vec::new();
    let result = catch_unwind(AssertUnwindSafe(|| serve(&shared, &mut core, &mut out)));
    if let Err(panic) = result {
        let msg = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        // Best effort: the scheduler may be mid-update; the Python pump ends any stream left open.
        out.clear();
        let msg = format!("the engine loop stopped: {msg}");
        let _ = catch_unwind(AssertUnwindSafe(|| core.sched.end_all(FinishReason::Error, Some(&msg), &mut out)));
        publish_stats(&shared, &core);
        shared.events.push_all(&mut out);
    }
    shared.inbox.lock().unwrap_or_else(|p| p.into_inner()).closing = true;
    shared.events.close();
}

fn serve<B: Backend>(shared: &Shared, core: &mut Core<B>, out: &mut Vec<Event>) {
    let mut commands = Vec::new();
    loop {
        let closing = {
            let mut inbox = shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
            while !inbox.has_work() && !core.busy() {
                inbox = shared.wake.wait(inbox).unwrap_or_else(|p| p.into_inner());
            }
            inbox.take(&mut commands);
            inbox.closing
        };
        let mut rejected = 0;
        for cmd in commands.drain(..) {
            match cmd {
                Command::Submit(req, seed) => {
                    let id = req.id;
                    if let Err(e) = core.sched.submit(*req, seed) {
                        rejected += 1;
                        out.push(Event::ended(id, FinishReason::Error, Some(e.to_string())));
                    }
                }
                Command::Cancel(id) => {
                    core.sched.cancel(id, out);
                }
                Command::CancelAll => core.sched.end_all(FinishReason::Cancelled, None, out),
            }
        }
        if closing {
            core.sched.end_all(FinishReason::Cancelled, None, out);
        } else if core.busy() {
            core.step_with(out, |core, out| {
                publish_stats(shared, core);
                shared.events.push_all(out);
            });
        }
        let left = core.sched.take_dequeued() + rejected;
        shared.pending.fetch_sub(left, Ordering::AcqRel);
        // Stats first: a client that has seen an event then reads stats at least that new.
        publish_stats(shared, core);
        shared.events.push_all(out);
        if closing {
            return;
        }
    }
}

fn publish_stats<B>(shared: &Shared, core: &Core<B>) {
    let stats = EngineStats { sched: core.sched.stats(), kv: core.sched.kv_stats(), metrics: core.metrics };
    *shared.stats.lock().unwrap_or_else(|p| p.into_inner()) = stats;
}
