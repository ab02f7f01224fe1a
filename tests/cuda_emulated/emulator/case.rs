//! One emulator case: its buffers, its kernel launches and the outputs expected of them, and
//! the case file the emulator reads (format: `tests/kernel_emulator/emulator.cpp`).

use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::spec::{Constants, KernelSpec, Specialised};
use sdp4bit::backend::cuda::variants::{candidates, default_variant};
use sdp4bit::codec::slab::SlabLayout;

use super::compare::first_difference;
use sdp4bit_test_support::random::SplitMix64;

/// A buffer of a case (its index).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buf(u32);

/// How an output buffer is compared with the CPU's.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Expect {
    /// Whole slabs of the layout.
    Slabs(SlabLayout),
    /// fp32 values.
    F32,
    /// bf16 values.
    Bf16,
    /// Integers of this many bytes.
    Ints(usize),
    /// One `u32` left by `global_absmax`, compared as `absmax_from_bits` of it.
    AbsmaxBits,
    /// The status word of a Global-QSGD dequantization summing blocks of this many integers:
    /// one `u32`, compared exactly and described as the overflow it names.
    OverflowStatus(usize),
}

/// An output buffer and the bytes the CPU backend says it must end as.
#[derive(Debug)]
struct Check {
    buffer: usize,
    what: String,
    expect: Expect,
    want: Vec<u8>,
}

/// One kernel launch of a case; its variant is the case's choice ([`Case::with_variant`]).
#[derive(Debug)]
struct Launch {
    kernel: Kernel,
    constants: Constants,
    /// Groups of a grouped kernel, elements of an element-wise one.
    work: u64,
    /// 0, 1, 2: a grid of that many blocks plus one; 3: as many blocks as the work needs.
    grid: u64,
    /// 0 forward, 1 reverse, 2 shuffled with `order_seed`.
    order: u32,
    order_seed: u64,
    pointers: Vec<Option<Buf>>,
    params: Vec<u8>,
    /// (byte offset in `params`, buffer): the buffer's address goes there.
    addresses: Vec<(usize, Buf)>,
}

/// One case: buffers (inputs and outputs), the launches that run on them in order, and the
/// bytes the CPU backend computed for every output.
#[derive(Debug)]
pub struct Case {
    name: String,
    /// Which of its variants each launch takes: `None` the default, `Some(i)` the i-th of every
    /// variant the kernels compile for its constants (cycling).
    variant: Option<usize>,
    /// (is an output, initial bytes).
    buffers: Vec<(bool, Vec<u8>)>,
    launches: Vec<Launch>,
    checks: Vec<Check>,
    /// Picks each launch's grid and warp order.
    shapes: SplitMix64,
}

impl Case {
    /// What the case covers, for failure messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The specialisations the case launches, in launch order.
    pub fn specs(&self) -> impl Iterator<Item = KernelSpec> + '_ {
        self.launches.iter().map(|l| self.spec(l))
    }

    /// The specialisation `launch` runs as: its kernel and constants with the case's variant.
    fn spec(&self, launch: &Launch) -> KernelSpec {
        let variant = match self.variant {
            None => default_variant(launch.kernel, launch.constants),
            Some(i) => {
                let all = candidates(launch.kernel, launch.constants);
                all[i % all.len()]
            }
        };
        KernelSpec::new(launch.kernel, launch.constants, variant).expect("a specialisation")
    }

    /// The case with every launch taking the `index`-th of its variants (cycling).
    pub(crate) fn with_variant(self, index: usize) -> Self {
        Self {
            variant: Some(index),
            name: format!("{} variant {index}", self.name),
            ..self
        }
    }

    /// Outputs compared with the CPU's.
    pub fn checks(&self) -> usize {
        self.checks.len()
    }

    /// An empty case; `rand` seeds the choice of grids and warp orders.
    pub(crate) fn new(name: String, rand: &mut SplitMix64) -> Self {
        Self {
            name,
            variant: None,
            buffers: Vec::new(),
            launches: Vec::new(),
            checks: Vec::new(),
            shapes: SplitMix64::new(rand.next_u64()),
        }
    }

    /// An input buffer holding `bytes`.
    pub(crate) fn input(&mut self, bytes: Vec<u8>) -> Buf {
        self.buffers.push((false, bytes));
        Buf(self.buffers.len() as u32 - 1)
    }

    /// An output buffer starting as `initial`, which must end as `want` (from the CPU).
    pub(crate) fn output(
        &mut self,
        initial: Vec<u8>,
        what: String,
        expect: Expect,
        want: Vec<u8>,
    ) -> Buf {
        assert_eq!(initial.len(), want.len(), "{what}: output sizes");
        self.buffers.push((true, initial));
        let buffer = self.buffers.len() - 1;
        self.checks.push(Check {
            buffer,
            what,
            expect,
            want,
        });
        Buf(buffer as u32)
    }

    /// Launches `kernel` specialised for `params` (with the case's variant, [`Case::with_variant`])
    /// over `work` (groups of a grouped kernel, elements of an element-wise one), as
    /// `backend::cuda::launch` does but with a grid of 1, 2 or 3 blocks (grid-stride loops) or
    /// as many as the work needs, and one of three warp orders. `params` must be the struct the
    /// kernel table declares for `kernel`.
    pub(crate) fn launch<T: Specialised>(
        &mut self,
        kernel: Kernel,
        work: u64,
        pointers: &[Option<Buf>],
        params: &T,
    ) {
        assert_eq!(T::C_NAME, kernel.params(), "{}'s parameters", kernel.name());
        self.launches.push(Launch {
            kernel,
            constants: params.constants().expect("constants of the launch"),
            work,
            grid: self.shapes.below(4) as u64,
            order: self.shapes.below(3) as u32,
            order_seed: self.shapes.next_u64(),
            pointers: pointers.to_vec(),
            params: bytemuck::bytes_of(params).to_vec(),
            addresses: Vec::new(),
        });
    }

    /// Makes the last launch's parameter struct hold the address of `buffer` at byte `offset`
    /// (a device address field, such as Global-QSGD's status word).
    pub(crate) fn address_in_params(&mut self, offset: usize, buffer: Buf) {
        let launch = self.launches.last_mut().expect("a launch to patch");
        assert!(
            offset + 8 <= launch.params.len(),
            "address field inside the parameters"
        );
        launch.addresses.push((offset, buffer));
    }

    /// The case file (format: `tests/kernel_emulator/emulator.cpp`).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = b"SDPEMU03".to_vec();
        let u32_le = |out: &mut Vec<u8>, v: usize| {
            out.extend(u32::try_from(v).expect("fits u32").to_le_bytes())
        };
        u32_le(&mut out, self.buffers.len());
        for (output, bytes) in &self.buffers {
            out.push(u8::from(*output));
            out.extend((bytes.len() as u64).to_le_bytes());
            out.extend(bytes);
        }
        u32_le(&mut out, self.launches.len());
        for l in &self.launches {
            let spec = self.spec(l);
            let entry = spec.entry();
            let variant = spec.variant;
            let per_block = match l.constants {
                Constants::Elementwise { .. } => {
                    u64::from(variant.threads) * 4 * u64::from(variant.units)
                }
                _ => u64::from(variant.threads / 32) * u64::from(variant.units),
            };
            let grid = match l.grid {
                3 => l.work.div_ceil(per_block).max(1),
                small => small + 1,
            };
            u32_le(&mut out, entry.len());
            out.extend(entry.as_bytes());
            out.extend(u32::try_from(grid).expect("grid fits u32").to_le_bytes());
            out.extend(variant.threads.to_le_bytes());
            out.extend(l.order.to_le_bytes());
            out.extend(l.order_seed.to_le_bytes());
            u32_le(&mut out, l.pointers.len());
            for p in &l.pointers {
                out.extend(p.map_or(u32::MAX, |b| b.0).to_le_bytes());
            }
            u32_le(&mut out, l.params.len());
            out.extend(&l.params);
            u32_le(&mut out, l.addresses.len());
            for &(offset, buffer) in &l.addresses {
                u32_le(&mut out, offset);
                out.extend(buffer.0.to_le_bytes());
            }
        }
        out
    }

    /// Compares the emulator's output file (the final bytes of the output buffers, in order)
    /// with the expected outputs; one message per differing output.
    pub(crate) fn compare(&self, out: &[u8]) -> Vec<String> {
        let mut got = std::collections::HashMap::new();
        let mut at = 0;
        for (i, (output, bytes)) in self.buffers.iter().enumerate() {
            if *output {
                if at + bytes.len() > out.len() {
                    return vec![format!("output file of {} bytes is too short", out.len())];
                }
                got.insert(i, &out[at..at + bytes.len()]);
                at += bytes.len();
            }
        }
        if at != out.len() {
            return vec![format!("output file of {} bytes, expected {at}", out.len())];
        }
        self.checks
            .iter()
            .filter_map(|c| {
                first_difference(c.expect, &c.want, got[&c.buffer])
                    .map(|e| format!("{}: {e}", c.what))
            })
            .collect()
    }
}
