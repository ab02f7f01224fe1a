//! Injected faults are caught: an out-of-bounds kernel access and copy, a host pointer passed
//! as a device pointer, a missing stream wait, freeing a buffer a stream still uses, and freeing
//! pinned host memory a queued copy still writes. Each
//! test runs its scenario in a child process (this test binary again, with
//! `SDP4BIT_EMULATION_FAULT` naming the test), so a fault that stops the process (a kernel
//! touching a guard page) or stays in the fault log cannot disturb the other tests; the parent
//! checks the child's exit status and what it printed, the child checks what the driver
//! returned and reported. Each scenario also runs its correct variant first, which must
//! report nothing. The stream and event calls a side-stream design needs are checked the same
//! way (`streams_and_events_follow_the_driver`), and so are the torch extension's side streams
//! (`side_streams_are_new_non_blocking_and_of_the_greatest_priority`).

use std::process::Output;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use sdp4bit::Error;
use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::{Cuda, DeviceSpan, Kernels, Stream};

use super::child::{self, assert_child_passed};
use super::library::emulation;

/// In the child: runs `scenario` and returns `None`. In the parent: runs `faults::{test}` in
/// a child process and returns its output.
fn run_isolated(test: &str, scenario: impl FnOnce()) -> Option<Output> {
    child::run_isolated(&format!("faults::{test}"), &[], scenario)
}

/// Device 0's primary context current on this thread, two streams of it and the backend on
/// the first.
struct Device {
    _context: Arc<CudaContext>,
    first: Arc<CudaStream>,
    second: Arc<CudaStream>,
    kernels: &'static Kernels,
}

impl Device {
    fn new() -> Self {
        emulation();
        let context = CudaContext::new(0).expect("the primary context of device 0");
        context.bind_to_thread().expect("bind it");
        let first = context.new_stream().expect("a stream");
        let second = context.new_stream().expect("another stream");
        Self {
            _context: context,
            first,
            second,
            kernels: Kernels::get(0).expect("the kernels load"),
        }
    }

    fn backend(&self, stream: &CudaStream) -> Cuda {
        // SAFETY: a live stream of device 0's primary context, alive as long as `self`.
        Cuda::new(self.kernels, unsafe {
            Stream::from_raw(stream.cu_stream() as usize)
        })
    }

    fn stream(&self, stream: &CudaStream) -> Stream {
        // SAFETY: as for `backend`.
        unsafe { Stream::from_raw(stream.cu_stream() as usize) }
    }
}

/// The faults reported so far, which must mention every one of `needles`.
fn assert_faults(needles: &[&str]) -> String {
    let faults = emulation().take_faults(-1);
    for needle in needles {
        assert!(
            faults.contains(needle),
            "no fault mentions {needle:?}:\n{faults}"
        );
    }
    faults
}

fn assert_no_faults() {
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "unexpected faults:\n{faults}");
}

/// A kernel reading past the end of its buffer hits the guard page after it: the process
/// stops with a message naming the kernel, block and thread.
#[test]
fn fault_out_of_bounds_kernel_access() {
    let Some(output) = run_isolated("fault_out_of_bounds_kernel_access", || {
        let device = Device::new();
        let backend = device.backend(&device.first);
        let mut bucket = backend.alloc::<f32>(256).expect("bucket");
        let mut word = backend.alloc::<u32>(1).expect("word");
        backend.fill(Cuda::dst(&mut bucket), 1.0).expect("fill");
        let stream = device.stream(&device.first);
        // The correct launch first.
        device
            .kernels
            .global_absmax(stream, Cuda::src(&bucket), Cuda::dst(&mut word))
            .expect("a launch in bounds");
        device.first.synchronize().expect("synchronize");
        assert_no_faults();
        // SAFETY (deliberately broken): the span claims 1280 elements of a 256-element
        // buffer, so every read past its end lands in the guard page after it.
        let too_long = unsafe { DeviceSpan::<f32>::from_raw(Cuda::src(&bucket).addr(), 1280) };
        device
            .kernels
            .global_absmax(stream, too_long, Cuda::dst(&mut word))
            .expect("the launch itself is accepted");
        let _ = device.first.synchronize();
        panic!("the out-of-bounds kernel ran to completion");
    }) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "exit status: {stderr}");
    assert!(
        stderr.contains("SIGSEGV") && stderr.contains("(global_absmax__"),
        "{stderr}"
    );
    assert!(
        stderr.contains("bytes from the start of buffer 0 (1024 bytes)"),
        "{stderr}"
    );
}

/// Copies and memsets past the end of an allocation, and launches with a host pointer, are
/// refused with an error value and a fault naming the allocation or the address.
#[test]
fn fault_bad_pointers_are_refused() {
    let Some(output) = run_isolated("fault_bad_pointers_are_refused", || {
        let device = Device::new();
        let backend = device.backend(&device.first);
        let stream = device.stream(&device.first);
        let a = backend.alloc::<f32>(100).expect("a");
        let mut b = backend.alloc::<f32>(100).expect("b");
        backend
            .copy(Cuda::src(&a), Cuda::dst(&mut b))
            .expect("a copy in bounds");
        device.first.synchronize().expect("synchronize");
        assert_no_faults();
        // SAFETY (deliberately broken): 101 elements of a 100-element buffer.
        let long = unsafe { DeviceSpan::<f32>::from_raw(Cuda::src(&b).addr(), 101) };
        // SAFETY (deliberately broken): as `long`.
        let long_a = unsafe { DeviceSpan::<f32>::from_raw(Cuda::src(&a).addr(), 101) };
        let e = backend.copy(long, long_a).expect_err("copy past the end");
        assert!(matches!(e, Error::Cuda(_)), "{e:?}");
        assert_faults(&["cuMemcpyDtoDAsync", "run 4 bytes past its end"]);
        let e = backend.fill(long, 0.0).expect_err("memset past the end");
        assert!(matches!(e, Error::Cuda(_)), "{e:?}");
        assert_faults(&["cuMemsetD32Async", "past its end"]);
        // A host buffer passed as device memory.
        let host = vec![0f32; 256];
        let mut word = backend.alloc::<u32>(1).expect("word");
        // SAFETY (deliberately broken): host memory is not device memory.
        let host_span = unsafe { DeviceSpan::<f32>::from_raw(host.as_ptr() as u64, host.len()) };
        let e = device
            .kernels
            .global_absmax(stream, host_span, Cuda::dst(&mut word))
            .expect_err("a launch with a host pointer");
        assert!(e.to_string().contains("global_absmax"), "{e}");
        assert_faults(&[
            "launch of global_absmax",
            "not device memory (a host pointer?)",
        ]);
        device.first.synchronize().expect("synchronize");
        assert_no_faults();
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// Work on a second stream reading what the first wrote, without an event between them, is a
/// race the driver refuses (whatever the timing); with cuEventRecord / cuStreamWaitEvent it
/// is fine. What a kernel writes is every pointer its prototype declares non-const (here
/// `grad_narrow_bf16`'s second, which the emulation once took for a read).
#[test]
fn fault_missing_stream_wait() {
    let Some(output) = run_isolated("fault_missing_stream_wait", || {
        let device = Device::new();
        let first = device.backend(&device.first);
        let second = device.backend(&device.second);
        let mut a = first.alloc::<f32>(1000).expect("a");
        let mut b = first.alloc::<f32>(1000).expect("b");
        // Correct: the second stream waits for an event recorded after the fill.
        first.fill(Cuda::dst(&mut a), 2.5).expect("fill");
        device
            .second
            .join(&device.first)
            .expect("event record and wait");
        second
            .copy(Cuda::src(&a), Cuda::dst(&mut b))
            .expect("ordered copy");
        device.second.synchronize().expect("synchronize");
        let mut host = vec![0f32; 1000];
        // SAFETY: b holds 1000 f32 of device 0; the copy is synchronous and ordered after
        // the synchronisation above.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, Cuda::src(&b).addr()) }
            .expect("download");
        assert!(
            host.iter().all(|&v| v == 2.5),
            "the ordered copy saw {:?}",
            &host[..4]
        );
        device.first.synchronize().expect("synchronize");
        assert_no_faults();
        // Broken: no wait between the fill on the first stream and the copy on the second.
        first.fill(Cuda::dst(&mut a), 7.0).expect("fill");
        let e = second
            .copy(Cuda::src(&a), Cuda::dst(&mut b))
            .expect_err("an unordered copy");
        assert!(e.to_string().contains("cuMemcpyDtoDAsync"), "{e}");
        assert_faults(&["race on allocation", "nothing orders the two"]);
        device.first.synchronize().expect("synchronize");
        device.second.synchronize().expect("synchronize");
        let mut narrow = first.alloc::<bf16>(1000).expect("narrow");
        let mut c = first.alloc::<bf16>(1000).expect("c");
        first
            .convert(Cuda::src(&a), Cuda::dst(&mut narrow))
            .expect("grad_narrow_bf16");
        second
            .copy(Cuda::src(&narrow), Cuda::dst(&mut c))
            .expect_err("an unordered copy of a kernel's output");
        assert_faults(&[
            "that kernel grad_narrow_bf16__",
            "writes, and nothing orders the two",
        ]);
        device.first.synchronize().expect("synchronize");
        device.second.synchronize().expect("synchronize");
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// Freeing a buffer that queued work may still use is reported (whatever the timing): the
/// host never synchronised with that work.
#[test]
fn fault_freed_buffer_still_in_use() {
    let Some(output) = run_isolated("fault_freed_buffer_still_in_use", || {
        let device = Device::new();
        let backend = device.backend(&device.first);
        // Correct: synchronise, then free.
        let mut a = backend.alloc::<f32>(4096).expect("a");
        backend.fill(Cuda::dst(&mut a), 1.0).expect("fill");
        device.first.synchronize().expect("synchronize");
        drop(a);
        assert_no_faults();
        // Broken: free right after enqueueing work on it.
        let mut b = backend.alloc::<f32>(4096).expect("b");
        backend.fill(Cuda::dst(&mut b), 1.0).expect("fill");
        drop(b);
        assert_faults(&[
            "cuMemFree of allocation",
            "cuMemsetD32Async",
            "may still use it",
        ]);
        device.first.synchronize().expect("synchronize");
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// Holds its stream until the gate (an AtomicBool) opens (`cuLaunchHostFunc`'s callback).
extern "C" fn wait_for_gate(gate: *mut std::ffi::c_void) {
    // SAFETY: `gate` points to the AtomicBool of the test, alive until its stream is
    // synchronised.
    let gate = unsafe { &*gate.cast::<std::sync::atomic::AtomicBool>() };
    while !gate.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// Pinned host memory (`cuMemHostAlloc`): a copy into it returns once enqueued, without a
/// host synchronisation, and lands when its stream runs it; freeing it while such a copy is
/// still queued (its stream held by a host function) is reported.
#[test]
fn fault_pinned_memory_freed_under_a_queued_copy() {
    use cudarc::driver::result as driver;
    use cudarc::driver::sys;
    use std::sync::atomic::{AtomicBool, Ordering};

    let Some(output) = run_isolated("fault_pinned_memory_freed_under_a_queued_copy", || {
        let device = Device::new();
        let stream = device.first.cu_stream();
        let gate = AtomicBool::new(false);
        // SAFETY: device 0's context is current and `stream` is live; the pinned words and the
        // device word outlive every copy into or from them (synchronised below), except the
        // freed word of the broken variant, which the emulation keeps allocated.
        unsafe {
            let word = driver::malloc_sync(4).expect("a device word");
            driver::memset_d8_async(word, 7, 4, stream).expect("memset");
            // Correct: copy, synchronise, read, free.
            let pinned = driver::malloc_host(4, 0).expect("pinned memory");
            let _earlier = emulation().take_host_syncs();
            sys::cuMemcpyDtoHAsync_v2(pinned, word, 4, stream)
                .result()
                .expect("a copy into pinned memory");
            let enqueued_only = emulation().take_host_syncs();
            assert!(
                enqueued_only.is_empty(),
                "a copy into pinned memory was a synchronisation: {enqueued_only:?}"
            );
            driver::stream::synchronize(stream).expect("synchronize");
            assert_eq!(pinned.cast::<u32>().read_volatile(), 0x0707_0707);
            driver::free_host(pinned).expect("free the pinned word");
            assert_no_faults();
            // Broken: free while the copy is still queued behind a held stream.
            let pinned = driver::malloc_host(4, 0).expect("pinned memory");
            sys::cuLaunchHostFunc(
                stream,
                Some(wait_for_gate),
                (&raw const gate).cast_mut().cast(),
            )
            .result()
            .expect("host function");
            sys::cuMemcpyDtoHAsync_v2(pinned, word, 4, stream)
                .result()
                .expect("a queued copy into pinned memory");
            driver::free_host(pinned).expect_err("freed under a queued copy");
            assert_faults(&["cuMemFreeHost of pinned memory", "still writes"]);
            gate.store(true, Ordering::SeqCst);
            driver::stream::synchronize(stream).expect("synchronize");
            driver::free_sync(word).expect("free the device word");
        }
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// Counts the host functions that ran (`cuLaunchHostFunc`'s callback).
extern "C" fn count_call(counter: *mut std::ffi::c_void) {
    // SAFETY: `counter` points to the AtomicUsize of the test, alive until its stream is
    // synchronised.
    let counter = unsafe { &*counter.cast::<std::sync::atomic::AtomicUsize>() };
    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// The stream and event calls a side-stream design uses, with the driver's semantics: an event
/// recorded on one stream and waited for by another orders them; `cuEventQuery`,
/// `cuEventSynchronize`, `cuStreamQuery`, `cuEventElapsedTime` and host functions work; the
/// legacy default stream waits for a blocking stream but not for a non-blocking one (a
/// synchronous copy after work on a non-blocking stream, without a wait, is a race).
#[test]
fn streams_and_events_follow_the_driver() {
    use cudarc::driver::result::{self as driver, event, stream};
    use cudarc::driver::sys;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let Some(output) = run_isolated("streams_and_events_follow_the_driver", || {
        let device = Device::new();
        let backend = device.backend(&device.first);
        let blocking = stream::create(stream::StreamKind::Default).expect("a blocking stream");
        let non_blocking = device.second.cu_stream();
        let n = 1 << 16;
        let x = backend.alloc::<u8>(n).expect("x");
        let y = backend.alloc::<u8>(n).expect("y");
        let (x, y) = (Cuda::src(&x).addr(), Cuda::src(&y).addr());
        let timing = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let (start, written, copied) = (
            event::create(timing).expect("event"),
            event::create(timing).expect("event"),
            event::create(timing).expect("event"),
        );
        let calls = AtomicUsize::new(0);
        let mut host = vec![0u8; n];
        // SAFETY: x and y are n bytes of device 0, whose context is current; the streams and
        // events are live; `calls` and `host` outlive the synchronisations below.
        unsafe {
            // Written on the blocking stream, copied on the non-blocking one after an event.
            event::record(start, blocking).expect("record");
            driver::memset_d8_async(x, 1, n, blocking).expect("memset");
            event::record(written, blocking).expect("record");
            stream::wait_event(
                non_blocking,
                written,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .expect("wait");
            driver::memcpy_dtod_async(y, x, n, non_blocking).expect("copy");
            event::record(copied, non_blocking).expect("record");
            sys::cuLaunchHostFunc(
                blocking,
                Some(count_call),
                (&raw const calls).cast_mut().cast(),
            )
            .result()
            .expect("host function");
            event::synchronize(copied).expect("event synchronize");
            event::query(copied).expect("a completed event");
            stream::synchronize(blocking).expect("synchronize");
            sys::cuStreamQuery(blocking)
                .result()
                .expect("an idle stream");
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "the host function ran once"
            );
            let ms = event::elapsed(start, written).expect("elapsed time");
            assert!(ms >= 0.0, "elapsed {ms} ms");
            driver::memcpy_dtoh_sync(&mut host, y).expect("download");
            assert!(
                host.iter().all(|&b| b == 1),
                "y was copied before x was written"
            );
            // The legacy stream waits for the blocking stream.
            driver::memset_d8_async(x, 2, n, blocking).expect("memset");
            driver::memcpy_dtoh_sync(&mut host, x).expect("a copy ordered by the legacy stream");
            assert!(
                host.iter().all(|&b| b == 2),
                "the legacy stream did not wait"
            );
            assert_no_faults();
            // It does not wait for the non-blocking one.
            driver::memset_d8_async(x, 3, n, non_blocking).expect("memset");
            driver::memcpy_dtoh_sync(&mut host, x).expect_err("an unordered legacy copy");
            assert_faults(&["race on allocation", "the legacy default stream"]);
            stream::synchronize(non_blocking).expect("synchronize");
            for e in [start, written, copied] {
                event::destroy(e).expect("destroy the event");
            }
            stream::destroy(blocking).expect("destroy the stream");
        }
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// The torch extension's side streams (`new_priority_stream`): each call makes a stream of its
/// own (not one handed out again), at the device's greatest priority (an emulated H100's, -5,
/// where `cuStreamCreate`'s is 0), and non-blocking (a synchronous copy on the legacy default
/// stream after work on it, without a wait, is a race).
#[test]
fn side_streams_are_new_non_blocking_and_of_the_greatest_priority() {
    use cudarc::driver::result as driver;
    use cudarc::driver::sys;
    use sdp4bit::backend::cuda::new_priority_stream;

    let Some(output) = run_isolated(
        "side_streams_are_new_non_blocking_and_of_the_greatest_priority",
        || {
            let device = Device::new();
            let streams = [(); 3].map(|()| new_priority_stream(device.kernels).expect("a stream"));
            for (i, a) in streams.iter().enumerate() {
                for b in &streams[i + 1..] {
                    assert_ne!(a, b, "a side stream was handed out twice");
                }
            }
            let priority = |s: Stream| {
                let mut p = 0;
                // SAFETY: a live stream of the current context.
                unsafe { sys::cuStreamGetPriority(s.handle() as sys::CUstream, &mut p) }
                    .result()
                    .expect("cuStreamGetPriority");
                p
            };
            for s in streams {
                assert_eq!(priority(s), -5, "not the greatest priority");
            }
            assert_eq!(
                priority(device.stream(&device.first)),
                0,
                "the default priority"
            );
            let n = 1 << 12;
            let x = device.backend(&device.first).alloc::<u8>(n).expect("x");
            let x = Cuda::src(&x).addr();
            let side = streams[0].handle() as sys::CUstream;
            let mut host = vec![0u8; n];
            // SAFETY: x is n bytes of device 0, whose context is current; the stream is live.
            unsafe {
                driver::memset_d8_async(x, 3, n, side).expect("memset");
                driver::memcpy_dtoh_sync(&mut host, x).expect_err("an unordered legacy copy");
                assert_faults(&["race on allocation", "the legacy default stream"]);
                driver::stream::synchronize(side).expect("synchronize");
            }
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}
