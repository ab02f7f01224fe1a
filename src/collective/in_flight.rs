//! Exchanges in flight: what [`Comm::start_all_to_all`](super::Comm::start_all_to_all)
//! returns, so that the chunk loop can compute while a chunk travels.

use crate::backend::cuda::DeviceExchange;
use crate::error::Result;

/// What a [`Comm`](super::Comm) implementation keeps of an exchange it has started: a host
/// communicator's pending work, or (on a device) the event its exchange stream records.
pub trait PendingExchange {
    /// Completes the exchange and returns its result. Called once. On the host it blocks until
    /// the receive buffer holds the result and the buffers may be reused; on a device it
    /// orders the compute stream after the exchange, so that holds for every pass enqueued
    /// later (and for the work that reuses the buffers once the collective has given them back
    /// in the compute stream's order, `Backend::call_buffer`), and returns at once (an error of
    /// the exchange then surfaces on the stream). An implementation that cannot order the
    /// compute stream waits for the exchange on the host before it returns its error.
    fn complete(&mut self) -> Result<()>;
}

/// An exchange that may still be running, holding the borrows of its buffers until it has
/// completed. [`wait`](Self::wait) completes it; dropping it unfinished (a caller returning
/// early with another error) also waits, discarding the result, so that no exchange ever
/// outlives the buffers it reads and writes.
#[must_use = "an exchange in flight must be waited for"]
pub struct InFlight<'a> {
    pending: Option<Box<dyn PendingExchange + 'a>>,
}

/// A device exchange on a side stream completes by ordering the compute stream after it: the
/// host does not wait.
impl PendingExchange for DeviceExchange {
    fn complete(&mut self) -> Result<()> {
        DeviceExchange::complete(self)
    }
}

impl<'a> InFlight<'a> {
    /// An exchange that has already completed (communicators without asynchronous exchanges).
    pub fn completed() -> Self {
        Self { pending: None }
    }

    /// An exchange that completes when `pending` does.
    pub fn new(pending: impl PendingExchange + 'a) -> Self {
        Self {
            pending: Some(Box::new(pending)),
        }
    }

    /// Blocks until the exchange has completed; its result.
    pub fn wait(mut self) -> Result<()> {
        match self.pending.take() {
            Some(mut pending) => pending.complete(),
            None => Ok(()),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(mut pending) = self.pending.take() {
            // The caller is already returning another error; this one would only repeat or
            // follow from it.
            let _ = pending.complete();
        }
    }
}

impl std::fmt::Debug for InFlight<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.pending.is_some() {
            "running"
        } else {
            "completed"
        };
        f.debug_struct("InFlight").field("state", &state).finish()
    }
}
