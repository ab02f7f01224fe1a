// The stream order of cpp/stream_order.h on a model of a device, run by tests/stream_order.rs.
//
// The model: streams are queues of operations (memory accesses, event records, event waits)
// that the host enqueues and the device runs later, each stream in order, in a random
// interleaving of the streams; a wait runs once the event's record has run. Vector clocks give
// the happens-before order, and every pair of accesses to the same memory from different
// streams, one of them a write, must be ordered by it. The caching allocator is modelled as
// torch's: a freed block is handed out again on the stream it was allocated on, and when it
// was recorded on other streams (record_stream) only once those streams have passed the
// point of the free (the allocator checks that on the host: the new user's stream does not
// wait, its accesses to that memory just come after).
//
// The scenarios are a training step's use of the two collectives on CUDA. Gradients: the
// compute stream writes the gradient bucket, start() enqueues the reduce-scatter (kernels on
// the side stream, an exchange on a communication stream of its own as ProcessGroupNCCL's),
// the compute stream goes on with other work, frees the bucket and reuses its memory, calls
// wait() and reads the shard. Weights: the optimizer writes this rank's shard of the params,
// start() enqueues the all-gather (which reads and rewrites the params), the compute stream
// runs other layers, calls wait() and reads the params. Pipelined gradients: the chunk loop of
// the Rust core (src/collective/gradient.rs) for P = 3 chunks, each chunk's exchange issued
// asynchronously while the side stream quantizes the next chunk and reduces the previous one,
// then the bucket is dropped and re-created while the collective may still run (the new
// bucket's set-up writes its tables into the memory the allocator took back). Overlapped
// kinds: FSDP2's backward, a unit's reduce-scatter and then the next unit's all-gather while
// the reduce-scatter still runs, each on the side stream SideStreams gives its kind. Checked
// for many interleavings: no unordered access, the compute stream's work between start() and
// wait() never waits for the collective, and nothing of the all-gather waits for the
// reduce-scatter. Each step of the order is then removed in turn (a sabotaged device), and
// the model must catch each in some scenario; SideStreams' choice of streams is checked
// directly too.
//
// Prints one line per case and exits non-zero if any check fails.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "stream_order.h"

namespace {

using Clock = std::vector<uint32_t>;

struct Op {
  enum Kind { Access, Record, Wait };
  explicit Op(Kind k) : kind(k) {}

  Kind kind;
  int block = -1;          // Access: the memory block
  bool write = false;      // Access
  int event = -1;          // Record / Wait
  std::vector<int> gates;  // Access: events the memory was handed out after (allocator)
  bool collective = false; // enqueued by the collective (inside start())
  bool independent = false;  // must not wait for any collective op
  int overlaps = -1;         // Access: an event it must not be ordered after (-1: none)
  std::string what;
};

// What the model found wrong in one run, or "".
struct Run {
  std::string problem;
};

class Model {
 public:
  explicit Model(int streams) : queues_(streams) {}

  int new_event() {
    event_clocks_.emplace_back();
    event_streams_.push_back(-1);
    return static_cast<int>(event_clocks_.size()) - 1;
  }

  void push(int stream, Op op) {
    op.collective = in_collective_;
    queues_[stream].push_back(std::move(op));
  }

  void access(int stream, int block, bool write, std::string what, bool independent = false,
              int overlaps = -1) {
    Op op(Op::Access);
    op.block = block;
    op.write = write;
    op.independent = independent;
    op.overlaps = overlaps;
    op.what = std::move(what);
    op.gates = gates_[block];
    push(stream, std::move(op));
  }

  int record(int stream) {
    int event = new_event();
    event_streams_[event] = stream;
    Op op(Op::Record);
    op.event = event;
    push(stream, std::move(op));
    return event;
  }

  void wait(int stream, int event) {
    Op op(Op::Wait);
    op.event = event;
    push(stream, std::move(op));
  }

  // The caching allocator. A block allocated on `stream`; `reuse` is a freed block of
  // `stream` to hand out again (-1 for fresh memory), once the streams it was recorded on have
  // passed the point of the free.
  int allocate(int stream, int reuse = -1) {
    if (reuse < 0) {
      block_stream_.push_back(stream);
      recorded_on_.emplace_back();
      return static_cast<int>(block_stream_.size()) - 1;
    }
    gates_[reuse] = std::move(pending_[reuse]);
    pending_[reuse].clear();
    return reuse;
  }

  void record_stream(int block, int stream) {
    if (stream != block_stream_[block]) recorded_on_[block].push_back(stream);
  }

  void free(int block) {
    for (int stream : recorded_on_[block]) pending_[block].push_back(record(stream));
    recorded_on_[block].clear();
  }

  void set_in_collective(bool in) { in_collective_ = in; }

  // Runs every queue in a random interleaving drawn from `seed`.
  Run run(uint64_t seed) const {
    std::mt19937_64 rng(seed);
    const size_t n = queues_.size();
    std::vector<size_t> next(n, 0);
    std::vector<Clock> clocks(n, Clock(n, 0));
    std::vector<Clock> events(event_clocks_.size());
    std::vector<bool> recorded(event_clocks_.size(), false);
    // Per stream, the own-clock values of its collective ops.
    std::vector<std::vector<uint32_t>> collective_times(n);
    struct Access {
      size_t stream;
      uint32_t time;
      bool write;
      std::string what;
    };
    std::map<int, std::vector<Access>> accesses;
    for (;;) {
      std::vector<size_t> ready;
      for (size_t s = 0; s < n; ++s) {
        if (next[s] == queues_[s].size()) continue;
        const Op& op = queues_[s][next[s]];
        if (op.kind == Op::Wait && !recorded[op.event]) continue;
        bool gated = false;
        for (int gate : op.gates) gated = gated || !recorded[gate];
        if (gated) continue;
        ready.push_back(s);
      }
      if (ready.empty()) {
        for (size_t s = 0; s < n; ++s) {
          if (next[s] != queues_[s].size()) return {"deadlock: stream " + std::to_string(s)};
        }
        return {};
      }
      size_t s = ready[rng() % ready.size()];
      const Op& op = queues_[s][next[s]++];
      Clock& clock = clocks[s];
      ++clock[s];
      if (op.collective) collective_times[s].push_back(clock[s]);
      switch (op.kind) {
        case Op::Record:
          events[op.event] = clock;
          recorded[op.event] = true;
          break;
        case Op::Wait:
          for (size_t t = 0; t < n; ++t) clock[t] = std::max(clock[t], events[op.event][t]);
          break;
        case Op::Access: {
          // The memory's own order: the stream's, and the allocator's gates.
          Clock seen = clock;
          for (int gate : op.gates) {
            for (size_t t = 0; t < n; ++t) seen[t] = std::max(seen[t], events[gate][t]);
          }
          for (const Access& before : accesses[op.block]) {
            bool ordered = before.stream == s || seen[before.stream] >= before.time;
            if (!ordered && (before.write || op.write)) {
              return {"unordered accesses to block " + std::to_string(op.block) + ": " +
                      before.what + " (stream " + std::to_string(before.stream) + ") and " +
                      op.what + " (stream " + std::to_string(s) + ")"};
            }
          }
          accesses[op.block].push_back({s, clock[s], op.write, op.what});
          if (op.overlaps >= 0 && recorded[op.overlaps]) {
            const size_t by = static_cast<size_t>(event_streams_[op.overlaps]);
            if (clock[by] >= events[op.overlaps][by]) {
              return {op.what + " waited for the work it should overlap"};
            }
          }
          break;
        }
      }
      if (op.independent) {
        for (size_t t = 0; t < n; ++t) {
          for (uint32_t time : collective_times[t]) {
            if (clock[t] >= time) {
              return {op.what + " waited for the collective (stream " + std::to_string(t) + ")"};
            }
          }
        }
      }
    }
  }

 private:
  std::vector<std::vector<Op>> queues_;
  std::vector<Clock> event_clocks_;
  std::vector<int> event_streams_;  // the stream each event is recorded on
  std::vector<int> block_stream_;
  std::vector<std::vector<int>> recorded_on_;
  std::map<int, std::vector<int>> pending_;  // freed blocks: events recorded at the free
  std::map<int, std::vector<int>> gates_;    // handed-out blocks: the events they came after
  bool in_collective_ = false;
};

// A step of the order the device leaves out, to show that the model catches its absence.
enum class Sabotage {
  None,
  NoReadyEvent,
  NoRecordStream,
  NoDoneWait,
  CollectiveOnCurrent,
  NoExchangeWait,
  BuffersOffSideStream,
  SetUpOnLegacyStream,
  ExchangeWaitedAtOnce,
  OneSideStream,
};

const char* name(Sabotage sabotage) {
  switch (sabotage) {
    case Sabotage::None:
      return "the order of stream_order.h";
    case Sabotage::NoReadyEvent:
      return "without the side stream waiting for the current stream";
    case Sabotage::NoRecordStream:
      return "without record_stream";
    case Sabotage::NoDoneWait:
      return "without wait() making the current stream wait";
    case Sabotage::CollectiveOnCurrent:
      return "with the collective on the current stream";
    case Sabotage::NoExchangeWait:
      return "without the side stream waiting for each exchange";
    case Sabotage::BuffersOffSideStream:
      return "with the collective's buffers allocated for the current stream";
    case Sabotage::SetUpOnLegacyStream:
      return "with a bucket's set-up on the legacy default stream";
    case Sabotage::ExchangeWaitedAtOnce:
      return "with each exchange waited for as soon as it is issued";
    case Sabotage::OneSideStream:
      return "with one side stream for both kinds of collective";
  }
  return "?";
}

// kSide2: a second side stream, for the all-gathers when the kinds are overlapped.
constexpr int kCompute = 0, kSide = 1, kComm = 2, kSide2 = 3;

// The Device policy of stream_order.h over the model; a stream is its index, the current
// stream is the model's. Exchanges run on kComm as ProcessGroupNCCL runs an async_op
// collective: its stream waits for the current one, and the Work's wait() makes the current
// stream wait for its end.
struct ModelDevice {
  using Stream = int;
  using Event = int;
  using Buffer = int;  // a memory block
  using Work = int;    // the event recorded after the exchange on kComm

  Model* model;
  int* current_stream;
  Sabotage sabotage;
  int* blocks_done;  // block() calls so far: the first is the ready event's
  int* last_exchange;  // the Work of the exchange issued last

  Stream current() const { return *current_stream; }
  Event record(const Stream& stream) const { return model->record(stream); }
  void block(const Event& event, const Stream& stream) const {
    bool ready_event = (*blocks_done)++ == 0;
    if (ready_event && sabotage == Sabotage::NoReadyEvent) return;
    if (!ready_event && sabotage == Sabotage::NoDoneWait) return;
    model->wait(stream, event);
  }
  bool query(const Event&) const { return false; }
  void protect(const Buffer& block, const Stream& stream) const {
    if (sabotage != Sabotage::NoRecordStream) model->record_stream(block, stream);
  }
  Work issue_exchange(const Buffer& send, const Buffer& recv) const {
    model->wait(kComm, model->record(current()));
    model->access(kComm, send, false, "the exchange sends the codes");
    model->access(kComm, recv, true, "the exchange receives codes");
    *last_exchange = model->record(kComm);
    if (sabotage == Sabotage::ExchangeWaitedAtOnce) model->wait(current(), *last_exchange);
    return *last_exchange;
  }
  void wait_exchange(const Work& end) const {
    if (sabotage != Sabotage::NoExchangeWait) model->wait(current(), end);
  }
  template <class F>
  void with_current(const Stream& stream, F&& f) const {
    int previous = *current_stream;
    if (sabotage != Sabotage::CollectiveOnCurrent) *current_stream = stream;
    model->set_in_collective(true);
    f();
    model->set_in_collective(false);
    *current_stream = previous;
  }
};

// The stream a collective's buffers are allocated for: the side stream, as the extension
// allocates them.
int buffer_stream(Sabotage sabotage) {
  return sabotage == Sabotage::BuffersOffSideStream ? kCompute : kSide;
}

// An exchange that is waited for at once (a collective of one chunk).
void exchange(const ModelDevice& device, int send, int received) {
  sdp4bit::start_exchange(device, send, received).wait();
}

// The gradient reduce-scatter of one bucket in a training step, enqueued on the model.
Model gradient_scenario(Sabotage sabotage) {
  Model model(3);
  int current = kCompute, blocks_done = 0, last_exchange = -1;
  ModelDevice device{&model, &current, sabotage, &blocks_done, &last_exchange};
  int bucket = model.allocate(kCompute);
  int shard = model.allocate(kCompute);
  int scratch = model.allocate(buffer_stream(sabotage));  // the collective's own buffers
  int received = model.allocate(buffer_stream(sabotage));
  int other = model.allocate(kCompute);
  model.access(kCompute, bucket, true, "backward writes the bucket");
  model.access(kCompute, shard, true, "the previous step's optimizer writes the shard");
  auto done = sdp4bit::enqueue_on_side_stream(device, kSide, {bucket, shard}, [&] {
    int on = device.current();
    model.access(on, bucket, false, "the quantize kernel reads the bucket");
    model.access(on, scratch, true, "the quantize kernel writes the codes");
    exchange(device, scratch, received);
    model.access(on, received, false, "the reduce kernel reads the received codes");
    model.access(on, shard, true, "the reduce kernel writes the shard");
  });
  model.access(kCompute, other, true, "backward goes on before wait()", true);
  model.free(bucket);
  int reused = model.allocate(kCompute, bucket);
  model.access(kCompute, reused, true, "a new tensor in the bucket's memory before wait()");
  done.wait_on_current_stream();
  model.access(kCompute, shard, false, "the optimizer reads the shard after wait()");
  return model;
}

// The parameter all-gather of one bucket in a training step, enqueued on the model.
Model weight_scenario(Sabotage sabotage) {
  Model model(3);
  int current = kCompute, blocks_done = 0, last_exchange = -1;
  ModelDevice device{&model, &current, sabotage, &blocks_done, &last_exchange};
  int params = model.allocate(kCompute);
  int scratch = model.allocate(buffer_stream(sabotage));
  int received = model.allocate(buffer_stream(sabotage));
  int other = model.allocate(kCompute);
  model.access(kCompute, params, true, "the optimizer writes this rank's shard");
  auto done = sdp4bit::enqueue_on_side_stream(device, kSide, {params}, [&] {
    int on = device.current();
    model.access(on, params, false, "the encode kernel reads the new shard");
    model.access(on, scratch, true, "the encode kernel writes the codes");
    exchange(device, scratch, received);
    model.access(on, received, false, "the apply kernel reads the received codes");
    model.access(on, params, true, "the apply kernel writes the params");
  });
  model.access(kCompute, other, true, "the forward of other layers before wait()", true);
  done.wait_on_current_stream();
  model.access(kCompute, params, false, "the forward reads the params after wait()");
  return model;
}

// The pipelined gradient reduce-scatter of one bucket (P = 3 chunks, one exchange level, the
// chunk loop of src/collective/gradient.rs), after which the bucket is dropped and re-created
// while the collective may still run.
Model pipelined_scenario(Sabotage sabotage) {
  constexpr int kChunks = 3;
  Model model(3);
  int current = kCompute, blocks_done = 0, last_exchange = -1;
  ModelDevice device{&model, &current, sabotage, &blocks_done, &last_exchange};
  int bucket = model.allocate(kCompute);
  int shard = model.allocate(kCompute);
  const int owner = buffer_stream(sabotage);
  int send[2] = {model.allocate(owner), model.allocate(owner)};
  int received[2] = {model.allocate(owner), model.allocate(owner)};
  int other = model.allocate(kCompute);
  model.access(kCompute, bucket, true, "backward writes the bucket");
  model.access(kCompute, shard, true, "the previous step's optimizer writes the shard");
  auto done = sdp4bit::enqueue_on_side_stream(device, kSide, {bucket, shard}, [&] {
    int on = device.current();
    model.access(on, bucket, false, "the quantize kernel of chunk 0 reads the bucket");
    model.access(on, send[0], true, "the quantize kernel of chunk 0 writes its codes");
    for (int t = 0; t <= kChunks; ++t) {
      std::optional<sdp4bit::ExchangeInFlight<ModelDevice>> flight;
      if (t < kChunks) flight.emplace(sdp4bit::start_exchange(device, send[t % 2], received[t % 2]));
      if (t + 1 < kChunks) {
        // Computed while chunk t travels: not ordered after its exchange.
        model.access(on, bucket, false, "the quantize kernel of the next chunk reads the bucket",
                     false, last_exchange);
        model.access(on, send[(t + 1) % 2], true,
                     "the quantize kernel of the next chunk writes its codes");
      }
      if (t >= 1) {
        model.access(on, received[(t - 1) % 2], false,
                     "the reduce kernel of the previous chunk reads its codes");
        model.access(on, shard, true, "the reduce kernel of the previous chunk writes the shard");
      }
      if (flight) flight->wait();
    }
  });
  model.access(kCompute, other, true, "backward goes on before wait()", true);
  // The bucket is re-created: its buffers go back to the allocator and the new bucket's set-up
  // writes its tables into their memory, from the pool of the stream they were allocated for.
  for (int block : {send[0], send[1], received[0], received[1]}) model.free(block);
  int tables = model.allocate(owner, send[0]);
  if (owner == kCompute) {
    model.access(kCompute, tables, true, "a new tensor of the current stream in their memory");
  } else {
    // The legacy default stream is the compute stream's (torch's default stream).
    int set_up = sabotage == Sabotage::SetUpOnLegacyStream ? kCompute : kSide;
    model.access(set_up, tables, true, "the re-created bucket's set-up uploads its tables");
  }
  done.wait_on_current_stream();
  model.access(kCompute, shard, false, "the optimizer reads the shard after wait()");
  return model;
}

// FSDP2's backward: a unit's gradient reduce-scatter, then the next unit's parameter
// all-gather while the reduce-scatter still runs, each on the side stream SideStreams gives its
// kind. The all-gather's exchange follows the reduce-scatter's on the one communication
// stream, as two collectives over one NCCL group do; nothing of the all-gather, nor the compute
// stream's use of the gathered params, may wait for the reduce-scatter's end.
Model overlap_scenario(Sabotage sabotage) {
  using sdp4bit::CollectiveKind;
  Model model(4);
  int current = kCompute, rs_blocks = 0, ag_blocks = 0, last_exchange = -1;
  ModelDevice rs_device{&model, &current, sabotage, &rs_blocks, &last_exchange};
  ModelDevice ag_device{&model, &current, sabotage, &ag_blocks, &last_exchange};
  int made = 0;
  auto make = [&] { return made++ == 0 ? kSide : kSide2; };
  sdp4bit::SideStreams<int> sides;
  const int rs_side = sides.get(0, CollectiveKind::ReduceScatter, make);
  const int ag_side = sabotage == Sabotage::OneSideStream
                          ? rs_side
                          : sides.get(0, CollectiveKind::AllGather, make);
  int bucket = model.allocate(kCompute);
  int shard = model.allocate(kCompute);
  int params = model.allocate(kCompute);
  int rs_codes = model.allocate(rs_side), rs_received = model.allocate(rs_side);
  int ag_codes = model.allocate(ag_side), ag_received = model.allocate(ag_side);
  model.access(kCompute, bucket, true, "backward writes the unit's gradients");
  int rs_end = -1;
  auto reduced = sdp4bit::enqueue_on_side_stream(rs_device, rs_side, {bucket, shard}, [&] {
    int on = rs_device.current();
    model.access(on, bucket, false, "the quantize kernel reads the gradients");
    model.access(on, rs_codes, true, "the quantize kernel writes the codes");
    exchange(rs_device, rs_codes, rs_received);
    model.access(on, rs_received, false, "the reduce kernel reads the received codes");
    model.access(on, shard, true, "the reduce kernel writes the shard");
    rs_end = model.record(on);
  });
  model.access(kCompute, params, true, "the next unit's shard is copied in");
  auto gathered = sdp4bit::enqueue_on_side_stream(ag_device, ag_side, {params}, [&] {
    int on = ag_device.current();
    model.access(on, params, false, "the all-gather's encode kernel reads the shard", false,
                 rs_end);
    model.access(on, ag_codes, true, "the all-gather's encode kernel writes the codes");
    exchange(ag_device, ag_codes, ag_received);
    model.access(on, ag_received, false, "the all-gather's apply kernel reads the codes", false,
                 rs_end);
    model.access(on, params, true, "the all-gather's apply kernel writes the params");
  });
  gathered.wait_on_current_stream();
  model.access(kCompute, params, false, "the next unit's backward reads the params", false,
               rs_end);
  reduced.wait_on_current_stream();
  model.access(kCompute, shard, false, "the optimizer reads the shard after wait()");
  return model;
}

// What is wrong with SideStreams' choice of streams, or "": each device and kind gets a stream
// of its own, made on first use and kept.
std::string side_streams_problem() {
  using sdp4bit::CollectiveKind;
  sdp4bit::SideStreams<int> sides;
  int made = 0;
  auto fresh = [&] { return ++made; };
  const int gather = sides.get(0, CollectiveKind::AllGather, fresh);
  if (sides.get(0, CollectiveKind::AllGather, fresh) != gather || made != 1) {
    return "a kind's second use made another stream";
  }
  const int reduce = sides.get(0, CollectiveKind::ReduceScatter, fresh);
  if (reduce == gather) return "both kinds got one stream";
  if (sides.get(1, CollectiveKind::ReduceScatter, fresh) == reduce) {
    return "two devices got one stream";
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::atoi(argv[1]) : 2000;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0x5eed;
  bool ok = true;
  for (Sabotage sabotage :
       {Sabotage::None, Sabotage::NoReadyEvent, Sabotage::NoRecordStream, Sabotage::NoDoneWait,
        Sabotage::CollectiveOnCurrent, Sabotage::NoExchangeWait, Sabotage::BuffersOffSideStream,
        Sabotage::SetUpOnLegacyStream, Sabotage::ExchangeWaitedAtOnce, Sabotage::OneSideStream}) {
    std::string first_problem;
    int failing = 0;
    for (Model (*scenario)(Sabotage) :
         {gradient_scenario, weight_scenario, pipelined_scenario, overlap_scenario}) {
      Model model = scenario(sabotage);
      for (int i = 0; i < runs; ++i) {
        Run run = model.run(seed + static_cast<uint64_t>(i));
        if (run.problem.empty()) continue;
        if (failing++ == 0) first_problem = run.problem;
      }
    }
    bool expected = sabotage == Sabotage::None ? failing == 0 : failing > 0;
    ok = ok && expected;
    std::printf("%s %s: %d of %d interleavings of the four scenarios wrong%s%s\n",
                expected ? "ok" : "FAILED", name(sabotage), failing, 4 * runs,
                failing ? "; first: " : "", first_problem.c_str());
  }
  const std::string problem = side_streams_problem();
  ok = ok && problem.empty();
  std::printf("%s SideStreams: one stream per device and kind, kept%s%s\n",
              problem.empty() ? "ok" : "FAILED", problem.empty() ? "" : ": ",
              problem.c_str());
  return ok ? 0 : 1;
}
