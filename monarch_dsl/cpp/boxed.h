// Boxed calls of dispatcher operators, shared by compiled plans (program.cpp) and eager
// batches (executor.cpp).
//
// A call is prepared once from Python values (op name, args, kwargs): every constant is
// converted to an IValue by the operator's schema, and each argument that stands for a value
// held elsewhere (a plan's slot, the executor's ref) becomes a Patch filled in just before the
// call. Calling is then: copy the argument template, fill the patches, callBoxed.

#pragma once

#include <torch/csrc/Dtype.h>
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace md {

namespace py = pybind11;

// Where a call's argument takes a held value.
struct Patch {
  size_t arg;                 // index in the boxed stack
  std::vector<int64_t> keys;  // one key, or the keys of a Tensor[] / Tensor?[] argument
  bool list = false;          // build a list from `keys`
  bool optional_list = false; // Tensor?[]
};

struct BoxedCall {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;  // the arguments, patched ones still empty
  std::vector<Patch> patches;
  std::string name;  // "aten::mm.default", for errors
};

// The operator "ns::name" with `overload` ("default" or "" for none), resolved once per name.
inline c10::OperatorHandle find_op(const std::string& qualified, const std::string& overload) {
  static std::mutex lock;
  static std::unordered_map<std::string, c10::OperatorHandle> found;
  std::string key = qualified + "." + overload;
  std::lock_guard<std::mutex> guard(lock);
  auto it = found.find(key);
  if (it != found.end()) return it->second;
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
      qualified.c_str(), overload == "default" ? "" : overload.c_str());
  found.emplace(key, handle);
  return handle;
}

// `key_of(obj)`: the key of a held value `obj` stands for, or -1 for a constant.
// `special(obj)`: an IValue for a sentinel the caller knows (the worker's device), or nullopt.
inline BoxedCall make_call(
    const c10::OperatorHandle& handle,
    std::string name,
    const py::tuple& args,
    const py::dict& kwargs,
    const std::function<int64_t(py::handle)>& key_of,
    const std::function<std::optional<c10::IValue>(py::handle)>& special = {}) {
  BoxedCall call{handle, {}, {}, std::move(name)};
  const auto& formals = handle.schema().arguments();
  if (args.size() > formals.size())
    throw std::runtime_error(call.name + ": too many arguments");
  for (size_t i = 0; i < formals.size(); ++i) {
    const auto& formal = formals[i];
    py::object value;
    if (i < args.size() && !formal.kwarg_only()) {
      value = args[i];
    } else if (kwargs.contains(formal.name())) {
      value = kwargs[py::str(formal.name())];
    } else if (formal.default_value()) {
      call.stack.push_back(*formal.default_value());
      continue;
    } else {
      throw std::runtime_error(call.name + ": no value for argument " + formal.name());
    }
    int64_t key = key_of(value);
    if (key >= 0) {
      call.patches.push_back({i, {key}});
      call.stack.emplace_back();
      continue;
    }
    if (special) {
      if (auto v = special(value)) {
        call.stack.push_back(std::move(*v));
        continue;
      }
    }
    if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
      auto seq = py::reinterpret_borrow<py::sequence>(value);
      bool any_held = false;
      for (auto x : seq) any_held = any_held || key_of(x) >= 0;
      if (any_held) {
        Patch p{i, {}, true, false};
        for (auto x : seq) {
          int64_t k = key_of(x);
          if (k < 0) throw std::runtime_error(call.name + ": a list mixing values and tensors");
          p.keys.push_back(k);
        }
        auto elem = formal.type()->castRaw<c10::ListType>();
        p.optional_list = elem && elem->getElementType()->kind() == c10::TypeKind::OptionalType;
        call.patches.push_back(p);
        call.stack.emplace_back();
        continue;
      }
    }
    if (formal.type()->kind() == c10::TypeKind::TensorType &&
        (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value))) {
      // A Python number where the schema has a Tensor (x * 2 as mul.Tensor): a wrapped
      // number, as torch's Python binding makes it (it does not promote the dtype).
      at::Tensor t = py::isinstance<py::bool_>(value)
                         ? at::scalar_to_tensor(c10::Scalar(value.cast<bool>()))
                     : py::isinstance<py::int_>(value)
                         ? at::scalar_to_tensor(c10::Scalar(value.cast<int64_t>()))
                         : at::scalar_to_tensor(c10::Scalar(value.cast<double>()));
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      call.stack.emplace_back(std::move(t));
      continue;
    }
    call.stack.push_back(torch::jit::toIValue(value, formal.type()));
  }
  for (auto item : kwargs) {  // a keyword the schema does not have: as torch.ops says
    auto k = item.first.cast<std::string>();
    bool known = false;
    for (const auto& formal : formals) known = known || formal.name() == k;
    if (!known) throw std::runtime_error(call.name + ": unexpected keyword argument " + k);
  }
  return call;
}

// The call's stack, with `value(key)` (an IValue) in every patch.
template <class Value>
void fill_stack(const BoxedCall& call, torch::jit::Stack& stack, Value&& value) {
  stack.assign(call.stack.begin(), call.stack.end());
  for (const auto& p : call.patches) {
    if (!p.list) {
      stack[p.arg] = value(p.keys[0]);
    } else if (p.optional_list) {
      c10::List<std::optional<at::Tensor>> list;
      for (auto k : p.keys) list.push_back(value(k).template toOptional<at::Tensor>());
      stack[p.arg] = list;
    } else {
      c10::List<at::Tensor> list;
      for (auto k : p.keys) list.push_back(value(k).toTensor());
      stack[p.arg] = list;
    }
  }
}

// A dtype by its name in the instruction set ("float32") as a ScalarType.
inline at::ScalarType dtype_named(py::handle name) {
  py::object dtype = py::module_::import("torch").attr(name);
  if (!THPDtype_Check(dtype.ptr()))
    throw py::type_error("not a torch dtype: " + py::repr(name).cast<std::string>());
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

// Python error types of c10's exceptions, as torch's binding raises them.
inline std::string error_type(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return "OutOfMemoryError";
  if (dynamic_cast<const c10::IndexError*>(&e)) return "IndexError";
  if (dynamic_cast<const c10::ValueError*>(&e)) return "ValueError";
  if (dynamic_cast<const c10::TypeError*>(&e)) return "TypeError";
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return "NotImplementedError";
  if (dynamic_cast<const c10::LinAlgError*>(&e)) return "LinAlgError";
  return "RuntimeError";
}

// The message without the C++ backtrace (what() would symbolize one: slow, and not the user's).
inline std::string error_text(const std::exception& e) {
  if (auto c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace md
