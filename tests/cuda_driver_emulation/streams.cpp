// Streams: each one a queue run by its own worker thread, which sleeps a random while before
// each operation so that work on different streams interleaves differently on every run. An
// operation runs once the operations its vector clock names have completed; the clock is what
// the stream, the events it waited for, the legacy default stream's implicit synchronisation
// and the enqueuing thread's own synchronisations order before it, and every access to device
// memory is checked against the earlier accesses to the same bytes that the clock does not
// cover (a race: reported, and the operation refused).
#include "model.h"

#include <cstdio>

namespace emu {
namespace {

// How long a host wait or a stream's dependency may take before it is reported as a deadlock.
constexpr auto kDeadlock = std::chrono::seconds(60);
// Accesses kept per allocation (older ones are dropped, which can only hide a race).
constexpr size_t kMaxRecords = 256;

thread_local Clock t_host_clock;
thread_local bool t_in_host_function = false;

uint64_t splitmix(uint64_t& state)
{
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t entry(const Clock& clock, uint32_t stream)
{
    return stream < clock.size() ? clock[stream] : 0;
}

// Whether every operation `op` waits for has completed (its own stream's earlier operations
// run before it anyway).
bool ready(const Driver& d, const Op& op)
{
    for (uint32_t t = 0; t < op.clock.size(); ++t) {
        if (t != op.stream->id && d.completed[t] < op.clock[t]) {
            return false;
        }
    }
    return true;
}

bool overlaps(const Access& a, const AccessRecord& r)
{
    return a.begin < r.end && r.begin < a.end;
}

// Whether `later` (an access of the operation with clock `clock` on `stream`) makes record `r`
// redundant: every future access that races with `r` also races with `later`.
bool supersedes(const Access& later, uint32_t stream, const Clock& clock, const AccessRecord& r)
{
    const bool contains = later.begin <= r.begin && r.end <= later.end;
    return contains && covers(clock, r.stream, r.seq) && (later.write || (!r.write && r.stream == stream));
}

// Runs the operations of `stream` in order until it is destroyed and drained.
void worker(Stream* stream)
{
    Driver& d = driver();
    std::unique_lock<std::mutex> lock(d.mutex);
    for (;;) {
        d.progress.wait(lock, [&] { return !stream->queue.empty() || stream->destroyed; });
        if (stream->queue.empty()) {
            return;
        }
        Op& op = *stream->queue.front();
        const auto deadline = std::chrono::steady_clock::now() + kDeadlock;
        if (!d.progress.wait_until(lock, deadline, [&] { return ready(d, op); })) {
            report_fault(stream->ctx->device->ordinal,
                         name_stream(*stream) + ": " + *op.what + " waited minutes for other streams (a deadlock)");
            d.progress.wait(lock, [&] { return ready(d, op); });
        }
        const unsigned delay = d.max_delay_us == 0 ? 0 : static_cast<unsigned>(splitmix(stream->rng) % d.max_delay_us);
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
        t_in_host_function = std::string(op.kind) == "host function";
        const Outcome outcome = op.run ? op.run() : Outcome{};
        t_in_host_function = false;
        lock.lock();
        if (outcome.code != CUDA_SUCCESS) {
            report_fault(stream->ctx->device->ordinal, name_stream(*stream) + ": " + outcome.message);
            if (stream->ctx->sticky == CUDA_SUCCESS) {
                stream->ctx->sticky = outcome.code;
            }
        }
        d.completed[stream->id] = op.seq;
        ++d.completed_by_kind[op.kind];
        if (op.complete) {
            op.complete();
        }
        stream->queue.pop_front();
        d.progress.notify_all();
    }
}

}  // namespace

void join(Clock& into, const Clock& from)
{
    if (into.size() < from.size()) {
        into.resize(from.size(), 0);
    }
    for (size_t t = 0; t < from.size(); ++t) {
        into[t] = std::max(into[t], from[t]);
    }
}

bool covers(const Clock& clock, uint32_t stream, uint64_t seq)
{
    return entry(clock, stream) >= seq;
}

Clock& host_clock()
{
    return t_host_clock;
}

bool in_host_function()
{
    return t_in_host_function;
}

Stream* create_stream(Context* ctx, StreamKind kind, bool blocking)
{
    Driver& d = driver();
    auto stream = std::make_unique<Stream>();
    Stream* s = stream.get();
    s->id = static_cast<uint32_t>(d.streams.size());
    s->ctx = ctx;
    s->kind = kind;
    s->blocking = blocking;
    s->rng = d.seed ^ (0x51ed2701u * (s->id + 1ull));
    d.streams.push_back(std::move(stream));
    d.completed.push_back(0);
    if (kind == StreamKind::created) {
        d.live_streams.insert(s);
        if (blocking) {
            ctx->blocking.push_back(s);
        }
    }
    std::thread(worker, s).detach();
    return s;
}

Stream* resolve_stream(CUstream handle, Context* current)
{
    const auto raw = reinterpret_cast<uintptr_t>(handle);
    if (raw == 0 || raw == CU_STREAM_LEGACY) {
        return current == nullptr ? nullptr : current->legacy;
    }
    Driver& d = driver();
    if (d.live_streams.count(handle) == 0) {
        return nullptr;
    }
    auto* s = reinterpret_cast<Stream*>(handle);
    return s->ctx == current ? s : nullptr;
}

std::string name_stream(const Stream& s)
{
    const char* kind = s.kind == StreamKind::legacy ? "the legacy default stream" : "stream";
    return std::string(kind) + " #" + std::to_string(s.id) + " of device " + std::to_string(s.ctx->device->ordinal);
}

CUresult enqueue(Stream* stream, std::unique_ptr<Op> op, uint64_t* seq_out)
{
    Driver& d = driver();
    Clock clock = stream->last;
    join(clock, t_host_clock);
    // The legacy default stream waits for, and is waited for by, every blocking stream.
    if (stream->kind == StreamKind::legacy) {
        for (const Stream* s : stream->ctx->blocking) {
            join(clock, s->last);
        }
    } else if (stream->blocking) {
        join(clock, stream->ctx->legacy->last);
    }
    join(clock, op->clock);
    const uint64_t seq = stream->enqueued + 1;
    if (clock.size() <= stream->id) {
        clock.resize(stream->id + 1, 0);
    }
    clock[stream->id] = seq;

    for (const Access& a : op->accesses) {
        for (const AccessRecord& r : a.allocation->records) {
            if (overlaps(a, r) && (a.write || r.write) && !covers(clock, r.stream, r.seq)) {
                const Stream& other = *d.streams[r.stream];
                report_fault(stream->ctx->device->ordinal,
                             "race on " + name_allocation(*a.allocation) + ": " + *op->what + " on " +
                                 name_stream(*stream) + (a.write ? " writes" : " reads") + " bytes [" +
                                 std::to_string(a.begin) + ", " + std::to_string(a.end) + ") that " + *r.what +
                                 " on " + name_stream(other) + (r.write ? " writes" : " reads") +
                                 ", and nothing orders the two (a missing stream wait or synchronisation)");
                return CUDA_ERROR_ILLEGAL_STATE;
            }
        }
    }
    for (const Access& a : op->accesses) {
        auto& records = a.allocation->records;
        std::erase_if(records, [&](const AccessRecord& r) { return supersedes(a, stream->id, clock, r); });
        if (records.size() >= kMaxRecords) {
            records.erase(records.begin());
        }
        records.push_back(AccessRecord{stream->id, seq, a.begin, a.end, a.write, op->what});
    }

    op->stream = stream;
    op->seq = seq;
    op->clock = clock;
    stream->enqueued = seq;
    stream->last = clock;
    stream->queue.push_back(std::move(op));
    if (seq_out != nullptr) {
        *seq_out = seq;
    }
    d.progress.notify_all();
    return CUDA_SUCCESS;
}

CUresult wait_for(std::unique_lock<std::mutex>& lock, uint32_t stream, uint64_t seq, Clock clock)
{
    Driver& d = driver();
    const auto deadline = std::chrono::steady_clock::now() + kDeadlock;
    if (!d.progress.wait_until(lock, deadline, [&] { return d.completed[stream] >= seq; })) {
        report_fault(d.streams[stream]->ctx->device->ordinal,
                     "a host wait for " + name_stream(*d.streams[stream]) + " took minutes (a deadlock)");
        return CUDA_ERROR_LAUNCH_TIMEOUT;
    }
    join(t_host_clock, clock);
    return CUDA_SUCCESS;
}

bool learn_if_complete(uint32_t stream, uint64_t seq, const Clock& clock)
{
    if (driver().completed[stream] < seq) {
        return false;
    }
    join(t_host_clock, clock);
    return true;
}

bool host_knows_all(const Allocation& allocation, std::string& why)
{
    const Driver& d = driver();
    for (const AccessRecord& r : allocation.records) {
        if (!covers(t_host_clock, r.stream, r.seq)) {
            why = *r.what + " on " + name_stream(*d.streams[r.stream]) +
                (d.completed[r.stream] >= r.seq ? " (completed, but the host never synchronised with it)"
                                                 : " (still queued or running)");
            return false;
        }
    }
    return true;
}

}  // namespace emu
