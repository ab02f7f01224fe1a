// A FIFO worker thread: the collectives of one set of process groups run on it, one after
// another in submission order, so every rank issues them to c10d in the same order while
// the training thread goes on.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
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

  // Queues `job`; the future holds its exception, if it throws. Throws std::logic_error
  // once shutdown() has begun.
  std::shared_future<void> submit(std::function<void()> job) {
    std::packaged_task<void()> task(std::move(job));
    std::shared_future<void> done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw std::logic_error("these process groups were closed (ProcessGroups.close())");
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return done;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and every queued job has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::mutex join_mutex_;  // serializes joins of concurrent shutdown() calls
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after the members it uses exist
};

}  // namespace sdp4bit
