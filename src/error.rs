//! The crate's error type: every failure is a value that names the problem; and the buffer
//! length check every layer applies to its callers' buffers.

/// Everything that can go wrong in the core. Each variant carries a message that names the
/// offending value (size, knob, rank, byte count) so it can be shown to a user unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A configuration knob has a value the codecs cannot use.
    #[error("invalid sdp4bit config: {0}")]
    Config(String),
    /// The data-parallel topology (ranks, nodes) is malformed.
    #[error("invalid topology: {0}")]
    Topology(String),
    /// A bucket size / world size / group size combination the plan cannot serve.
    #[error("plan cannot serve this bucket: {0}")]
    Plan(String),
    /// A caller-provided buffer has the wrong length.
    #[error("bad buffer: {0}")]
    Buffer(String),
    /// Encoded bytes are short, corrupt or were produced by a different codec.
    #[error("cannot decode: {0}")]
    Decode(String),
    /// A collective failed or the ranks disagreed on its arguments.
    #[error("collective failed: {0}")]
    Comm(String),
    /// The CUDA backend cannot run: the driver or NVRTC library is missing, there is no
    /// device, a kernel failed to compile or load, or a launch was rejected. The message
    /// names the library, device or kernel and the driver's or compiler's own words.
    #[error("CUDA backend: {0}")]
    Cuda(String),
}

/// Shorthand for results carrying [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// An [`Error::Buffer`] unless `what` has the `want` elements the plan expects.
pub(crate) fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Buffer(format!(
            "{what} has {got} elements, the plan expects {want}"
        )))
    }
}
