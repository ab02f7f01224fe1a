//! An in-process [`Comm`]: W ranks as threads exchanging through shared slots.
//!
//! Every collective publishes this rank's bytes (with the length it expects to receive) in its
//! slot, waits for all ranks, reads what it needs and waits again before slots are reused. An
//! all-to-all can also be started (published) and collected later
//! ([`Comm::start_all_to_all`]), so a rank computes while its peers catch up. The
//! arguments are checked across ranks after the first wait, so a mismatch makes every rank of
//! that communicator return the same error. The error also *aborts* every communicator of the
//! cluster (as `ncclCommAbort` would): ranks waiting in another communicator for a peer that
//! has already failed return an error within milliseconds instead of hanging, and every later
//! collective on the cluster fails at once. A rank that panics aborts the cluster the same way;
//! a rank that simply never arrives makes the others fail after [`LocalGroup::TIMEOUT`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use crate::collective::{
    Comm, CommGroups, InFlight, PendingExchange, SumElement, sum_in_rank_order,
};
use crate::error::{Error, Result, check_len};
use crate::layout::Topology;

/// Shared state of one in-process communicator.
#[derive(Debug)]
pub struct LocalGroup {
    size: usize,
    slots: Vec<RwLock<Slot>>,
    /// Per rank: whether it has an exchange published but not yet collected.
    in_flight: Vec<AtomicBool>,
    arrivals: Mutex<(usize, u64)>,
    all_arrived: Condvar,
    abort: Arc<AbortState>,
}

/// Shared by every communicator of a cluster: set once, by the first failure.
#[derive(Debug, Default)]
struct AbortState {
    aborted: AtomicBool,
    reason: Mutex<String>,
}

#[derive(Debug, Default)]
struct Slot {
    expect: usize,
    payload: Vec<u8>,
}

/// One rank's handle on a [`LocalGroup`].
#[derive(Debug, Clone)]
pub struct LocalComm {
    group: Arc<LocalGroup>,
    rank: usize,
}

impl LocalGroup {
    /// How long a rank waits for its peers before reporting a hang.
    pub const TIMEOUT: Duration = Duration::from_secs(120);

    /// How often a waiting rank checks whether the cluster was aborted.
    const ABORT_POLL: Duration = Duration::from_millis(20);

    /// A standalone communicator of `size` ranks.
    pub fn new(size: usize) -> Arc<Self> {
        Self::with_abort_state(size, Arc::default())
    }

    /// A communicator of `size` ranks that shares `abort` with the other communicators of
    /// its cluster.
    fn with_abort_state(size: usize, abort: Arc<AbortState>) -> Arc<Self> {
        Arc::new(Self {
            size,
            slots: (0..size).map(|_| RwLock::new(Slot::default())).collect(),
            in_flight: (0..size).map(|_| AtomicBool::new(false)).collect(),
            arrivals: Mutex::new((0, 0)),
            all_arrived: Condvar::new(),
            abort,
        })
    }

    /// Aborts every communicator of the cluster; the first reason is kept for the others.
    fn abort(&self, reason: &str) {
        if let Ok(mut kept) = self.abort.reason.lock()
            && kept.is_empty()
        {
            *kept = reason.to_string();
        }
        self.abort.aborted.store(true, Ordering::SeqCst);
    }

    fn check_not_aborted(&self) -> Result<()> {
        if !self.abort.aborted.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reason = self
            .abort
            .reason
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        Err(Error::Comm(format!(
            "aborted because a peer's collective failed: {reason}"
        )))
    }

    /// The handle of `rank`.
    pub fn comm(self: &Arc<Self>, rank: usize) -> LocalComm {
        assert!(
            rank < self.size,
            "rank {rank} of a {}-rank group",
            self.size
        );
        LocalComm {
            group: Arc::clone(self),
            rank,
        }
    }

    fn barrier(&self) -> Result<()> {
        let generation = self.arrive()?;
        self.wait_for_all(generation)
    }

    /// Counts this rank in; returns the generation to pass to [`wait_for_all`](Self::wait_for_all).
    fn arrive(&self) -> Result<u64> {
        self.check_not_aborted()?;
        let mut state = self.arrivals.lock().map_err(|_| poisoned())?;
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.size {
            *state = (0, generation + 1);
            self.all_arrived.notify_all();
        }
        Ok(generation)
    }

    /// Waits until every rank has arrived in `generation`.
    fn wait_for_all(&self, generation: u64) -> Result<()> {
        let mut state = self.arrivals.lock().map_err(|_| poisoned())?;
        let deadline = Instant::now() + Self::TIMEOUT;
        while state.1 == generation {
            self.check_not_aborted()?;
            if Instant::now() >= deadline {
                let message = format!(
                    "peers did not reach the collective within {:?} ({} of {} arrived)",
                    Self::TIMEOUT,
                    state.0,
                    self.size
                );
                drop(state);
                self.abort(&message);
                return Err(Error::Comm(message));
            }
            state = self
                .all_arrived
                .wait_timeout(state, Self::ABORT_POLL)
                .map_err(|_| poisoned())?
                .0;
        }
        Ok(())
    }
}

fn poisoned() -> Error {
    Error::Comm("a peer thread panicked inside a collective".into())
}

impl LocalComm {
    /// Publishes `send` (expecting `expect` bytes back), then runs `read` over every rank's
    /// slot once all have published.
    fn exchange<R>(
        &self,
        send: &[u8],
        expect: usize,
        read: impl FnOnce(&[RwLockReadGuard<'_, Slot>]) -> Result<R>,
    ) -> Result<R> {
        self.check_idle()?;
        let generation = self.publish(send, expect)?;
        self.collect(generation, read)
    }

    /// An error if this rank has an exchange of this communicator in flight.
    fn check_idle(&self) -> Result<()> {
        if self.group.in_flight[self.rank].load(Ordering::SeqCst) {
            return Err(Error::Comm(format!(
                "rank {}: a collective was called while an exchange of this communicator is \
                 still in flight (wait for it first)",
                self.rank
            )));
        }
        Ok(())
    }

    /// Copies `send` into this rank's slot and counts this rank in; the first half of an
    /// exchange, after which `send` is no longer needed.
    fn publish(&self, send: &[u8], expect: usize) -> Result<u64> {
        {
            let mut slot = self.group.slots[self.rank]
                .write()
                .map_err(|_| poisoned())?;
            slot.expect = expect;
            slot.payload.clear();
            slot.payload.extend_from_slice(send);
        }
        self.group.arrive()
    }

    /// The second half of an exchange published in `generation`: waits for every rank, runs
    /// `read` over the slots, then waits again before the slots may be reused.
    fn collect<R>(
        &self,
        generation: u64,
        read: impl FnOnce(&[RwLockReadGuard<'_, Slot>]) -> Result<R>,
    ) -> Result<R> {
        self.group.wait_for_all(generation)?;
        let result = {
            let slots = self
                .group
                .slots
                .iter()
                .map(|s| s.read().map_err(|_| poisoned()))
                .collect::<Result<Vec<_>>>()?;
            read(&slots)
        };
        if let Err(e) = &result {
            // Every rank of this communicator saw the same slots and fails alike; ranks of the
            // cluster waiting elsewhere for them must not hang.
            self.group.abort(&e.to_string());
            return result;
        }
        self.group.barrier()?;
        result
    }
}

/// An all-to-all of a [`LocalComm`] published but not yet collected.
struct LocalAllToAll<'a> {
    comm: &'a LocalComm,
    recv: &'a mut [u8],
    generation: u64,
}

impl PendingExchange for LocalAllToAll<'_> {
    fn complete(&mut self) -> Result<()> {
        let (comm, generation) = (self.comm, self.generation);
        let result = comm.collect(generation, |slots| {
            read_all_to_all(comm.size(), comm.rank, slots, self.recv)
        });
        comm.group.in_flight[comm.rank].store(false, Ordering::SeqCst);
        result
    }
}

/// What rank `me` of `w` receives from an all-to-all whose ranks published `slots`.
fn read_all_to_all(
    w: usize,
    me: usize,
    slots: &[RwLockReadGuard<'_, Slot>],
    recv: &mut [u8],
) -> Result<()> {
    let (n, expect) = check_sizes("all_to_all", slots)?;
    if n % w != 0 || expect != n {
        return Err(Error::Comm(format!(
            "all_to_all: {n} bytes in and {expect} out must be equal and split into {w} blocks"
        )));
    }
    let block = n / w;
    for (dst, slot) in recv.chunks_exact_mut(block.max(1)).zip(slots) {
        dst.copy_from_slice(&slot.payload[me * block..(me + 1) * block]);
    }
    Ok(())
}

/// Checks that every rank sent `send` bytes and expects `expect`, naming the first that differs.
fn check_sizes(op: &str, slots: &[RwLockReadGuard<'_, Slot>]) -> Result<(usize, usize)> {
    let (send, expect) = (slots[0].payload.len(), slots[0].expect);
    for (rank, slot) in slots.iter().enumerate() {
        if slot.payload.len() != send || slot.expect != expect {
            return Err(Error::Comm(format!(
                "{op}: rank {rank} passed {} bytes in / {} bytes out, rank 0 passed {send} / {expect}",
                slot.payload.len(),
                slot.expect
            )));
        }
    }
    Ok((send, expect))
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let w = self.size();
        self.exchange(send, recv.len(), |slots| {
            let (n, expect) = check_sizes("all_gather", slots)?;
            if expect != w * n {
                return Err(Error::Comm(format!(
                    "all_gather: receive buffer of {expect} bytes, expected {w} x {n}"
                )));
            }
            for (dst, slot) in recv.chunks_exact_mut(n.max(1)).zip(slots) {
                dst.copy_from_slice(&slot.payload);
            }
            Ok(())
        })
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (w, me) = (self.size(), self.rank);
        self.exchange(send, recv.len(), |slots| {
            read_all_to_all(w, me, slots, recv)
        })
    }

    /// Publishes `send` and returns; the peers' blocks are copied into `recv` when the
    /// exchange is waited for.
    fn start_all_to_all<'a>(&'a self, send: &'a [u8], recv: &'a mut [u8]) -> Result<InFlight<'a>> {
        self.check_idle()?;
        let generation = self.publish(send, recv.len())?;
        self.group.in_flight[self.rank].store(true, Ordering::SeqCst);
        Ok(InFlight::new(LocalAllToAll {
            comm: self,
            recv,
            generation,
        }))
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        self.exchange(&value.to_le_bytes(), 4, |slots| {
            check_sizes("all_reduce_max", slots)?;
            Ok(slots
                .iter()
                .map(|s| f32::from_le_bytes(s.payload[..4].try_into().expect("4 bytes")))
                .fold(f32::NEG_INFINITY, f32::max))
        })
    }

    fn all_reduce_max_in_place(&self, word: &mut [f32]) -> Result<()> {
        check_len("all_reduce_max word", word.len(), 1)?;
        word[0] = self.all_reduce_max(word[0])?;
        Ok(())
    }

    fn reduce_scatter_sum<T: SumElement>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let (w, me) = (self.size(), self.rank);
        let bytes: &[u8] = bytemuck::cast_slice(send);
        let expect = std::mem::size_of_val(recv);
        self.exchange(bytes, expect, |slots| {
            let (n, expect) = check_sizes("reduce_scatter", slots)?;
            if n != w * expect {
                return Err(Error::Comm(format!(
                    "reduce_scatter ({}): {n} bytes in must be {w} x the {expect} bytes out",
                    T::DTYPE
                )));
            }
            let blocks = slots
                .iter()
                .map(|slot| &slot.payload[me * expect..(me + 1) * expect]);
            sum_in_rank_order(blocks, recv, me * recv.len())?;
            Ok(())
        })
    }
}

/// Aborts a cluster when the rank thread holding it unwinds from a panic.
struct AbortOnPanic<'a>(&'a LocalGroup);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort("a rank thread panicked");
        }
    }
}

/// W ranks of a [`Topology`] as threads, with their world, intra-node and inter-node
/// communicators built once and reused by every [`run`](Self::run).
#[derive(Debug)]
pub struct LocalCluster {
    topology: Topology,
    world: Arc<LocalGroup>,
    intra: Vec<Arc<LocalGroup>>,
    inter: Vec<Arc<LocalGroup>>,
}

impl LocalCluster {
    /// Builds the communicators of `topology` (intra/inter only when nodes are equal-sized).
    pub fn new(topology: Topology) -> Self {
        let abort = Arc::new(AbortState::default());
        let group = |size| LocalGroup::with_abort_state(size, Arc::clone(&abort));
        let world = group(topology.world());
        let (intra, inter) = match topology.per_node() {
            Some(d) => (
                (0..topology.nodes()).map(|_| group(d)).collect(),
                (0..d).map(|_| group(topology.nodes())).collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        Self {
            topology,
            world,
            intra,
            inter,
        }
    }

    /// The topology the cluster was built for.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Runs `f` on every rank concurrently (one thread per rank) and returns the results in
    /// DP rank order.
    pub fn run<R: Send>(&self, f: impl Fn(&CommGroups<'_, LocalComm>) -> R + Sync) -> Vec<R> {
        let t = &self.topology;
        let comms: Vec<(LocalComm, Option<LocalComm>, Option<LocalComm>)> = (0..t.world())
            .map(|z| {
                let intra = self.intra.get(t.node_of(z)).map(|g| g.comm(t.local_of(z)));
                let inter = self.inter.get(t.local_of(z)).map(|g| g.comm(t.node_of(z)));
                (self.world.comm(z), intra, inter)
            })
            .collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .map(|(world, intra, inter)| {
                    let f = &f;
                    scope.spawn(move || {
                        let _abort_on_panic = AbortOnPanic(&world.group);
                        f(&CommGroups {
                            world,
                            intra: intra.as_ref(),
                            inter: inter.as_ref(),
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }
}
