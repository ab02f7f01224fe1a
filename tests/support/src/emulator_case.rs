//! Case files of the kernel emulator (`tests/kernel_emulator/emulator.cpp`, whose top comment
//! gives the format): buffers with their initial bytes, kernel launches on them, and the
//! emulator's output file split back into the output buffers. Two formats: "SDPEMU02", read by
//! the emulator of c4b4d29 (the kernels the H100 ran, every block of 256 threads), and
//! "SDPEMU03", read by the current one (threads per block given per launch).

/// The case-file format an emulator reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CaseFormat {
    /// "SDPEMU02": blocks of 256 threads (c4b4d29's emulator).
    #[default]
    V2,
    /// "SDPEMU03": the threads per block of each launch written after its grid.
    V3,
}

/// A buffer of a case, by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaseBuffer(u32);

/// The order the emulator runs a launch's warps in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarpOrder {
    Forward,
    Reverse,
    /// Shuffled by a generator seeded with the value.
    Shuffled(u64),
}

/// One kernel launch: `grid` blocks of `threads` threads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseLaunch {
    /// The kernel's name, as the emulator's dispatch knows it.
    pub kernel: String,
    pub grid: u32,
    /// Threads per block: a multiple of 32 up to 1024 (256 in [`CaseFormat::V2`]).
    pub threads: u32,
    pub order: WarpOrder,
    /// The pointer arguments (`None`: a null pointer).
    pub pointers: Vec<Option<CaseBuffer>>,
    /// The parameter struct's bytes.
    pub params: Vec<u8>,
    /// `(byte offset in params, buffer)`: the buffer's address is written there as a u64.
    pub addresses: Vec<(u32, CaseBuffer)>,
}

/// A case: buffers (inputs and outputs) and the launches that run on them, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EmulatorCase {
    /// (is an output, initial bytes).
    buffers: Vec<(bool, Vec<u8>)>,
    pub launches: Vec<CaseLaunch>,
    /// The format [`EmulatorCase::encode`] writes.
    pub format: CaseFormat,
}

impl EmulatorCase {
    /// An input buffer holding `bytes`.
    pub fn input(&mut self, bytes: Vec<u8>) -> CaseBuffer {
        self.buffers.push((false, bytes));
        CaseBuffer(self.buffers.len() as u32 - 1)
    }

    /// An output buffer starting as `initial`; the output file holds its final bytes.
    pub fn output(&mut self, initial: Vec<u8>) -> CaseBuffer {
        self.buffers.push((true, initial));
        CaseBuffer(self.buffers.len() as u32 - 1)
    }

    /// The case file, in the case's format; an error for a launch the format cannot state
    /// (blocks of other than 256 threads in [`CaseFormat::V2`]).
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = match self.format {
            CaseFormat::V2 => b"SDPEMU02".to_vec(),
            CaseFormat::V3 => b"SDPEMU03".to_vec(),
        };
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
            u32_le(&mut out, l.kernel.len());
            out.extend(l.kernel.as_bytes());
            out.extend(l.grid.to_le_bytes());
            match self.format {
                CaseFormat::V2 if l.threads != 256 => {
                    return Err(format!(
                        "{}: blocks of {} threads, but SDPEMU02 launches blocks of 256",
                        l.kernel, l.threads
                    ));
                }
                CaseFormat::V2 => {}
                CaseFormat::V3 => out.extend(l.threads.to_le_bytes()),
            }
            let (order, seed) = match l.order {
                WarpOrder::Forward => (0u32, 0u64),
                WarpOrder::Reverse => (1, 0),
                WarpOrder::Shuffled(seed) => (2, seed),
            };
            out.extend(order.to_le_bytes());
            out.extend(seed.to_le_bytes());
            u32_le(&mut out, l.pointers.len());
            for p in &l.pointers {
                out.extend(p.map_or(u32::MAX, |b| b.0).to_le_bytes());
            }
            u32_le(&mut out, l.params.len());
            out.extend(&l.params);
            u32_le(&mut out, l.addresses.len());
            for &(offset, buffer) in &l.addresses {
                out.extend(offset.to_le_bytes());
                out.extend(buffer.0.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// The final bytes of each output buffer, in buffer order, from the emulator's output
    /// file; an error when its length is not theirs.
    pub fn outputs<'a>(&self, file: &'a [u8]) -> Result<Vec<&'a [u8]>, String> {
        let mut parts = Vec::new();
        let mut at = 0;
        for (_, bytes) in self.buffers.iter().filter(|(output, _)| *output) {
            let part = file
                .get(at..at + bytes.len())
                .ok_or_else(|| format!("output file of {} bytes is too short", file.len()))?;
            parts.push(part);
            at += bytes.len();
        }
        if at != file.len() {
            return Err(format!(
                "output file of {} bytes, expected {at}",
                file.len()
            ));
        }
        Ok(parts)
    }
}
