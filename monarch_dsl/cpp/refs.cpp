// The C++ executor's ref table (see refs.h).

#include "refs.h"

#include <torch/csrc/jit/python/pybind_utils.h>

namespace md::exec {

std::optional<Entry> RefTable::lookup(int64_t ref) {
  std::lock_guard<std::mutex> g(lock_);
  auto it = refs_.find(ref);
  if (it == refs_.end()) return std::nullopt;
  return it->second;
}

void RefTable::store(int64_t ref, Entry e) {
  Entry old;
  {
    std::lock_guard<std::mutex> g(lock_);
    auto& slot = refs_[ref];
    old = std::move(slot);
    slot = std::move(e);
  }
}

std::optional<Entry> RefTable::take(int64_t ref) {
  std::lock_guard<std::mutex> g(lock_);
  auto it = refs_.find(ref);
  if (it == refs_.end()) return std::nullopt;
  Entry e = std::move(it->second);
  refs_.erase(it);
  return e;
}

bool RefTable::contains(int64_t ref) {
  std::lock_guard<std::mutex> g(lock_);
  return refs_.count(ref) > 0;
}

size_t RefTable::size() {
  std::lock_guard<std::mutex> g(lock_);
  return refs_.size();
}

std::vector<int64_t> RefTable::keys() {
  std::lock_guard<std::mutex> g(lock_);
  std::vector<int64_t> out;
  for (const auto& kv : refs_) out.push_back(kv.first);
  return out;
}

void RefTable::clear() {
  std::unordered_map<int64_t, Entry> dead;
  {
    std::lock_guard<std::mutex> g(lock_);
    dead.swap(refs_);
  }
}

py::object to_python(const Entry& e, py::handle failure_type) {
  if (e.failure) {
    const auto& f = *e.failure;
    return failure_type(f.rank, f.line, f.op, f.error, f.traceback);
  }
  return torch::jit::toPyObject(e.value);
}

Entry from_python(py::handle value, py::handle failure_type) {
  Entry e;
  if (py::isinstance(value, failure_type)) {
    e.failure = std::make_shared<Failure>(Failure{
        value.attr("rank").cast<int64_t>(), value.attr("line").cast<std::string>(),
        value.attr("op").cast<std::string>(), value.attr("error").cast<std::string>(),
        value.attr("traceback").cast<std::string>()});
  } else if (THPVariable_Check(value.ptr())) {
    e.value = THPVariable_Unpack(value.ptr());
  } else if (py::isinstance<py::bool_>(value)) {
    e.value = value.cast<bool>();
  } else if (py::isinstance<py::int_>(value)) {
    e.value = value.cast<int64_t>();
  } else if (py::isinstance<py::float_>(value)) {
    e.value = value.cast<double>();
  } else if (!value.is_none()) {
    throw py::type_error("a ref holds a tensor, a number, None or a Failure");
  }
  return e;
}

}  // namespace md::exec
