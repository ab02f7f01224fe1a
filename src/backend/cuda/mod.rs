//! The CUDA backend: the fused passes of `backend::cpu` as kernels (`kernels/*.cu`), compiled
//! by NVRTC at first use for the device's architecture, cached per device, and launched on the
//! caller's CUDA stream with no host synchronisation per call.
//!
//! cudarc is used with dynamic loading: nothing links against CUDA, and [`probe`] checks with
//! libloading that the driver and NVRTC libraries (and every symbol used) are present before
//! cudarc is called, so a machine without a GPU gets an [`Error::Cuda`](crate::Error::Cuda)
//! value and the CPU backend keeps working.
//!
//! - [`source`]: the embedded kernel sources and the kernel names;
//! - [`target`]: which image a device gets (a CUBIN for its architecture, PTX as fallback);
//! - [`compile`]: NVRTC compilation of one source to that image (bit-exact options);
//! - [`abi`]: `#[repr(C)]` mirrors of the launch ABI (`kernels/sdp4bit_abi.h`);
//! - [`Kernels`]: the per-device cache of loaded kernels, with one launch method per kernel;
//! - [`Stream`], [`DeviceSpan`]: raw stream and device-memory handles, e.g. from torch;
//! - [`Cuda`]: the collectives' [`Backend`](crate::backend::Backend) on one device (every
//!   pass enqueued on one stream);
//! - [`alloc`]: its [`DeviceBuffer`]s, kept by a bucket or taken for one call and reused in
//!   stream order, and the [`Allocator`] they come from (the driver, or one it is given, such
//!   as torch's caching allocator);
//! - [`SideStream`], [`DeviceExchange`]: a device communicator's exchanges on a side stream,
//!   ordered by events, so pipeline chunks overlap; [`new_priority_stream`]: the torch
//!   extension's side streams;
//! - [`StatusReadback`]: Global-QSGD's integer-sum status word read on the host through
//!   pinned memory and an event query, without waiting for the device.
//!
//! Use: `Kernels::get(device)?` once, upload [`dest_table`] once per bucket, then call the
//! launch methods every step; results are ready when the stream reaches them.

pub mod abi;
pub mod alloc;
mod backend;
pub mod compile;
mod exchange;
mod launch;
mod module;
pub mod probe;
mod readback;
pub mod source;
pub mod target;

pub use alloc::{Allocator, DeviceAllocator, DeviceBlock, DeviceBuffer};
pub use backend::Cuda;
pub use compile::{Arch, Compiled, Target};
pub use exchange::{DeviceExchange, SideStream, new_priority_stream};
pub use launch::{DeviceSpan, Stream, absmax_from_bits, dest_table};
pub use module::{Kernels, device_count, driver_version, format_driver_version};
pub use readback::StatusReadback;
pub use target::TargetChoice;
