// Device memory: allocation, freeing, copies and memsets; pinned host memory. Every device range
// an entry point is given must lie inside one live allocation of the current context's device,
// else the call reports a fault and fails. Copies and memsets are stream operations (the
// synchronous ones on the legacy default stream, then waited for, as the driver does for
// pageable memory; a copy to the host returns once done unless its destination lies inside
// pinned memory from cuMemHostAlloc, which it then writes when its stream runs it). Freeing
// memory that an operation the host has not synchronised with still uses is a fault, and so is
// freeing pinned memory a queued copy still writes.
#include "model.h"

#include <cstdlib>
#include <cstring>

namespace emu {
namespace {

// Checks a device range of a call; reports a fault naming the call and argument when it is bad.
Allocation* device_range(const char* call, const char* argument, CUdeviceptr addr, size_t bytes, const Context* ctx)
{
    std::string why;
    Allocation* a = check_range(addr, bytes, ctx->device, why);
    if (a == nullptr) {
        report_fault(ctx->device->ordinal, std::string(call) + ": " + argument + ": " + why);
    }
    return a;
}

Access access_of(Allocation* a, CUdeviceptr addr, size_t bytes, bool write)
{
    return Access{a, addr - a->base, addr - a->base + bytes, write};
}

// Enqueues `op` on the stream `handle` names for `ctx`; with `wait`, returns once it ran.
// `enqueued`, when given, receives the stream id and sequence number of the operation.
CUresult submit(std::unique_lock<std::mutex>& lock, const char* call, Context* ctx, CUstream handle,
                std::unique_ptr<Op> op, bool wait, std::pair<uint32_t, uint64_t>* enqueued = nullptr)
{
    Stream* stream = resolve_stream(handle, ctx);
    if (stream == nullptr) {
        report_fault(ctx->device->ordinal, std::string(call) + ": not a live stream of the current context");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t seq = 0;
    if (const CUresult r = enqueue(stream, std::move(op), &seq); r != CUDA_SUCCESS) {
        return r;
    }
    if (enqueued != nullptr) {
        *enqueued = {stream->id, seq};
    }
    if (!wait) {
        return CUDA_SUCCESS;
    }
    count_host_sync(call);
    if (const CUresult r = wait_for(lock, stream->id, seq, stream->last); r != CUDA_SUCCESS) {
        return r;
    }
    return ctx->sticky;
}

std::unique_ptr<Op> make_op(const char* kind, std::string what)
{
    auto op = std::make_unique<Op>();
    op->kind = kind;
    op->what = std::make_shared<const std::string>(std::move(what));
    return op;
}

std::string bytes_text(size_t bytes)
{
    return " of " + std::to_string(bytes) + " bytes";
}

CUresult copy_to_device(const char* call, CUdeviceptr dst, const void* src, size_t bytes, CUstream stream,
                        bool wait)
{
    std::unique_lock<std::mutex> lock(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check(call, &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (bytes == 0) {
        return CUDA_SUCCESS;
    }
    Allocation* a = device_range(call, "destination", dst, bytes, ctx);
    if (a == nullptr || src == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto op = make_op("copy", std::string(call) + bytes_text(bytes));
    op->accesses.push_back(access_of(a, dst, bytes, true));
    auto staged = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src),
                                                         static_cast<const uint8_t*>(src) + bytes);
    op->run = [dst, staged] {
        std::memcpy(reinterpret_cast<void*>(dst), staged->data(), staged->size());
        return Outcome{};
    };
    return submit(lock, call, ctx, stream, std::move(op), wait);
}

// The pinned allocation holding [addr, addr + bytes), or null. Locked.
PinnedHost* find_pinned(const void* addr, size_t bytes)
{
    const auto at = reinterpret_cast<uint64_t>(addr);
    auto& pinned = driver().pinned;
    auto it = pinned.upper_bound(at);
    if (it == pinned.begin()) {
        return nullptr;
    }
    --it;
    return at + bytes <= it->first + it->second.size ? &it->second : nullptr;
}

// With `asynchronous` (cuMemcpyDtoHAsync), a copy into pinned memory returns once enqueued.
CUresult copy_to_host(const char* call, void* dst, CUdeviceptr src, size_t bytes, CUstream stream,
                      bool asynchronous)
{
    std::unique_lock<std::mutex> lock(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check(call, &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (bytes == 0) {
        return CUDA_SUCCESS;
    }
    Allocation* a = device_range(call, "source", src, bytes, ctx);
    if (a == nullptr || dst == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto op = make_op("copy", std::string(call) + bytes_text(bytes));
    op->accesses.push_back(access_of(a, src, bytes, false));
    op->run = [dst, src, bytes] {
        std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
        return Outcome{};
    };
    PinnedHost* pinned = asynchronous ? find_pinned(dst, bytes) : nullptr;
    if (pinned == nullptr) {
        return submit(lock, call, ctx, stream, std::move(op), true);
    }
    std::pair<uint32_t, uint64_t> enqueued;
    const CUresult r = submit(lock, call, ctx, stream, std::move(op), false, &enqueued);
    if (r == CUDA_SUCCESS) {
        pinned->writers.push_back(enqueued);
    }
    return r;
}

CUresult copy_on_device(const char* call, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream, bool wait)
{
    std::unique_lock<std::mutex> lock(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check(call, &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (bytes == 0) {
        return CUDA_SUCCESS;
    }
    Allocation* to = device_range(call, "destination", dst, bytes, ctx);
    Allocation* from = device_range(call, "source", src, bytes, ctx);
    if (to == nullptr || from == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto op = make_op("copy", std::string(call) + bytes_text(bytes));
    op->accesses.push_back(access_of(from, src, bytes, false));
    op->accesses.push_back(access_of(to, dst, bytes, true));
    op->run = [dst, src, bytes] {
        std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
        return Outcome{};
    };
    return submit(lock, call, ctx, stream, std::move(op), wait);
}

// Fills `count` elements of `width` bytes (1 or 4) at `dst` with `value`.
CUresult memset(const char* call, CUdeviceptr dst, unsigned value, size_t width, size_t count, CUstream stream,
                bool wait)
{
    std::unique_lock<std::mutex> lock(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check(call, &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (count == 0) {
        return CUDA_SUCCESS;
    }
    if (dst % width != 0) {
        report_fault(ctx->device->ordinal, std::string(call) + ": destination not " + std::to_string(width) +
                                               "-byte aligned");
        return CUDA_ERROR_INVALID_VALUE;
    }
    const size_t bytes = width * count;
    Allocation* a = device_range(call, "destination", dst, bytes, ctx);
    if (a == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto op = make_op("memset", std::string(call) + bytes_text(bytes));
    op->accesses.push_back(access_of(a, dst, bytes, true));
    op->run = [dst, value, width, count] {
        auto* out = reinterpret_cast<uint8_t*>(dst);
        for (size_t i = 0; i < count; ++i) {
            std::memcpy(out + i * width, &value, width);
        }
        return Outcome{};
    };
    return submit(lock, call, ctx, stream, std::move(op), wait);
}

}  // namespace
}  // namespace emu

using namespace emu;

extern "C" {

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t bytes)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuMemAlloc", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (ptr == nullptr || bytes == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Allocation* a = allocate_device(ctx->device, bytes);
    if (a == nullptr) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = a->base;
    ++driver().completed_by_kind["allocation"];
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr)
{
    // The driver synchronises the device before it frees.
    count_host_sync("cuMemFree");
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuMemFree", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    Allocation* a = find_allocation(ptr);
    if (a == nullptr || a->base != ptr) {
        report_fault(ctx->device->ordinal, "cuMemFree: " + describe_address(ptr) + ", not the start of a live allocation");
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::string why;
    if (!host_knows_all(*a, why)) {
        // Kept mapped (never released), so the operation still using it does not fault.
        report_fault(ctx->device->ordinal, "cuMemFree of " + name_allocation(*a) + " while " + why +
                                               " may still use it (a missing synchronisation before the free)");
        retire(a);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    retire(a);
    release(a);
    ++driver().completed_by_kind["free"];
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** ptr, size_t bytes, unsigned flags)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuMemHostAlloc", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (ptr == nullptr || bytes == 0 || flags > 7) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // Filled with a garbage byte, as device memory is: nothing reads it before a copy lands.
    void* block = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (block == nullptr) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    std::memset(block, 0xa5, bytes);
    driver().pinned[reinterpret_cast<uint64_t>(block)].size = bytes;
    *ptr = block;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* ptr)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuMemFreeHost"); r != CUDA_SUCCESS) {
        return r;
    }
    Driver& d = driver();
    auto it = d.pinned.find(reinterpret_cast<uint64_t>(ptr));
    if (it == d.pinned.end()) {
        report_fault(-1, "cuMemFreeHost: not the start of a live cuMemHostAlloc allocation");
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (const auto& [stream, seq] : it->second.writers) {
        if (d.completed[stream] < seq) {
            // Kept allocated (never released), so the queued copy still lands in live memory.
            report_fault(-1, "cuMemFreeHost of pinned memory that a copy queued on " +
                                 name_stream(*d.streams[stream]) +
                                 " still writes (a missing synchronisation before the free)");
            d.pinned.erase(it);
            return CUDA_ERROR_ILLEGAL_STATE;
        }
    }
    d.pinned.erase(it);
    std::free(ptr);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes)
{
    return copy_to_device("cuMemcpyHtoD", dst, src, bytes, nullptr, true);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream)
{
    return copy_to_device("cuMemcpyHtoDAsync", dst, src, bytes, stream, false);
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes)
{
    return copy_to_host("cuMemcpyDtoH", dst, src, bytes, nullptr, false);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream)
{
    return copy_to_host("cuMemcpyDtoHAsync", dst, src, bytes, stream, true);
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes)
{
    return copy_on_device("cuMemcpyDtoD", dst, src, bytes, nullptr, true);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream)
{
    return copy_on_device("cuMemcpyDtoDAsync", dst, src, bytes, stream, false);
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count)
{
    return memset("cuMemsetD8", dst, value, 1, count, nullptr, true);
}

CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t count)
{
    return memset("cuMemsetD32", dst, value, 4, count, nullptr, true);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream)
{
    return memset("cuMemsetD8Async", dst, value, 1, count, stream, false);
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t count, CUstream stream)
{
    return memset("cuMemsetD32Async", dst, value, 4, count, stream, false);
}

}  // extern "C"
