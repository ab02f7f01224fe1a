// In-process communicators whose collectives are stream operations, as NCCL's are: a rank's
// call enqueues an operation on its stream (reading its send buffer, writing its receive
// buffer); the operations of one collective meet on the ranks' stream workers, each copies
// (or sums, in rank order) what it receives from its peers' send buffers, and none completes
// before all have read (so no peer's later work can overwrite a send buffer still being read).
// A MAX all-reduce of an f32 word (in place) reads every rank's word before any rank writes.
// Calls are matched by their order on the communicator, as NCCL matches them; a rank whose
// peers never arrive, or whose peers called a different collective or sizes, fails its
// operation (a fault, sticky on its context).
#include "model.h"

#include <cstring>
#include <limits>
#include <tuple>

namespace emu {
namespace {

constexpr auto kMeetTimeout = std::chrono::seconds(60);

enum class CollectiveKind : int { all_gather = 0, all_to_all = 1, reduce_scatter_sum = 2, all_reduce_max = 3 };

// The element types a reduce-scatter sums (the Rust `SumElement`s).
enum class DType : int { f32 = 0, i8 = 1, i16 = 2 };

struct Post {
    CollectiveKind kind{};
    DType dtype{};
    const uint8_t* send = nullptr;
    size_t send_bytes = 0;
    uint8_t* recv = nullptr;
    size_t recv_bytes = 0;
};

// One collective call, met by every rank.
struct Meeting {
    std::vector<Post> posts;
    size_t arrived = 0;
    // Ranks that have read every peer's word (all-reduces, which write where they read).
    size_t read = 0;
    size_t finished = 0;
};

struct Communicator {
    int size = 0;
    std::mutex mutex;
    std::condition_variable changed;
    // Calls made so far by each rank (the index of its next call).
    std::vector<uint64_t> calls;
    std::map<uint64_t, Meeting> meetings;
};

const char* kind_name(CollectiveKind kind)
{
    switch (kind) {
    case CollectiveKind::all_gather:
        return "all_gather";
    case CollectiveKind::all_to_all:
        return "all_to_all";
    case CollectiveKind::reduce_scatter_sum:
        return "reduce_scatter_sum";
    case CollectiveKind::all_reduce_max:
        return "all_reduce_max";
    }
    return "?";
}

// The bytes `rank` receives from `peer`, as a (source, length) pair.
std::pair<const uint8_t*, size_t> incoming(const Post& from, const Post& mine, int rank, int size)
{
    switch (mine.kind) {
    case CollectiveKind::all_gather:
    case CollectiveKind::all_reduce_max:
        return {from.send, from.send_bytes};
    case CollectiveKind::all_to_all:
    case CollectiveKind::reduce_scatter_sum: {
        const size_t block = from.send_bytes / static_cast<size_t>(size);
        return {from.send + block * static_cast<size_t>(rank), block};
    }
    }
    return {nullptr, 0};
}

template <class T>
std::string sum_into(T* acc, const T* add, size_t count)
{
    for (size_t i = 0; i < count; ++i) {
        if constexpr (std::is_integral_v<T>) {
            const int wide = static_cast<int>(acc[i]) + static_cast<int>(add[i]);
            if (wide < std::numeric_limits<T>::min() || wide > std::numeric_limits<T>::max()) {
                return "integer sum overflows at element " + std::to_string(i);
            }
            acc[i] = static_cast<T>(wide);
        } else {
            acc[i] = acc[i] + add[i];
        }
    }
    return {};
}

// Checks that every rank called the same collective with matching sizes.
std::string check_posts(const std::vector<Post>& posts)
{
    const Post& first = posts[0];
    const size_t n = posts.size();
    for (size_t r = 0; r < n; ++r) {
        const Post& p = posts[r];
        if (p.kind != first.kind || p.dtype != first.dtype || p.send_bytes != first.send_bytes) {
            return "rank " + std::to_string(r) + " called " + kind_name(p.kind) + " of " +
                std::to_string(p.send_bytes) + " bytes, rank 0 " + kind_name(first.kind) + " of " +
                std::to_string(first.send_bytes);
        }
        if (first.kind == CollectiveKind::all_reduce_max) {
            if (p.dtype != DType::f32 || p.send_bytes != 4 || p.recv_bytes != 4) {
                return "rank " + std::to_string(r) + ": all_reduce_max of " + std::to_string(p.send_bytes) +
                    " bytes in, " + std::to_string(p.recv_bytes) + " out (one f32 each)";
            }
            continue;
        }
        const size_t want = first.kind == CollectiveKind::all_gather ? p.send_bytes * n
            : first.kind == CollectiveKind::all_to_all             ? p.send_bytes
                                                                   : p.send_bytes / n;
        if (p.recv_bytes != want || (first.kind != CollectiveKind::all_gather && p.send_bytes % n != 0)) {
            return "rank " + std::to_string(r) + ": receive buffer of " + std::to_string(p.recv_bytes) +
                " bytes for a send buffer of " + std::to_string(p.send_bytes);
        }
    }
    return {};
}

// The maximum of every rank's word (+Inf wins; a NaN is an error: callers map it to +Inf).
std::string max_of_words(const std::vector<Post>& posts, float& max)
{
    max = -std::numeric_limits<float>::infinity();
    for (size_t r = 0; r < posts.size(); ++r) {
        float v = 0.0f;
        std::memcpy(&v, posts[r].send, 4);
        if (v != v) {
            return "all_reduce_max: rank " + std::to_string(r) + " passed a NaN";
        }
        max = v > max ? v : max;
    }
    return {};
}

// What one rank's operation does once all have arrived: fills its receive buffer (not for
// all-reduces, which meet writes).
std::string receive(const std::vector<Post>& posts, int rank)
{
    const int size = static_cast<int>(posts.size());
    const Post& mine = posts[static_cast<size_t>(rank)];
    size_t at = 0;
    for (int peer = 0; peer < size; ++peer) {
        const auto [src, len] = incoming(posts[static_cast<size_t>(peer)], mine, rank, size);
        if (len == 0) {
            continue;
        }
        if (mine.kind != CollectiveKind::reduce_scatter_sum) {
            std::memcpy(mine.recv + at, src, len);
            at += len;
            continue;
        }
        if (peer == 0) {
            std::memcpy(mine.recv, src, len);
            continue;
        }
        std::string err;
        switch (mine.dtype) {
        case DType::f32:
            err = sum_into(reinterpret_cast<float*>(mine.recv), reinterpret_cast<const float*>(src), len / 4);
            break;
        case DType::i8:
            err = sum_into(reinterpret_cast<int8_t*>(mine.recv), reinterpret_cast<const int8_t*>(src), len);
            break;
        case DType::i16:
            err = sum_into(reinterpret_cast<int16_t*>(mine.recv), reinterpret_cast<const int16_t*>(src), len / 2);
            break;
        }
        if (!err.empty()) {
            return err;
        }
    }
    return {};
}

// The body of one rank's collective operation, on its stream's worker.
Outcome meet(Communicator& comm, uint64_t call, int rank, const Post& post)
{
    std::unique_lock<std::mutex> lock(comm.mutex);
    Meeting& m = comm.meetings[call];
    m.posts.resize(static_cast<size_t>(comm.size));
    m.posts[static_cast<size_t>(rank)] = post;
    ++m.arrived;
    comm.changed.notify_all();
    const std::string what = std::string(kind_name(post.kind)) + " (call " + std::to_string(call) + ", rank " +
        std::to_string(rank) + " of " + std::to_string(comm.size) + ")";
    if (!comm.changed.wait_for(lock, kMeetTimeout, [&] { return m.arrived == m.posts.size(); })) {
        return {CUDA_ERROR_LAUNCH_TIMEOUT, what + ": the other ranks never arrived"};
    }
    std::string err = check_posts(m.posts);
    if (err.empty() && post.kind == CollectiveKind::all_reduce_max) {
        float max = 0.0f;
        err = max_of_words(m.posts, max);
        ++m.read;
        comm.changed.notify_all();
        comm.changed.wait(lock, [&] { return m.read == m.posts.size(); });
        if (err.empty()) {
            std::memcpy(post.recv, &max, 4);
        }
    } else if (err.empty()) {
        // The peers' send buffers are read outside the lock: nobody writes them until all
        // have finished.
        lock.unlock();
        err = receive(m.posts, rank);
        lock.lock();
    }
    ++m.finished;
    comm.changed.notify_all();
    comm.changed.wait(lock, [&] { return m.finished == m.posts.size(); });
    // The last rank to leave removes the meeting.
    if (--m.arrived == 0) {
        comm.meetings.erase(call);
    }
    if (!err.empty()) {
        return {CUDA_ERROR_LAUNCH_FAILED, what + ": " + err};
    }
    return {};
}

}  // namespace
}  // namespace emu

using namespace emu;

extern "C" {

// A communicator of `size` ranks (never freed); NULL when size < 1.
SDP4BIT_EXPORT void* sdp4bit_emu_comm_create(int size)
{
    if (size < 1) {
        return nullptr;
    }
    auto* comm = new Communicator;
    comm->size = size;
    comm->calls.assign(static_cast<size_t>(size), 0);
    return comm;
}

// Enqueues rank `rank`'s part of a collective of `kind` (0 all-gather, 1 all-to-all, 2
// reduce-scatter sum of `dtype` 0 f32, 1 i8, 2 i16, 3 in-place MAX all-reduce of one f32, where
// `send` and `recv` are the same word) on `stream` of the current context: it
// reads `send_bytes` at `send` and writes `recv_bytes` at `recv`, both device memory of that
// context's device.
SDP4BIT_EXPORT CUresult sdp4bit_emu_comm_enqueue(void* handle, int rank, int kind, int dtype, CUdeviceptr send,
                                                 size_t send_bytes, CUdeviceptr recv, size_t recv_bytes,
                                                 CUstream stream)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("sdp4bit_emu_comm_enqueue", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    auto* comm = static_cast<Communicator*>(handle);
    if (comm == nullptr || rank < 0 || rank >= comm->size || kind < 0 || kind > 3 || dtype < 0 || dtype > 2) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    const std::string what = std::string("collective ") + kind_name(static_cast<CollectiveKind>(kind));
    auto op = std::make_unique<Op>();
    op->kind = "collective";
    op->what = std::make_shared<const std::string>(what);
    Post post;
    post.kind = static_cast<CollectiveKind>(kind);
    post.dtype = static_cast<DType>(dtype);
    post.send_bytes = send_bytes;
    post.recv_bytes = recv_bytes;
    for (const auto& [addr, bytes, write] :
         {std::tuple{send, send_bytes, false}, std::tuple{recv, recv_bytes, true}}) {
        if (bytes == 0) {
            continue;
        }
        std::string why;
        Allocation* a = check_range(addr, bytes, ctx->device, why);
        if (a == nullptr) {
            report_fault(ctx->device->ordinal, what + ": " + (write ? "receive" : "send") + " buffer: " + why);
            return CUDA_ERROR_INVALID_VALUE;
        }
        op->accesses.push_back(Access{a, addr - a->base, addr - a->base + bytes, write});
    }
    post.send = reinterpret_cast<const uint8_t*>(send);
    post.recv = reinterpret_cast<uint8_t*>(recv);
    uint64_t call = 0;
    {
        std::lock_guard<std::mutex> comm_guard(comm->mutex);
        call = comm->calls[static_cast<size_t>(rank)]++;
    }
    op->run = [comm, call, rank, post] { return meet(*comm, call, rank, post); };
    return enqueue(s, std::move(op));
}

}  // extern "C"
