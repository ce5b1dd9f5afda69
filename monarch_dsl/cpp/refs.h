// The C++ executor's ref table (executor.cpp): ref -> a value or a failure.
//
// A ref holds a value (a tensor, a number, None) or a failure (the root cause: rank,
// controller line, op, error). The table's lock guards the map only: it is never held while
// the GIL is taken or while a value is destroyed (a tensor's destructor may take the GIL), so
// Python threads that wait for it cannot deadlock with stream threads.
//
// Nothing here holds a py::object (pybind11's namespace is hidden: a type in a named
// namespace with such a field would be more visible than it, -Wattributes).

#pragma once

#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace md::exec {

namespace py = pybind11;

struct Failure {
  int64_t rank;
  std::string line, op, error, traceback;
};
using FailurePtr = std::shared_ptr<const Failure>;

struct Entry {
  c10::IValue value;
  FailurePtr failure;  // set: the ref failed, `value` is empty
};

class RefTable {
 public:
  // The three operations. A replaced or removed value is destroyed after the lock is released.
  std::optional<Entry> lookup(int64_t ref);
  void store(int64_t ref, Entry e);
  std::optional<Entry> take(int64_t ref);

  bool contains(int64_t ref);
  size_t size();
  std::vector<int64_t> keys();
  // Empty the table (its values destroyed after the lock is released).
  void clear();

  // `f(find)` with the table locked, `find(ref)` the entry of `ref` or nullptr: several
  // entries read at one point in time (an op's inputs). `f` must not take the GIL nor
  // destroy a value.
  template <class F>
  decltype(auto) locked(F&& f) {
    std::lock_guard<std::mutex> g(lock_);
    return f([this](int64_t ref) -> const Entry* {
      auto it = refs_.find(ref);
      return it == refs_.end() ? nullptr : &it->second;
    });
  }

 private:
  std::mutex lock_;
  std::unordered_map<int64_t, Entry> refs_;
};

// An entry as Python sees it (called with the GIL): the value, or a `failure_type` (rank,
// line, op, error, traceback) -- runtime/failure.py's Failure.
py::object to_python(const Entry& e, py::handle failure_type);

// A value from Python: a tensor, a number, None or a `failure_type`; else py::type_error.
Entry from_python(py::handle value, py::handle failure_type);

}  // namespace md::exec
