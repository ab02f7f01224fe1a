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
// runs other layers, calls wait() and reads the params. Checked for many interleavings: no
// unordered access, and the compute stream's work between start() and wait() never waits for
// the collective. Each step of the order is then removed in turn (a sabotaged device), and
// the model must catch each in some scenario.
//
// Prints one line per case and exits non-zero if any check fails.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
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
    return static_cast<int>(event_clocks_.size()) - 1;
  }

  void push(int stream, Op op) {
    op.collective = in_collective_;
    queues_[stream].push_back(std::move(op));
  }

  void access(int stream, int block, bool write, std::string what, bool independent = false) {
    Op op(Op::Access);
    op.block = block;
    op.write = write;
    op.independent = independent;
    op.what = std::move(what);
    op.gates = gates_[block];
    push(stream, std::move(op));
  }

  int record(int stream) {
    int event = new_event();
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
  std::vector<int> block_stream_;
  std::vector<std::vector<int>> recorded_on_;
  std::map<int, std::vector<int>> pending_;  // freed blocks: events recorded at the free
  std::map<int, std::vector<int>> gates_;    // handed-out blocks: the events they came after
  bool in_collective_ = false;
};

// A step of the order the device leaves out, to show that the model catches its absence.
enum class Sabotage { None, NoReadyEvent, NoRecordStream, NoDoneWait, CollectiveOnCurrent };

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
  }
  return "?";
}

// The Device policy of stream_order.h over the model; a stream is its index, the current
// stream is the model's.
struct ModelDevice {
  using Stream = int;
  using Event = int;
  using Buffer = int;  // a memory block

  Model* model;
  int* current_stream;
  Sabotage sabotage;
  int* blocks_done;  // block() calls so far: the first is the ready event's

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

constexpr int kCompute = 0, kSide = 1, kComm = 2;

// A c10d exchange as ProcessGroupNCCL issues it with `on` current: its stream waits for `on`,
// and the work's wait() makes `on` wait for its end.
void exchange(Model& model, int on, int send, int received) {
  model.wait(kComm, model.record(on));
  model.access(kComm, send, false, "the exchange sends the codes");
  model.access(kComm, received, true, "the exchange receives codes");
  model.wait(on, model.record(kComm));
}

// The gradient reduce-scatter of one bucket in a training step, enqueued on the model.
Model gradient_scenario(Sabotage sabotage) {
  Model model(3);
  int current = kCompute, blocks_done = 0;
  ModelDevice device{&model, &current, sabotage, &blocks_done};
  int bucket = model.allocate(kCompute);
  int shard = model.allocate(kCompute);
  int scratch = model.allocate(kSide);  // the collective's own buffers, allocated on the side
  int received = model.allocate(kSide);
  int other = model.allocate(kCompute);
  model.access(kCompute, bucket, true, "backward writes the bucket");
  model.access(kCompute, shard, true, "the previous step's optimizer writes the shard");
  auto done = sdp4bit::enqueue_on_side_stream(device, kSide, {bucket, shard}, [&] {
    int on = device.current();
    model.access(on, bucket, false, "the quantize kernel reads the bucket");
    model.access(on, scratch, true, "the quantize kernel writes the codes");
    exchange(model, on, scratch, received);
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
  int current = kCompute, blocks_done = 0;
  ModelDevice device{&model, &current, sabotage, &blocks_done};
  int params = model.allocate(kCompute);
  int scratch = model.allocate(kSide);
  int received = model.allocate(kSide);
  int other = model.allocate(kCompute);
  model.access(kCompute, params, true, "the optimizer writes this rank's shard");
  auto done = sdp4bit::enqueue_on_side_stream(device, kSide, {params}, [&] {
    int on = device.current();
    model.access(on, params, false, "the encode kernel reads the new shard");
    model.access(on, scratch, true, "the encode kernel writes the codes");
    exchange(model, on, scratch, received);
    model.access(on, received, false, "the apply kernel reads the received codes");
    model.access(on, params, true, "the apply kernel writes the params");
  });
  model.access(kCompute, other, true, "the forward of other layers before wait()", true);
  done.wait_on_current_stream();
  model.access(kCompute, params, false, "the forward reads the params after wait()");
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::atoi(argv[1]) : 2000;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0x5eed;
  bool ok = true;
  for (Sabotage sabotage : {Sabotage::None, Sabotage::NoReadyEvent, Sabotage::NoRecordStream,
                            Sabotage::NoDoneWait, Sabotage::CollectiveOnCurrent}) {
    std::string first_problem;
    int failing = 0;
    for (Model (*scenario)(Sabotage) : {gradient_scenario, weight_scenario}) {
      Model model = scenario(sabotage);
      for (int i = 0; i < runs; ++i) {
        Run run = model.run(seed + static_cast<uint64_t>(i));
        if (run.problem.empty()) continue;
        if (failing++ == 0) first_problem = run.problem;
      }
    }
    bool expected = sabotage == Sabotage::None ? failing == 0 : failing > 0;
    ok = ok && expected;
    std::printf("%s %s: %d of %d interleavings of the two scenarios wrong%s%s\n",
                expected ? "ok" : "FAILED", name(sabotage), failing, 2 * runs,
                failing ? "; first: " : "", first_problem.c_str());
  }
  return ok ? 0 : 1;
}
