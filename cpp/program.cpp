// The compute part of a compiled plan, run through the c10 dispatcher.
//
// A Program is built once per plan on each worker from the lowered steps (op name, arguments
// with slot markers, outputs, slots to free). Building resolves every operator to its
// dispatcher handle and converts every constant argument to an IValue by the operator's schema,
// so running a step is: copy the argument template, put the slot values in, callBoxed, store the
// results. No Python on that path (an op whose kernel is Python, such as prims, takes the GIL
// itself).

#include "boxed.h"

#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct Step {
  md::BoxedCall call;
  std::vector<int64_t> outs;
  std::vector<int64_t> frees;
  bool spread = false;  // the op returns one list whose elements are the outs
  // Memory planning: the op's out= overload, and the result of the last run, written again by
  // it when nothing else holds that tensor or its storage any more.
  std::optional<c10::OperatorHandle> out_op;
  at::Tensor buffer;
};

// Results up to this size are written into the previous run's buffer: for small tensors,
// making a new one (allocation, TensorImpl) costs as much as the op itself; big ones are left
// to the allocator, so planning never holds much memory between runs.
constexpr int64_t kPlannedBytes = 64 << 10;

// The out= overload of `handle`, when it takes exactly the op's arguments plus one `out`
// tensor and the op returns one fresh (non-aliasing) tensor.
std::optional<c10::OperatorHandle> out_variant(const c10::OperatorHandle& handle) {
  const auto& schema = handle.schema();
  const auto& returns = schema.returns();
  if (returns.size() != 1 || returns[0].type()->kind() != c10::TypeKind::TensorType ||
      returns[0].alias_info() != nullptr || schema.is_mutable())
    return std::nullopt;
  const std::string name = schema.name();
  if (name.find("view") != std::string::npos || name.find("alias") != std::string::npos)
    return std::nullopt;  // (_unsafe_view returns a view its schema does not declare)
  auto out = c10::Dispatcher::singleton().findOp({name, "out"});
  if (!out) return std::nullopt;
  const auto& formals = schema.arguments();
  const auto& out_formals = out->schema().arguments();
  if (out_formals.size() != formals.size() + 1 || !out_formals.back().is_out()) return std::nullopt;
  for (size_t i = 0; i < formals.size(); ++i) {
    if (formals[i].name() != out_formals[i].name() ||
        formals[i].kwarg_only() != out_formals[i].kwarg_only())
      return std::nullopt;
  }
  return out;
}

}  // namespace

class Env {
 public:
  explicit Env(int64_t n) : values(n) {}
  void set(int64_t i, py::handle obj) {
    if (THPVariable_Check(obj.ptr())) {
      values.at(i) = THPVariable_Unpack(obj.ptr());
    } else if (obj.is_none()) {
      values.at(i) = c10::IValue();
    } else if (py::isinstance<py::bool_>(obj)) {
      values.at(i) = obj.cast<bool>();
    } else if (py::isinstance<py::int_>(obj)) {
      values.at(i) = obj.cast<int64_t>();
    } else if (py::isinstance<py::float_>(obj)) {
      values.at(i) = obj.cast<double>();
    } else {
      throw std::runtime_error("Env.set: not a tensor or a number");
    }
  }
  void set_none(int64_t i) { values.at(i) = c10::IValue(); }
  py::object get(int64_t i) { return torch::jit::toPyObject(values.at(i)); }
  bool has(int64_t i) const { return !values.at(i).isNone(); }
  int64_t size() const { return static_cast<int64_t>(values.size()); }
  std::vector<c10::IValue> values;
};

class Program {
 public:
  // steps: list of (qualified op name "aten::mm", overload, args tuple, kwargs dict,
  //                 outs list, frees list), compute steps only (None for others).
  Program(const py::list& steps, py::handle slot_type) {
    auto slot_of = [&](py::handle obj) -> int64_t {
      return py::isinstance(obj, slot_type) ? obj.attr("index").cast<int64_t>() : -1;
    };
    for (const auto& item : steps) {
      if (item.is_none()) {
        steps_.emplace_back(std::nullopt);
        continue;
      }
      auto t = item.cast<py::tuple>();
      auto qualified = t[0].cast<std::string>();
      auto overload = t[1].cast<std::string>();
      auto handle = md::find_op(qualified, overload);
      Step step{md::make_call(handle, qualified + "." + overload, t[2].cast<py::tuple>(),
                              t[3].cast<py::dict>(), slot_of)};
      for (auto o : t[4].cast<py::list>()) step.outs.push_back(o.cast<int64_t>());
      for (auto f : t[5].cast<py::list>()) step.frees.push_back(f.cast<int64_t>());
      const auto& returns = handle.schema().returns();
      step.spread = returns.size() == 1 && returns[0].type()->kind() == c10::TypeKind::ListType;
      if (step.outs.size() == 1) step.out_op = out_variant(handle);
      steps_.emplace_back(std::move(step));
    }
  }

  // Run steps [begin, end) on env; compute steps only (others are skipped: the caller runs
  // them). Returns -1, or the index of the step that raised (its message in last_error).
  int64_t run(Env& env, int64_t begin, int64_t end) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> one_run_at_a_time(lock_);  // (the steps' buffers)
    // A plan spells out its backward pass: no autograd bookkeeping for its ops (what the
    // GraphModule peer pays on every call).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto& values = env.values;
    if (end > static_cast<int64_t>(steps_.size()) || begin < 0)
      throw std::out_of_range("Program.run: steps out of range");
    reused_ = 0;
    torch::jit::Stack stack;  // reused: no allocation per step
    stack.reserve(16);
    for (int64_t k = begin; k < end; ++k) {
      auto& maybe = steps_[k];
      if (!maybe) continue;
      Step& step = *maybe;
      try {
        md::fill_stack(step.call, stack, [&](int64_t k) -> const c10::IValue& {
          return values.at(k);
        });
        at::Tensor& buffer = step.buffer;
        if (buffer.defined() && buffer.use_count() == 1 && buffer.storage().use_count() == 1) {
          stack.push_back(buffer);  // nothing from the last run holds it: write it again
          step.out_op->callBoxed(&stack);
          ++reused_;
        } else {
          step.call.op.callBoxed(&stack);
          if (step.out_op && stack.size() == 1 && stack[0].isTensor()) {
            const at::Tensor& result = stack[0].toTensor();
            if (result.defined() && result.is_contiguous() &&
                result.numel() * static_cast<int64_t>(result.element_size()) <= kPlannedBytes)
              buffer = result;
          }
        }
        if (step.spread) {
          auto list = stack.at(0).toList();
          for (size_t i = 0; i < step.outs.size() && i < list.size(); ++i)
            values.at(step.outs[i]) = list.get(i);
        } else {
          for (size_t i = 0; i < step.outs.size() && i < stack.size(); ++i)
            values.at(step.outs[i]) = std::move(stack[i]);
        }
      } catch (const std::exception& e) {
        last_error_ = md::error_type(e) + ": " + md::error_text(e);
        return k;
      }
      for (auto f : step.frees) values.at(f) = c10::IValue();
    }
    return -1;
  }

  std::string last_error() const { return last_error_; }
  int64_t reused() const { return reused_; }
  int64_t size() const { return static_cast<int64_t>(steps_.size()); }

 private:
  std::vector<std::optional<Step>> steps_;
  std::string last_error_;
  std::mutex lock_;
  int64_t reused_ = 0;  // steps of the last run that wrote a buffer of the run before
};

void bind_program(py::module& m) {
  py::class_<Env>(m, "Env")
      .def(py::init<int64_t>())
      .def("set", &Env::set)
      .def("__setitem__", &Env::set)
      .def("__getitem__", &Env::get)
      .def("set_none", &Env::set_none)
      .def("get", &Env::get)
      .def("has", &Env::has)
      .def("__len__", &Env::size);
  py::class_<Program>(m, "Program")
      .def(py::init<const py::list&, py::handle>())
      .def("run", &Program::run)
      .def("last_error", &Program::last_error)
      .def("reused", &Program::reused)
      .def("__len__", &Program::size);
}
