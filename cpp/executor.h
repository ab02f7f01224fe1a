// A FIFO worker thread: the collectives of one set of process groups run on it, one after
// another in submission order, so every rank issues them to c10d in the same order while
// the training thread goes on.
#pragma once

#include "completion_signal.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace sdp4bit {

class Executor {
 public:
  Executor() : worker_([this] { loop(); }) {}

  ~Executor() { shutdown(); }

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs every queued job, then stops the worker thread and joins it. Idempotent; call it
  // from any thread but the worker.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    std::lock_guard<std::mutex> joining(join_mutex_);
    if (worker_.joinable()) worker_.join();
  }

  // Queues `job`; the future holds its exception, if it throws. `signal`, when given, is
  // notified after the job has run and its future is ready (so a waiter woken by it finds the
  // future ready), and is kept alive until then. Throws std::logic_error once shutdown() has
  // begun.
  std::shared_future<void> submit(std::function<void()> job,
                                  std::shared_ptr<CompletionSignal> signal = nullptr) {
    Queued queued{std::packaged_task<void()>(std::move(job)), std::move(signal)};
    std::shared_future<void> done = queued.task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw std::logic_error("these process groups were closed (ProcessGroups.close())");
      queue_.push_back(std::move(queued));
    }
    ready_.notify_one();
    return done;
  }

 private:
  // A job and the signal to notify once its future is ready.
  struct Queued {
    std::packaged_task<void()> task;
    std::shared_ptr<CompletionSignal> signal;
  };

  void loop() {
    for (;;) {
      Queued queued;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and every queued job has run
        queued = std::move(queue_.front());
        queue_.pop_front();
      }
      queued.task();  // makes the future ready, holding the job's exception if it threw
      if (queued.signal) queued.signal->notify();
    }
  }

  std::mutex mutex_;
  std::mutex join_mutex_;  // serializes joins of concurrent shutdown() calls
  std::condition_variable ready_;
  std::deque<Queued> queue_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after the members it uses exist
};

}  // namespace sdp4bit
