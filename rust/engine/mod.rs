//! The engine: a Rust thread that owns the scheduler, the KV accounting and a `Backend`,
//! and runs the decode loop; clients talk to it only through `Engine` (commands in, events out).

pub mod backend;
pub mod core;
pub mod events;
pub mod megakernel;
pub mod noop;
pub mod sampling_backend;
mod worker;

#[cfg(test)]
mod mock;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use self::core::{Core, LoopMetrics};
pub use backend::{
    Backend, BackendError, DecodeInput, LaunchTimes, LayerSlice, PrefillChunkInput, PrefillInput, PrefillResult,
    QueuedDecoder,
};
pub use events::EventQueue;
pub use noop::NoopBackend;
pub use sampling_backend::{LogitsModel, SamplingBackend};

use crate::kv::{KvConfig, KvStats};
use crate::sched::{Event, Request, RequestId, SchedConfig, SchedError, SchedStats, Scheduler, SubmitError};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub sched: SchedConfig,
    pub kv: KvConfig,
    /// Requests submitted but not yet admitted before `submit` says the engine is full.
    pub max_waiting: usize,
    /// Check every scheduler invariant after every iteration (tests).
    pub check_invariants: bool,
    /// Launch each decode step before the previous one lands (`core` module docs).
    pub launch_ahead: bool,
    /// While a sequence decodes, prefill whole chunks a few layers an iteration (`core` module
    /// docs); the backend must take `LayerSlice`s.
    pub sliced_prefill: bool,
    /// With `sliced_prefill`: a call of one chunk of at most this many tokens is not sliced
    /// (`Core::whole_chunk_tokens`); 0: none.
    pub whole_chunk_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] SchedError),
    #[error(transparent)]
    Rejected(#[from] SubmitError),
    #[error("{0} requests are already waiting")]
    QueueFull(usize),
    #[error("the engine is shut down")]
    Closed,
    #[error("could not start the engine thread: {0}")]
    Spawn(String),
}

/// A snapshot, refreshed by the loop after every iteration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub sched: SchedStats,
    pub kv: KvStats,
    pub metrics: LoopMetrics,
}

enum Command {
    Submit(Box<Request>, u64),
    Cancel(RequestId),
    CancelAll,
}

struct Inbox {
    commands: Vec<Command>,
    closing: bool,
    /// Open holds (`Engine::hold`): while any is, submissions stay here, so that the ones made
    /// under a hold reach the scheduler in one iteration.
    holds: usize,
}

impl Inbox {
    /// The commands the loop may apply now: all of them, or while held all but the submissions
    /// that no later cancel names (a cancel acts at once, on its request too; a closing engine
    /// takes everything).
    fn take(&mut self, into: &mut Vec<Command>) {
        if self.holds == 0 || self.closing {
            std::mem::swap(into, &mut self.commands);
            return;
        }
        if self.commands.iter().all(|c| matches!(c, Command::Submit(..))) {
            return; // nothing but held submissions: no allocation per iteration
        }
        let (mut all, mut named) = (false, Vec::new());
        let mut held = vec![false; self.commands.len()];
        for (k, c) in self.commands.iter().enumerate().rev() {
            match c {
                Command::Submit(req, _) => held[k] = !all && !named.contains(&req.id),
                Command::Cancel(id) => named.push(*id),
                Command::CancelAll => all = true,
            }
        }
        let mut keep = held.into_iter();
        let (stay, now): (Vec<_>, Vec<_>) = self.commands.drain(..).partition(|_| keep.next().unwrap());
        self.commands = stay;
        *into = now;
    }

    /// Whether `take` would give the loop anything to do.
    fn has_work(&self) -> bool {
        self.closing || self.commands.iter().any(|c| self.holds == 0 || !matches!(c, Command::Submit(..)))
    }
}

struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    events: EventQueue,
    pending: AtomicUsize,
    stats: Mutex<EngineStats>,
}

pub struct Engine {
    cfg: SchedConfig,
    max_waiting: usize,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Validates the configuration and starts the loop thread over `backend`.
    pub fn start<B: Backend + 'static>(config: EngineConfig, backend: B) -> Result<Self, EngineError> {
        let layers = config.kv.sliding.len();
        let sched = Scheduler::new(config.sched.clone(), config.kv)?;
        let mut core = Core::new(sched, backend);
        core.check_invariants = config.check_invariants;
        core.launch_ahead = config.launch_ahead;
        core.layer_slices = config.sliced_prefill.then_some(layers);
        core.whole_chunk_tokens = config.whole_chunk_tokens;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox { commands: Vec::new(), closing: false, holds: 0 }),
            wake: Condvar::new(),
            events: EventQueue::new(),
            pending: AtomicUsize::new(0),
            stats: Mutex::new(EngineStats::default()),
        });
        *shared.stats.lock().unwrap() =
            EngineStats { sched: core.sched.stats(), kv: core.sched.kv_stats(), metrics: core.metrics };
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("mk-decode-loop".into())
                .spawn(move || worker::run(shared, core))
                .map_err(|e| EngineError::Spawn(e.to_string()))?
        };
        Ok(Self { cfg: config.sched, max_waiting: config.max_waiting, shared, thread: Mutex::new(Some(thread)) })
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Queues a request; never waits for the loop. Requests without a seed get a random one.
    pub fn submit(&self, req: Request) -> Result<(), EngineError> {
        Scheduler::check_request(&self.cfg, &req)?;
        let seed = random_seed();
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        if inbox.closing {
            return Err(EngineError::Closed);
        }
        let pending = self.shared.pending.load(Ordering::Acquire);
        if pending >= self.max_waiting {
            return Err(EngineError::QueueFull(pending));
        }
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        inbox.commands.push(Command::Submit(Box::new(req), seed));
        drop(inbox);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Keeps every later submission, from any client, from the scheduler until the last
    /// `release`: requests submitted under a hold start in one iteration, so their prefill chunks
    /// and decode batches do not depend on when each submission met the loop thread. Holds nest;
    /// cancels act at once. A held request's queue time counts from the release.
    pub fn hold(&self) {
        self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner()).holds += 1;
    }

    /// Ends one `hold`; when none is left, the held submissions go to the scheduler together.
    pub fn release(&self) {
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.holds = inbox.holds.saturating_sub(1);
        drop(inbox);
        self.shared.wake.notify_one();
    }

    /// Ends request `id` (if still running) within one iteration, freeing its blocks.
    pub fn cancel(&self, id: RequestId) {
        self.command(Command::Cancel(id));
    }

    pub fn cancel_all(&self) {
        self.command(Command::CancelAll);
    }

    fn command(&self, cmd: Command) {
        let mut inbox = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        if !inbox.closing {
            inbox.commands.push(cmd);
        }
        drop(inbox);
        self.shared.wake.notify_one();
    }

    /// Events queued since the last call, waiting up to `timeout` for one. Empty on timeout;
    /// None once the engine has stopped and every event was taken.
    pub fn next_events(&self, timeout: Duration) -> Option<Vec<Event>> {
        self.shared.events.wait(timeout)
    }

    pub fn stats(&self) -> EngineStats {
        *self.shared.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the loop thread is still running.
    pub fn is_running(&self) -> bool {
        self.thread.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Cancels everything, stops the loop and waits for it. Idempotent.
    pub fn shutdown(&self) {
        self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner()).closing = true;
        self.shared.wake.notify_one();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A fresh 64-bit seed: the process-random keys of std's hasher over a counter and the clock.
pub fn random_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}
