//! The gradient reduce-scatter of one bucket (docs/numerics.md §7.1, §7.2, §7.4).

use crate::backend::cpu::Host;
use crate::backend::cuda::abi::overflow_from_status;
use half::bf16;

use crate::backend::{Backend, Element, GradElement};
use crate::codec::int_code::IntCode;
use crate::collective::phases::{CollectiveKind, Phase, PhaseClock, PhaseLog};
use crate::collective::{Comm, CommGroups, InFlight, SumElement, WireBytes, sum_overflow};
use crate::config::{Config, GradCodec, Rounding};
use crate::error::{Error, Result, check_len};
use crate::layout::{BucketPlan, GradLayout, GradRoute, Level, Topology, peer_index};
use crate::rng::{Stage, UniformStream, stream_id};

/// Reduce-scatters one gradient bucket (fp32 or bf16, [`BucketElement`]) with the configured
/// codec: after [`run`](Self::run) this rank's shard holds the sum over ranks (within the
/// codec's error).
///
/// Routes: W == 1 copies; the `none` codec and steps before `grad_quant_start_step` use the
/// communicator's fp32 reduce-scatter; grouped codecs quantize once into the swizzled layout
/// and run one or two all-to-all levels per pipeline chunk; Global-QSGD all-reduces the absmax
/// and reduce-scatters integers.
///
/// `B` is where the buckets live: host memory ([`new`](GradReduceScatter::new),
/// [`run`](GradReduceScatter::run)) or any other [`Backend`]
/// ([`with_backend`](Self::with_backend), [`run_on`](Self::run_on)).
#[derive(Debug)]
pub struct GradReduceScatter<B: Backend = Host> {
    config: Config,
    topology: Topology,
    rank: usize,
    bucket_id: u32,
    plan: BucketPlan,
    route: GradRoute,
    engine: Engine<B>,
    phase_log: Option<PhaseLog>,
}

#[derive(Debug)]
enum Engine<B: Backend> {
    Copy,
    Exact,
    Grouped(Box<Grouped<B>>),
    Global(Global<B>),
}

/// What a grouped codec's bucket keeps: its layout and the backend's tables of it. The
/// exchange buffers are taken per call ([`ExchangeBuffers`]).
#[derive(Debug)]
struct Grouped<B: Backend> {
    layout: GradLayout,
    tables: B::GradTables,
}

/// The buffers of one call's exchanges, taken from the backend ([`Backend::call_buffer`])
/// when the call starts and dropped once its last pass is enqueued.
#[derive(Debug)]
struct ExchangeBuffers<B: Backend> {
    send_first: FirstSend<B>,
    /// Two of each exchange's buffers, used by alternate chunks (chunk `p` in `[p % 2]`), so
    /// that one chunk's exchange runs while its neighbour is computed; the second is empty
    /// when P = 1.
    recv_first: [B::Buffer<u8>; 2],
    send_second: [B::Buffer<u8>; 2],
    recv_second: [B::Buffer<u8>; 2],
}

impl<B: Backend> ExchangeBuffers<B> {
    /// The buffers of `layout`'s exchanges.
    fn take(backend: &B, layout: &GradLayout) -> Result<Self> {
        let first = layout.first.peers * layout.first.slab.byte_len();
        let second = layout.second.map_or(0, |s| s.peers * s.slab.byte_len());
        let chunks = layout.bucket.chunks;
        Ok(Self {
            send_first: FirstSend::take(backend, first, chunks)?,
            recv_first: take_pair(backend, first, chunks)?,
            send_second: take_pair(backend, second, chunks)?,
            recv_second: take_pair(backend, second, chunks)?,
        })
    }
}

/// The send buffer of the first exchange.
#[derive(Debug)]
enum FirstSend<B: Backend> {
    /// One chunk's slabs per buffer, chunk `p` in `[p % 2]` (the second empty when P = 1):
    /// the first pass runs chunk by chunk ([`Backend::first_pass_by_chunk`]).
    ByChunk([B::Buffer<u8>; 2]),
    /// All P chunks' slabs, written by one first pass per bucket.
    Whole(B::Buffer<u8>),
}

impl<B: Backend> FirstSend<B> {
    fn take(backend: &B, chunk_bytes: usize, chunks: usize) -> Result<Self> {
        Ok(if backend.first_pass_by_chunk() {
            Self::ByChunk(take_pair(backend, chunk_bytes, chunks)?)
        } else {
            Self::Whole(backend.call_buffer(chunk_bytes * chunks)?)
        })
    }

    /// What the first exchange of chunk `p` sends, and where the first pass of chunk `p + 1`
    /// writes (`None` when the whole bucket was quantized at once).
    fn views(&mut self, p: usize, chunk_bytes: usize) -> (B::Src<'_, u8>, Option<B::Dst<'_, u8>>) {
        match self {
            Self::ByChunk(pair) => {
                let (now, next) = alternate(pair, p);
                (B::src(now), Some(B::dst(next)))
            }
            Self::Whole(all) => (
                B::sub(B::src(all), p * chunk_bytes..(p + 1) * chunk_bytes),
                None,
            ),
        }
    }
}

/// Two call buffers of `len` elements; the second is empty when a bucket has a single chunk.
fn take_pair<B: Backend, T: Element>(
    backend: &B,
    len: usize,
    chunks: usize,
) -> Result<[B::Buffer<T>; 2]> {
    Ok([
        backend.call_buffer(len)?,
        backend.call_buffer(if chunks > 1 { len } else { 0 })?,
    ])
}

/// `(pair[p % 2], pair[(p + 1) % 2])`: chunk `p`'s buffer and its neighbours'.
fn alternate<T>(pair: &mut [T; 2], p: usize) -> (&mut T, &mut T) {
    let [even, odd] = pair;
    if p.is_multiple_of(2) {
        (even, odd)
    } else {
        (odd, even)
    }
}

/// Global-QSGD's integer width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntWidth {
    I8,
    I16,
}

/// What a Global-QSGD bucket keeps: its integer width and the status word of a backend that
/// sums on the device. The integer buffers are taken per call ([`IntBuffers`]).
#[derive(Debug)]
struct Global<B: Backend> {
    width: IntWidth,
    /// The first overflow of the backend's sum since the last check (sums in a pass of the
    /// backend), else empty.
    status: B::Buffer<u32>,
}

impl<B: Backend> Global<B> {
    fn new(backend: &B, width: IntWidth) -> Result<Self> {
        let by_pass = backend.sums_exchanged_blocks();
        let mut global = Self {
            width,
            status: backend.alloc(usize::from(by_pass))?,
        };
        if by_pass {
            // Zeroes the word (its first contents are unspecified); set-up may wait.
            backend.take_sum_status(B::dst(&mut global.status))?;
        }
        Ok(global)
    }
}

/// Global-QSGD's buffers of one call, taken from the backend ([`Backend::call_buffer`]).
#[derive(Debug)]
struct IntBuffers<B: Backend, T: Element> {
    send: B::Buffer<T>,
    /// The summed shard (sums in the communicator), else empty.
    recv: B::Buffer<T>,
    /// The W blocks the all-to-all delivers (sums in a pass of the backend), else empty.
    blocks: B::Buffer<T>,
    /// The absmax: this rank's, then (all-reduced in place) the global one the passes read.
    word: B::Buffer<f32>,
}

impl<B: Backend, T: Element> IntBuffers<B, T> {
    fn take(backend: &B, numel: usize, shard_len: usize) -> Result<Self> {
        let by_pass = backend.sums_exchanged_blocks();
        Ok(Self {
            send: backend.call_buffer(numel)?,
            recv: backend.call_buffer(if by_pass { 0 } else { shard_len })?,
            blocks: backend.call_buffer(if by_pass { numel } else { 0 })?,
            word: backend.call_buffer(1)?,
        })
    }
}

impl GradReduceScatter<Host> {
    /// Plans bucket `bucket_id` of `numel` elements for DP rank `rank` of `topology` and
    /// allocates its buffers in host memory.
    pub fn new(
        config: &Config,
        topology: &Topology,
        rank: usize,
        numel: usize,
        bucket_id: u32,
    ) -> Result<Self> {
        Self::with_backend(&Host, config, topology, rank, numel, bucket_id)
    }

    /// Reduce-scatters `bucket` (all `numel` elements, already scaled as the caller wants)
    /// into `shard` (this rank's `S` elements) at optimizer step `step`.
    pub fn run<C: Comm, G: BucketElement>(
        &mut self,
        comms: &CommGroups<'_, C>,
        bucket: &[G],
        shard: &mut [G],
        step: u64,
    ) -> Result<()> {
        self.run_on(&Host, comms, bucket, shard, step)
    }
}

impl<B: Backend> GradReduceScatter<B> {
    /// Plans bucket `bucket_id` of `numel` elements for DP rank `rank` of `topology` and
    /// allocates its buffers with `backend`.
    pub fn with_backend(
        backend: &B,
        config: &Config,
        topology: &Topology,
        rank: usize,
        numel: usize,
        bucket_id: u32,
    ) -> Result<Self> {
        config.validate()?;
        let w = topology.world();
        if rank >= w {
            return Err(Error::Topology(format!(
                "rank {rank} outside the {w}-rank DP group"
            )));
        }
        stream_id(bucket_id, rank, Stage::GradFirst)?;
        let plan = BucketPlan::new(numel, w, config)?;
        let route = GradRoute::new(config, topology);
        let engine = if w == 1 {
            backend.prepare_conversions()?;
            Engine::Copy
        } else if config.grad.codec.is_grouped() {
            let layout = GradLayout::new(config, topology, &route, plan)
                .expect("a route over W > 1 ranks has an exchange");
            Engine::Grouped(Box::new(Grouped {
                tables: backend.grad_tables(&layout)?,
                layout,
            }))
        } else if config.grad.codec == GradCodec::GlobalQsgd {
            let bits = global_bits(config, w)?;
            backend.prepare_global(bits, config.grad.rounding)?;
            let width = match bits {
                8 => IntWidth::I8,
                _ => IntWidth::I16,
            };
            Engine::Global(Global::new(backend, width)?)
        } else {
            backend.prepare_conversions()?;
            Engine::Exact
        };
        Ok(Self {
            config: *config,
            topology: topology.clone(),
            rank,
            bucket_id,
            plan,
            route,
            engine,
            phase_log: PhaseLog::from_env(CollectiveKind::ReduceScatter, bucket_id, rank),
        })
    }

    /// Shard sizes and padding of this bucket.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// A notice to log when the topology forced a degraded route (unequal nodes).
    pub fn notice(&self) -> Option<&str> {
        self.route.notice.as_deref()
    }

    /// Whether step `step` sends quantized gradients.
    pub fn quantizes_at(&self, step: u64) -> bool {
        !matches!(self.engine, Engine::Copy | Engine::Exact)
            && step >= self.config.grad_quant_start_step
    }

    /// Bytes this rank sends at step `step`.
    pub fn wire_bytes(&self, step: u64) -> WireBytes {
        let (t, me) = (&self.topology, self.rank);
        match &self.engine {
            Engine::Copy => WireBytes::default(),
            _ if !self.quantizes_at(step) => self.baseline_wire_bytes(),
            Engine::Grouped(g) => {
                let chunks = self.plan.chunks as u64;
                let mut bytes = WireBytes::default();
                for level in std::iter::once(g.layout.first).chain(g.layout.second) {
                    let slab = level.slab.byte_len();
                    let sent = match level.level {
                        Level::Intra => WireBytes {
                            intra_node: ((level.peers - 1) * slab) as u64,
                            inter_node: 0,
                        },
                        Level::Inter => WireBytes {
                            intra_node: 0,
                            inter_node: ((level.peers - 1) * slab) as u64,
                        },
                        Level::World => WireBytes::to_every_peer(t, me, slab),
                    };
                    bytes.intra_node += chunks * sent.intra_node;
                    bytes.inter_node += chunks * sent.inter_node;
                }
                bytes
            }
            Engine::Global(g) => {
                let width = match g.width {
                    IntWidth::I8 => 1,
                    IntWidth::I16 => 2,
                };
                WireBytes::to_every_peer(t, me, self.plan.shard_len * width)
            }
            Engine::Exact => self.baseline_wire_bytes(),
        }
    }

    /// Reports an overflow of Global-QSGD's integer sum that a backend summing on a device
    /// ([`Backend::sums_exchanged_blocks`]) recorded in the steps since the last call, with
    /// the error the host path returns from the step itself (docs/numerics.md §7.2; the
    /// overflowing elements of the shard are NaN meanwhile). Waits for the passes enqueued on
    /// `backend`: call it where the caller synchronises with the step anyway. `Ok` for other
    /// codecs and backends.
    pub fn check_integer_sums(&mut self, backend: &B) -> Result<()> {
        let (rank, shard_len) = (self.rank, self.plan.shard_len);
        match &mut self.engine {
            Engine::Global(g) => g.check_sums(backend, rank, shard_len),
            _ => Ok(()),
        }
    }

    /// The status word in which a backend summing on a device records the first overflow of
    /// Global-QSGD's integer sum (zeroed at set-up; the passes only ever raise it), for a
    /// caller that reads it without waiting (the torch extension copies it into pinned host
    /// memory and clears it on the stream); `None` when this bucket has none.
    pub fn integer_sum_status(&mut self) -> Option<B::Dst<'_, u32>> {
        let status = match &mut self.engine {
            Engine::Global(g) => &mut g.status,
            _ => return None,
        };
        if B::len(B::src(status)) == 1 {
            Some(B::dst(status))
        } else {
            None
        }
    }

    /// The error [`check_integer_sums`](Self::check_integer_sums) returns on DP rank `rank`
    /// for a value of its status word, read by the caller
    /// ([`integer_sum_status`](Self::integer_sum_status)); any rank of the bucket's DP group
    /// can make it for any other (the torch extension raises it on every rank).
    pub fn integer_sum_error(&self, rank: usize, status: u32) -> Result<()> {
        let shard_len = self.plan.shard_len;
        match &self.engine {
            Engine::Global(g) => sum_status_error(g.width, status, rank, shard_len),
            _ => Ok(()),
        }
    }

    /// Bytes the uncompressed fp32 reduce-scatter of this bucket sends.
    pub fn baseline_wire_bytes(&self) -> WireBytes {
        if self.topology.world() == 1 {
            return WireBytes::default();
        }
        WireBytes::to_every_peer(&self.topology, self.rank, self.plan.shard_len * 4)
    }

    /// Reduce-scatters `bucket` (all `numel` elements, already scaled as the caller wants)
    /// into `shard` (this rank's `S` elements) at optimizer step `step`, running the passes
    /// with `backend` (the one the buffers were allocated with). A bf16 bucket gives the
    /// bytes on the wire and, rounded to bf16, the shard of the fp32 bucket of its values
    /// (docs/numerics.md §7.5).
    pub fn run_on<C: Comm<B>, G: BucketElement>(
        &mut self,
        backend: &B,
        comms: &CommGroups<'_, C>,
        bucket: B::Src<'_, G>,
        shard: B::Dst<'_, G>,
        step: u64,
    ) -> Result<()> {
        check_len("gradient bucket", B::len(bucket), self.plan.numel)?;
        check_len(
            "gradient shard",
            B::len(B::read(&shard)),
            self.plan.shard_len,
        )?;
        let world = comms.level::<B>(Level::World, &self.topology)?;
        if world.rank() != self.rank {
            return Err(Error::Comm(format!(
                "world communicator rank {} is not this reduce-scatter's rank {}",
                world.rank(),
                self.rank
            )));
        }
        let quantize = self.quantizes_at(step);
        let seed = self.config.seed;
        let stream = |stage| -> Result<UniformStream> {
            Ok(UniformStream::new(
                seed,
                step,
                stream_id(self.bucket_id, self.rank, stage)?,
            ))
        };
        let mut clock = PhaseClock::start(CollectiveKind::ReduceScatter, self.phase_log.as_ref());
        let result = match &mut self.engine {
            Engine::Copy => clock.time(Phase::LastPass, || backend.convert(bucket, shard)),
            Engine::Exact => clock.time(Phase::FirstWait, || {
                G::reduce_scatter_exact(backend, world, bucket, shard)
            }),
            _ if !quantize => clock.time(Phase::FirstWait, || {
                G::reduce_scatter_exact(backend, world, bucket, shard)
            }),
            Engine::Grouped(g) => g.run(
                backend,
                comms,
                &self.topology,
                bucket,
                shard,
                &stream(Stage::GradFirst)?,
                &stream(Stage::GradSecond)?,
                &mut clock,
            ),
            Engine::Global(b) => b.run(
                backend,
                world,
                bucket,
                shard,
                self.config.grad.rounding,
                &stream(Stage::GlobalQsgd)?,
                &mut clock,
            ),
        };
        clock.finish(self.plan.chunks);
        result
    }
}

/// An element type of gradient buckets the reduce-scatter takes: its conversions
/// ([`GradElement`]) and how the uncompressed routes (the `none` codec, the steps before
/// `grad_quant_start_step`) sum it, in fp32 on the wire as for an fp32 bucket.
pub trait BucketElement: GradElement {
    /// The communicator's fp32 reduce-scatter of `bucket` into `shard`.
    fn reduce_scatter_exact<B: Backend, C: Comm<B>>(
        backend: &B,
        comm: &C,
        bucket: B::Src<'_, Self>,
        shard: B::Dst<'_, Self>,
    ) -> Result<()>;
}

impl BucketElement for f32 {
    fn reduce_scatter_exact<B: Backend, C: Comm<B>>(
        _backend: &B,
        comm: &C,
        bucket: B::Src<'_, f32>,
        shard: B::Dst<'_, f32>,
    ) -> Result<()> {
        comm.reduce_scatter_sum(bucket, shard)
    }
}

impl BucketElement for bf16 {
    /// Widens the bucket into an fp32 buffer of this call (the communicator sums fp32), and
    /// rounds the fp32 shard it returns into `shard` (docs/numerics.md §7.5).
    fn reduce_scatter_exact<B: Backend, C: Comm<B>>(
        backend: &B,
        comm: &C,
        bucket: B::Src<'_, bf16>,
        shard: B::Dst<'_, bf16>,
    ) -> Result<()> {
        let mut wide = backend.call_buffer::<f32>(B::len(bucket))?;
        backend.convert(bucket, B::dst(&mut wide))?;
        let mut sum = backend.call_buffer::<f32>(B::len(B::read(&shard)))?;
        comm.reduce_scatter_sum(B::src(&wide), B::dst(&mut sum))?;
        backend.convert(B::src(&sum), shard)
    }
}

/// The host sum's error for the overflow a status word records (none when it is 0): rank
/// `rank`'s shard of `shard_len` integers of `width`.
fn sum_status_error(width: IntWidth, status: u32, rank: usize, shard_len: usize) -> Result<()> {
    let Some((_, element)) = overflow_from_status(status, shard_len) else {
        return Ok(());
    };
    let at = rank * shard_len + element;
    Err(match width {
        IntWidth::I8 => sum_overflow::<i8>(at, shard_len),
        IntWidth::I16 => sum_overflow::<i16>(at, shard_len),
    })
}

/// The integer width Global-QSGD uses for `world` ranks.
pub fn global_bits(config: &Config, world: usize) -> Result<u8> {
    let bits = config
        .grad
        .global_bits
        .unwrap_or(if world <= 127 { 8 } else { 16 });
    if global_k(bits, world) == 0 {
        return Err(Error::Plan(format!(
            "Global-QSGD with {bits}-bit integers serves at most {} ranks, the DP group has {world}",
            (1usize << (bits - 1)) - 1
        )));
    }
    Ok(bits)
}

/// `K = floor((2^(bits-1) - 1) / W)`: W codes of magnitude K sum without overflow.
pub fn global_k(bits: u8, world: usize) -> i32 {
    (((1usize << (bits - 1)) - 1) / world) as i32
}

impl<B: Backend> Grouped<B> {
    /// The pipeline of docs/numerics.md §5.4: per chunk the first pass, the first exchange,
    /// (the second pass and the second exchange), the last pass. Step `t` starts the
    /// exchanges of chunk `t` (and the second one of chunk `t - 1`), computes the neighbouring
    /// chunks while they travel, then waits for them; every communicator has at most one
    /// exchange in flight and every rank waits in the same order. The exchange buffers are
    /// taken for this call and given back once every exchange has completed.
    #[allow(clippy::too_many_arguments)]
    fn run<C: Comm<B>, G: GradElement>(
        &self,
        backend: &B,
        comms: &CommGroups<'_, C>,
        topology: &Topology,
        bucket: B::Src<'_, G>,
        mut shard: B::Dst<'_, G>,
        first_rng: &UniformStream,
        second_rng: &UniformStream,
        clock: &mut PhaseClock<'_>,
    ) -> Result<()> {
        let (layout, tables) = (&self.layout, &self.tables);
        let mut buffers = ExchangeBuffers::take(backend, layout)?;
        let ExchangeBuffers {
            send_first,
            recv_first,
            send_second,
            recv_second,
        } = &mut buffers;
        let first_comm = comms.level::<B>(layout.first.level, topology)?;
        let second_comm = match layout.second {
            Some(s) => Some(comms.level::<B>(s.level, topology)?),
            None => None,
        };
        let my_x1 = peer_index(topology, layout.first.level, comms.world.rank());
        let chunks = layout.bucket.chunks;
        let chunk_bytes = layout.first.peers * layout.first.slab.byte_len();
        clock.time(Phase::FirstPass, || match send_first {
            FirstSend::ByChunk(pair) => backend.quantize_first_chunk(
                layout,
                tables,
                0,
                bucket,
                first_rng,
                B::dst(&mut pair[0]),
            ),
            FirstSend::Whole(all) => {
                backend.quantize_first(layout, tables, bucket, first_rng, B::dst(all))
            }
        })?;
        let levels = if second_comm.is_some() { 2 } else { 1 };
        for t in 0..chunks + levels {
            // Chunk t's first send, and where chunk t + 1's first pass writes.
            let (send, next_out) = if t < chunks {
                let (send, next) = send_first.views(t, chunk_bytes);
                (Some(send), next.filter(|_| t + 1 < chunks))
            } else {
                (None, None)
            };
            let (recv_first_now, recv_first_before) = alternate(recv_first, t);
            let first_flight = match send {
                Some(send) => Some(clock.time(Phase::FirstStart, || {
                    first_comm.start_all_to_all(send, B::dst(recv_first_now))
                })?),
                None => None,
            };
            let quantize_next = |clock: &mut PhaseClock<'_>, out: Option<B::Dst<'_, u8>>| {
                out.map(|out| {
                    clock.time(Phase::FirstPass, || {
                        backend.quantize_first_chunk(layout, tables, t + 1, bucket, first_rng, out)
                    })
                })
                .transpose()
            };
            let Some(second_comm) = second_comm else {
                quantize_next(clock, next_out)?;
                if t >= 1 {
                    let recv = B::src(recv_first_before);
                    clock.time(Phase::LastPass, || {
                        backend.reduce_final(layout, t - 1, recv, B::reborrow(&mut shard))
                    })?;
                }
                clock.time(Phase::FirstWait, || {
                    first_flight.map(InFlight::wait).transpose()
                })?;
                continue;
            };
            // Two levels: chunk t - 1's second exchange runs beside chunk t's first.
            let (send_second_now, send_second_before) = alternate(send_second, t);
            let (recv_second_now, recv_second_before) = alternate(recv_second, t);
            let second_flight = if (1..=chunks).contains(&t) {
                let (send, recv) = (B::src(send_second_before), B::dst(recv_second_before));
                Some(clock.time(Phase::SecondStart, || {
                    second_comm.start_all_to_all(send, recv)
                })?)
            } else {
                None
            };
            quantize_next(clock, next_out)?;
            if t >= 2 {
                // Chunk t - 2 arrived in the buffer of chunk t's parity.
                let recv = B::src(recv_second_now);
                clock.time(Phase::LastPass, || {
                    backend.reduce_final(layout, t - 2, recv, B::reborrow(&mut shard))
                })?;
            }
            let arrived = clock.time(Phase::FirstWait, || {
                first_flight.map(InFlight::wait).transpose()
            })?;
            if arrived.is_some() {
                clock.time(Phase::SecondPass, || {
                    backend.requantize_second(
                        layout,
                        tables,
                        my_x1,
                        t,
                        B::src(recv_first_now),
                        second_rng,
                        B::dst(send_second_now),
                    )
                })?;
            }
            clock.time(Phase::SecondWait, || {
                second_flight.map(InFlight::wait).transpose()
            })?;
        }
        Ok(())
    }
}

impl<B: Backend> Global<B> {
    /// [`run_with`](Self::run_with) at this bucket's integer width.
    #[allow(clippy::too_many_arguments)]
    fn run<C: Comm<B>, G: GradElement>(
        &mut self,
        backend: &B,
        world: &C,
        bucket: B::Src<'_, G>,
        shard: B::Dst<'_, G>,
        rounding: Rounding,
        rng: &UniformStream,
        clock: &mut PhaseClock<'_>,
    ) -> Result<()> {
        match self.width {
            IntWidth::I8 => {
                self.run_with::<C, i8, G>(backend, world, bucket, shard, rounding, rng, clock)
            }
            IntWidth::I16 => {
                self.run_with::<C, i16, G>(backend, world, bucket, shard, rounding, rng, clock)
            }
        }
    }

    /// All-reduce MAX of the absmax, integer rounding, integer reduce-scatter, dequantize
    /// (docs/numerics.md §7.2), with `T` codes in buffers taken for this call. The global
    /// absmax stays in `word`, in the backend's memory, and the passes read their scale from
    /// it, so on a device nothing waits on the host; a non-finite absmax or a zero scale make
    /// every code 0 and the shard all NaN or all 0.
    #[allow(clippy::too_many_arguments)]
    fn run_with<C: Comm<B>, T: IntCode + Element + SumElement, G: GradElement>(
        &mut self,
        backend: &B,
        world: &C,
        bucket: B::Src<'_, G>,
        shard: B::Dst<'_, G>,
        rounding: Rounding,
        rng: &UniformStream,
        clock: &mut PhaseClock<'_>,
    ) -> Result<()> {
        let mut b = IntBuffers::<B, T>::take(backend, B::len(bucket), B::len(B::read(&shard)))?;
        clock.time(Phase::FirstPass, || {
            backend.global_absmax(bucket, B::dst(&mut b.word))
        })?;
        clock.time(Phase::FirstWait, || {
            world.all_reduce_max_in_place(B::dst(&mut b.word))
        })?;
        let k = global_k(T::BITS, world.size());
        clock.time(Phase::FirstPass, || {
            backend.global_quantize(
                bucket,
                B::src(&b.word),
                k,
                rounding,
                rng,
                B::dst(&mut b.send),
            )
        })?;
        if backend.sums_exchanged_blocks() {
            clock.time(Phase::SecondWait, || {
                world.all_to_all(
                    B::as_bytes(B::src(&b.send)),
                    B::as_bytes_mut(B::dst(&mut b.blocks)),
                )
            })?;
            return clock.time(Phase::LastPass, || {
                backend.global_sum_dequantize(
                    B::src(&b.blocks),
                    world.size(),
                    B::src(&b.word),
                    k,
                    B::dst(&mut self.status),
                    shard,
                )
            });
        }
        clock.time(Phase::SecondWait, || {
            world.reduce_scatter_sum(B::src(&b.send), B::dst(&mut b.recv))
        })?;
        clock.time(Phase::LastPass, || {
            backend.global_dequantize(B::src(&b.recv), B::src(&b.word), k, shard)
        })
    }

    /// The overflow the backend's sum recorded since the last call, as the error the host
    /// sum returns at once ([`sum_in_rank_order`](crate::collective::sum_in_rank_order));
    /// waits for the backend's passes.
    fn check_sums(&mut self, backend: &B, rank: usize, shard_len: usize) -> Result<()> {
        if !backend.sums_exchanged_blocks() {
            return Ok(());
        }
        let status = backend.take_sum_status(B::dst(&mut self.status))?;
        sum_status_error(self.width, status, rank, shard_len)
    }
}
