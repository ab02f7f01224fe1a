// Streams, events and host functions: cuStreamCreate / CreateWithPriority / GetPriority /
// Destroy / Synchronize / Query / WaitEvent, cuCtxGetStreamPriorityRange, cuCtxSynchronize,
// cuEventCreate / Destroy / Record / Query / Synchronize / ElapsedTime and cuLaunchHostFunc,
// with the driver's semantics for the legacy default stream (handle 0): it waits for, and is
// waited for by, every stream created without CU_STREAM_NON_BLOCKING.
#include "model.h"

#include <algorithm>

namespace emu {
namespace {

std::unique_ptr<Op> marker(const char* kind, const std::string& what)
{
    auto op = std::make_unique<Op>();
    op->kind = kind;
    op->what = std::make_shared<const std::string>(what);
    return op;
}

Event* live_event(CUevent handle)
{
    return driver().live_events.count(handle) != 0 ? reinterpret_cast<Event*>(handle) : nullptr;
}

// Waits for everything enqueued so far on `stream`.
CUresult drain(std::unique_lock<std::mutex>& lock, Stream* stream)
{
    return wait_for(lock, stream->id, stream->enqueued, stream->last);
}

// cuStreamCreate(WithPriority): a priority outside the range is clamped to it, as the driver
// does.
CUresult new_stream(const char* call, CUstream* stream, unsigned flags, int priority)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check(call, &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (stream == nullptr || (flags & ~CU_STREAM_NON_BLOCKING) != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Stream* s = create_stream(ctx, StreamKind::created, (flags & CU_STREAM_NON_BLOCKING) == 0);
    s->priority = std::clamp(priority, kGreatestStreamPriority, 0);
    *stream = reinterpret_cast<CUstream>(s);
    return CUDA_SUCCESS;
}

}  // namespace
}  // namespace emu

using namespace emu;

extern "C" {

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuCtxGetStreamPriorityRange", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (least != nullptr) {
        *least = 0;
    }
    if (greatest != nullptr) {
        *greatest = kGreatestStreamPriority;
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned flags, int priority)
{
    return new_stream("cuStreamCreateWithPriority", stream, flags, priority);
}

CUresult cuStreamCreate(CUstream* stream, unsigned flags)
{
    return new_stream("cuStreamCreate", stream, flags, 0);
}

CUresult cuStreamGetPriority(CUstream stream, int* priority)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuStreamGetPriority", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    const Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr || priority == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *priority = s->priority;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuStreamIsCapturing", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    const Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr || status == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *status = s->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream stream)
{
    Driver& d = driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    if (const CUresult r = entry_check("cuStreamDestroy"); r != CUDA_SUCCESS) {
        return r;
    }
    if (d.live_streams.erase(stream) == 0) {
        report_fault(-1, "cuStreamDestroy: not a live stream created with cuStreamCreate");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // As on the driver: the call returns at once, queued work still completes.
    auto* s = reinterpret_cast<Stream*>(stream);
    s->destroyed = true;
    std::erase(s->ctx->blocking, s);
    d.progress.notify_all();
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream)
{
    count_host_sync("cuStreamSynchronize");
    std::unique_lock<std::mutex> lock(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuStreamSynchronize", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr) {
        report_fault(ctx->device->ordinal, "cuStreamSynchronize: not a live stream of the current context");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (const CUresult r = drain(lock, s); r != CUDA_SUCCESS) {
        return r;
    }
    return ctx->sticky;
}

CUresult cuStreamQuery(CUstream stream)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuStreamQuery", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return learn_if_complete(s->id, s->enqueued, s->last) ? ctx->sticky : CUDA_ERROR_NOT_READY;
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuStreamWaitEvent", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Stream* s = resolve_stream(stream, ctx);
    const Event* e = live_event(event);
    if (s == nullptr || e == nullptr || flags != 0) {
        report_fault(ctx->device->ordinal, "cuStreamWaitEvent: bad stream, event or flags");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // Waiting for an event never recorded waits for nothing.
    auto op = marker("event wait", "cuStreamWaitEvent");
    if (e->recorded) {
        op->clock = e->clock;
    }
    return enqueue(s, std::move(op));
}

CUresult cuCtxSynchronize(void)
{
    count_host_sync("cuCtxSynchronize");
    Driver& d = driver();
    std::unique_lock<std::mutex> lock(d.mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuCtxSynchronize", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    for (size_t i = 0; i < d.streams.size(); ++i) {
        Stream* s = d.streams[i].get();
        if (s->ctx == ctx) {
            if (const CUresult r = drain(lock, s); r != CUDA_SUCCESS) {
                return r;
            }
        }
    }
    return ctx->sticky;
}

CUresult cuEventCreate(CUevent* event, unsigned flags)
{
    Driver& d = driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuEventCreate", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (event == nullptr || (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING)) != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto e = std::make_unique<Event>();
    e->ctx = ctx;
    e->flags = flags;
    d.live_events.insert(e.get());
    *event = reinterpret_cast<CUevent>(e.get());
    d.events.push_back(std::move(e));
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event)
{
    Driver& d = driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    if (const CUresult r = entry_check("cuEventDestroy"); r != CUDA_SUCCESS) {
        return r;
    }
    // The event object is kept (a pending record operation still points to it).
    return d.live_events.erase(event) != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventRecord(CUevent event, CUstream stream)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuEventRecord", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Event* e = live_event(event);
    Stream* s = resolve_stream(stream, ctx);
    if (e == nullptr || s == nullptr || e->ctx != ctx) {
        report_fault(ctx->device->ordinal, "cuEventRecord: bad event or stream");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    auto op = marker("event record", "cuEventRecord");
    op->complete = [e] { e->time = std::chrono::steady_clock::now(); };
    uint64_t seq = 0;
    if (const CUresult r = enqueue(s, std::move(op), &seq); r != CUDA_SUCCESS) {
        return r;
    }
    e->recorded = true;
    e->stream = s->id;
    e->seq = seq;
    e->clock = s->last;
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent event)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuEventQuery"); r != CUDA_SUCCESS) {
        return r;
    }
    const Event* e = live_event(event);
    if (e == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (!e->recorded) {
        return CUDA_SUCCESS;
    }
    return learn_if_complete(e->stream, e->seq, e->clock) ? e->ctx->sticky : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent event)
{
    count_host_sync("cuEventSynchronize");
    std::unique_lock<std::mutex> lock(driver().mutex);
    if (const CUresult r = entry_check("cuEventSynchronize"); r != CUDA_SUCCESS) {
        return r;
    }
    const Event* e = live_event(event);
    if (e == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (!e->recorded) {
        return CUDA_SUCCESS;
    }
    if (const CUresult r = wait_for(lock, e->stream, e->seq, e->clock); r != CUDA_SUCCESS) {
        return r;
    }
    return e->ctx->sticky;
}

CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuEventElapsedTime"); r != CUDA_SUCCESS) {
        return r;
    }
    const Event* a = live_event(start);
    const Event* b = live_event(end);
    if (ms == nullptr || a == nullptr || b == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) != 0 || !a->recorded || !b->recorded) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    const Driver& d = driver();
    if (d.completed[a->stream] < a->seq || d.completed[b->stream] < b->seq) {
        return CUDA_ERROR_NOT_READY;
    }
    *ms = std::chrono::duration<float, std::milli>(b->time - a->time).count();
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuLaunchHostFunc", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr || fn == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto op = marker("host function", "a host function");
    op->run = [fn, user_data] {
        fn(user_data);
        return Outcome{};
    };
    return enqueue(s, std::move(op));
}

}  // extern "C"
