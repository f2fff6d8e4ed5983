//! The loop → client channel: the loop appends a whole iteration's events under one lock; one
//! consumer (the Python pump thread, with the GIL released) takes everything queued at once.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::sched::Event;

#[derive(Default)]
pub struct EventQueue {
    inner: Mutex<Inner>,
    ready: Condvar,
}

#[derive(Default)]
struct Inner {
    events: VecDeque<Event>,
    closed: bool,
}

impl EventQueue {
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves `events` into the queue (leaving it empty) and wakes the consumer.
    pub fn push_all(&self, events: &mut Vec<Event>) {
        if events.is_empty() {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.events.extend(events.drain(..));
        drop(inner);
        self.ready.notify_all();
    }

    /// No more events will come (the loop has stopped).
    pub fn close(&self) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.ready.notify_all();
    }

    /// Everything queued, waiting up to `timeout` for something to arrive. An empty Vec means
    /// the wait timed out; None means the queue is closed and drained.
    pub fn wait(&self, timeout: Duration) -> Option<Vec<Event>> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (mut inner, _) = self
            .ready
            .wait_timeout_while(guard, timeout, |i| i.events.is_empty() && !i.closed)
            .unwrap_or_else(|p| p.into_inner());
        if inner.events.is_empty() && inner.closed {
            return None;
        }
        Some(inner.events.drain(..).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::FinishReason;
    use std::sync::Arc;

    #[test]
    fn batches_arrive_in_order_and_close_drains_first() {
        let q = Arc::new(EventQueue::new());
        assert_eq!(q.wait(Duration::from_millis(1)), Some(vec![]));
        let producer = {
            let q = q.clone();
            std::thread::spawn(move || {
                for id in 0..100 {
                    q.push_all(&mut vec![Event { id, token: Some(1), ..Event::default() }]);
                }
                q.push_all(&mut vec![Event::ended(100, FinishReason::Stop, None)]);
                q.close();
            })
        };
        let mut got = Vec::new();
        while let Some(batch) = q.wait(Duration::from_secs(5)) {
            got.extend(batch);
        }
        producer.join().unwrap();
        assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), (0..=100).collect::<Vec<_>>());
        assert_eq!(q.wait(Duration::ZERO), None);
    }
}
