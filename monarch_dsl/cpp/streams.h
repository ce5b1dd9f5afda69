// The C++ executor's streams (executor.cpp): one thread per named stream, running the items it
// is given in order. The executor says what running an item is.
//
// Nothing here holds a py::object (see refs.h).

#pragma once

#include <c10/core/Device.h>
#include <sys/resource.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace md::exec {

// What a stream thread does before its first item (its thread counts; on CUDA, a CUDA stream
// of its own).
void start_stream_thread(const c10::Device& device);

// An exception that running an item let out (a bug of ours): said on stderr, under the GIL.
void report_internal_error(const std::exception& e);

// Called under a pybind11::gil_scoped_acquire on a stream thread: keeps that acquire's Python
// thread state for the thread's next ones, until end_stream_thread. pybind11 makes a thread
// state for an acquire on a thread that has none and deletes it when the acquire ends: every
// Python step (each compiled call's) paid for a new one (its allocation, its frame stack's
// first chunk) and lost its Python thread-locals.
void keep_python_thread_state();

// What a stream thread does after its last item: lets go of the Python thread state kept by
// keep_python_thread_state (takes the GIL: called without it), unless the interpreter is
// finalizing.
void end_stream_thread();

// Grows a worker's memory budget (RLIMIT_DATA, runtime/memory.py; which counts the growth
// as the runtime's own) by `room` bytes; returns the soft limit before, or nothing where there
// is no budget or no room under its hard limit. `set_data_limit` puts a soft limit back.
std::optional<rlim_t> grow_data_limit(size_t room);
void set_data_limit(rlim_t soft);

// A new thread running `body`. Its stack is the runtime's, not the user's: where a worker's
// memory budget (RLIMIT_DATA, runtime/memory.py) has no room left for it, the limit grows by
// the stack's size. Throws std::system_error if it still cannot start.
std::thread start_thread(std::function<void()> body);

template <class Item>
class Streams {
 public:
  struct Stream {
    std::mutex lock;
    std::condition_variable cv;
    std::deque<Item> queue;
    bool stop = false;
    std::thread thread;
  };

  // `run(item)` runs an item on its stream's thread; `device`: the worker's.
  Streams(c10::Device device, std::function<void(Item&)> run)
      : device_(device), run_(std::move(run)) {}

  ~Streams() { close(); }

  // The stream `name`, its thread started on first use.
  Stream* named(const std::string& name) {
    std::lock_guard<std::mutex> g(lock_);
    if (closed_) throw std::runtime_error("the executor is closed");
    auto it = streams_.find(name);
    if (it == streams_.end()) {  // (a thread that cannot start leaves no stream behind)
      auto stream = std::make_unique<Stream>();
      Stream* raw = stream.get();
      raw->thread = start_thread([this, raw] { loop(*raw); });
      it = streams_.emplace(name, std::move(stream)).first;
    }
    return it->second.get();
  }

  void push(const std::string& name, Item item) { enqueue(*named(name), std::move(item)); }

  static void enqueue(Stream& s, Item item) {
    {
      std::lock_guard<std::mutex> g(s.lock);
      s.queue.push_back(std::move(item));
    }
    s.cv.notify_one();
  }

  // All of `items` (left empty) with one lock and one wake-up.
  static void enqueue(Stream& s, std::vector<Item>& items) {
    if (items.empty()) return;
    {
      std::lock_guard<std::mutex> g(s.lock);
      for (auto& item : items) s.queue.push_back(std::move(item));
    }
    s.cv.notify_one();
    items.clear();
  }

  std::vector<Stream*> all() {
    std::lock_guard<std::mutex> g(lock_);
    std::vector<Stream*> out;
    for (auto& kv : streams_) out.push_back(kv.second.get());
    return out;
  }

  std::vector<std::string> names() {
    std::lock_guard<std::mutex> g(lock_);
    std::vector<std::string> out;
    for (const auto& kv : streams_) out.push_back(kv.first);
    return out;
  }

  // Stop the threads after what they were given, and join them; no stream after this. Called
  // without the GIL (a thread may need it to finish).
  void close() {
    std::vector<std::unique_ptr<Stream>> stopping;
    {
      std::lock_guard<std::mutex> g(lock_);
      for (auto& kv : streams_) stopping.push_back(std::move(kv.second));
      streams_.clear();
      closed_ = true;
    }
    for (auto& s : stopping) {
      {
        std::lock_guard<std::mutex> g(s->lock);
        s->stop = true;
      }
      s->cv.notify_all();
      if (s->thread.joinable()) s->thread.join();
    }
  }

 private:
  void loop(Stream& s) {
    start_stream_thread(device_);
    while (true) {
      Item item;
      {
        std::unique_lock<std::mutex> g(s.lock);
        s.cv.wait(g, [&] { return s.stop || !s.queue.empty(); });
        if (s.queue.empty()) break;  // stopped, and nothing left
        item = std::move(s.queue.front());
        s.queue.pop_front();
      }
      try {
        run_(item);
      } catch (const std::exception& e) {  // a bug of ours: keep the stream alive, say so
        report_internal_error(e);
      }
    }
    end_stream_thread();
  }

  c10::Device device_;
  std::function<void(Item&)> run_;
  std::mutex lock_;
  std::unordered_map<std::string, std::unique_ptr<Stream>> streams_;
  bool closed_ = false;
};

}  // namespace md::exec
