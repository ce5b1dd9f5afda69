// The compute part of a compiled plan, run through the c10 dispatcher.
//
// A CompiledPlan (Python: `_core.CompiledPlan`; not to be confused with `isa.Program`, the
// lowered plan it is built from) is built once per plan on each worker from the lowered steps
// (op name, arguments with slot markers, outputs, slots to free). Building resolves every operator to its
// dispatcher handle and converts every constant argument to an IValue by the operator's schema,
// so running a step is: copy the argument template, put the slot values in, callBoxed, store the
// results. No Python on that path (an op whose kernel is Python, such as prims, takes the GIL
// itself).

#include "boxed.h"
#include "collectives.h"
#include "comm.h"

#include <torch/csrc/Dtype.h>

#include <algorithm>
#include <array>
#include <ctime>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
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
  // Python numbers where the schema has a Tensor (x * 0.5): double or int64 wrapped numbers.
  // TensorIterator copies a double one to float32 on every call with float32 tensors (an
  // allocation and a copy, as long as the op itself on small tensors); the step keeps that
  // conversion instead, made once: the same value the op would have made.
  struct Wrapped {
    size_t arg;
    at::Tensor original, converted;
  };
  std::vector<Wrapped> wrapped;
  // An op with no out= overload (relu) whose in-place twin (relu_) takes its first argument:
  // run in place when that argument dies at this step and nothing else holds it, once an
  // out-of-place run showed a result like the argument (dtype, sizes, contiguous).
  std::optional<c10::OperatorHandle> inplace_op;
  int64_t inplace_slot = -1;
  int64_t inplace_producer = -1;  // the step that made that argument (it may hold it as buffer)
  bool inplace_ok = false;
  at::ScalarType inplace_dtype = at::kFloat;  // of that result
  std::vector<int64_t> inplace_sizes;
  // A view op (transpose, view, detach: its result aliases its first argument): that
  // argument's slot; -1 else.
  int64_t view_of = -1;
  // Makes the storage of a gradient bucket's argument (an all-reduce on shared memory):
  // `made_sizes` (its elements `made_numel`, contiguity, dtype) of its last result, recorded
  // until the all-reduce's block is set up (`feeds_bucket`); from then on, where it was, the
  // result is written into that block (CommStep::block), at `bucket_at` elements, with
  // `made_sizes` (`bucket_comm` >= 0).
  bool feeds_bucket = false;
  bool made_contiguous = false;
  at::ScalarType made_dtype = at::kFloat;
  std::vector<int64_t> made_sizes;
  int64_t made_numel = 0;
  int64_t bucket_comm = -1, bucket_at = 0;
};

// A communication step of this rank (set by Python: runtime/plan_runner.py), run by
// CompiledPlan::run_plan the way PlanRunner._comm runs it.
struct CommStep {
  std::string op;  // all_reduce all_gather reduce_scatter all_to_all send recv shard_local
                   // partial_local
  std::vector<int64_t> args;  // the slot of each argument (-1: not a slot)
  std::vector<int64_t> outs, frees;
  std::shared_ptr<md::Comm> comm;  // collectives, send, recv
  int64_t index = 0, size = 1;     // this rank in the group / in the mesh dim; its size
  int64_t peer = -1;               // send / recv: the peer's index in the pair's group
  std::string reduce;              // sum avg max min
  int64_t dim = 0, split_dim = 0, cat_dim = 0;
  std::vector<std::vector<int64_t>> shapes;  // of the arguments: zeros when failed
  at::ScalarType dtype = at::kFloat;
  bool async = false;  // not on "main": started now, waited for at a result's first use
  // all_reduce: the compute step that made each argument (-1: none; it may keep the argument
  // as its buffer).
  std::vector<int64_t> producers;
  // all_reduce, when its tensors cannot take the result (reduces_in_place): result buffers
  // (a gradient bucket's flat tensor) of earlier runs, written again when nothing else holds
  // them. A fresh multi-MiB buffer per run is a fresh mapping
  // from the allocator, every page of it faulted in by the all-reduce: with 8 x Linear(1024)
  // on 2 ranks that was ~2,600 page faults and ~8 ms of kernel time per step. torch DDP keeps
  // its buckets for the same reason. (The controller deletes the state a run replaces before
  // the next run, so a step's old gradients are gone when it all-reduces its new ones.) Two,
  // for gradient accumulation: the step's input gradients, views of one, are read while the
  // other is written.
  std::array<at::Tensor, 2> buffers;
  // all_reduce: the step that made each argument's storage, back through views (-1: none
  // with an out= overload). Where some argument has one, the all-reduce is on shared memory
  // (Comm::share) and its second run can reduce in place, the ranks set up a block
  // (`block`) of two halves (`block_flats`, this rank's, as tensors: one holds the last
  // run's results while the caller has them, the next run's go into the other) that those
  // steps write their results into from the next run on (Step::bucket_comm), each argument
  // at `block_at` elements (the others, `block_copy`: a bias's gradient made by
  // sum.dim_IntList, copied there at the all-reduce); the all-reduce then reduces that half
  // of every rank's block where it lies, with no copies in or out of slots
  // (Comm::all_reduce_shared), and its results are views of it. `block_run`: the run whose
  // results are in half `block_half` (taken at its first such step: a half that nothing
  // from an earlier run holds any more).
  std::vector<int64_t> makers;
  int64_t runs_seen = 0;
  std::shared_ptr<md::SharedBlock> block;
  std::array<at::Tensor, 2> block_flats;
  std::vector<int64_t> block_at;
  std::vector<bool> block_copy;
  uint64_t block_run = 0;
  int block_half = 0;
};

// A started collective shared by its result slots (a bucket): finished once, by the first
// that is needed.
struct Pending {
  std::function<void()> finish;
  void run() {
    auto f = std::move(finish);
    finish = nullptr;
    if (f) f();
  }
};

// Results up to this size are written into the previous run's buffer: for small tensors,
// making a new one (allocation, TensorImpl) costs as much as the op itself; big ones are left
// to the allocator, so planning never holds much memory between runs.
constexpr int64_t kPlannedBytes = 64 << 10;

// Whether `a` and `b` have the same formal arguments, of the same names, types and kinds
// (div.Scalar and div.out share the names `self, other`, but not other's type: a Scalar there
// is no Tensor, and writing div.Scalar's result with div.out failed on the second run).
bool same_formals(const std::vector<c10::Argument>& a, const std::vector<c10::Argument>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i].name() != b[i].name() || a[i].kwarg_only() != b[i].kwarg_only() ||
        *a[i].type() != *b[i].type())
      return false;
  }
  return true;
}

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
  // An out= kernel of a device: not one torchgen made from the functional op (relu.out:
  // compute, then copy into out), which is slower than the op itself.
  if (!out || !(out->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
                out->hasKernelForDispatchKey(c10::DispatchKey::CUDA)))
    return std::nullopt;
  const auto& formals = schema.arguments();
  const auto& out_formals = out->schema().arguments();
  if (out_formals.size() != formals.size() + 1 || !out_formals.back().is_out() ||
      !same_formals(formals, out_formals))
    return std::nullopt;
  return out;
}

// The in-place twin of `handle` (relu -> relu_): same arguments, the first written and
// returned, while the op itself returns one fresh tensor.
std::optional<c10::OperatorHandle> inplace_variant(const c10::OperatorHandle& handle) {
  const auto& schema = handle.schema();
  const auto& returns = schema.returns();
  if (returns.size() != 1 || returns[0].type()->kind() != c10::TypeKind::TensorType ||
      returns[0].alias_info() != nullptr || schema.is_mutable() || schema.arguments().empty())
    return std::nullopt;
  const std::string name = schema.name();
  if (name.find("view") != std::string::npos || name.find("alias") != std::string::npos)
    return std::nullopt;
  auto twin = c10::Dispatcher::singleton().findOp({name + "_", schema.overload_name()});
  if (!twin) return std::nullopt;
  const auto& formals = schema.arguments();
  const auto& twin_formals = twin->schema().arguments();
  if (twin_formals.size() != formals.size() || !same_formals(formals, twin_formals))
    return std::nullopt;
  const auto* alias = twin_formals[0].alias_info();
  if (!alias || !alias->isWrite() || twin_formals[0].type()->kind() != c10::TypeKind::TensorType)
    return std::nullopt;
  return twin;
}

// A tensor-list argument (cat's): type promotion over lists is left to the op.
bool holds_tensors(const c10::IValue& v) {
  if (v.isTensorList()) return true;
  if (!v.isList()) return false;
  // Tensor?[], or a generic list of tensors
  return v.toList().elementType()->kind() == c10::TypeKind::OptionalType ||
         (!v.toListRef().empty() && v.toListRef()[0].isTensor());
}

// Part `index` of `n` of `t` along `dim`, a view: chunk's parts (lower.py shard_view; shards
// are exact, and then one narrow, not a view of every part).
at::Tensor part_of(const at::Tensor& t, int64_t dim, int64_t index, int64_t n) {
  const int64_t size = t.size(dim);
  return size % n == 0 ? t.narrow(dim, index * (size / n), size / n) : t.chunk(n, dim).at(index);
}

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
  // set(slots[k], objs[k]) for every k: a compiled step's inputs in one call.
  void set_many(const std::vector<int64_t>& slots, const py::sequence& objs) {
    if (static_cast<size_t>(py::len(objs)) != slots.size())
      throw std::invalid_argument("Env.set_many: as many values as slots");
    for (size_t k = 0; k < slots.size(); ++k) set(slots[k], objs[k]);
  }
  // Slot i = this rank's part of `whole`, cut as `cuts` says, in order: (dim, index, n) takes
  // part `index` of `n` along `dim` (runtime/plan_runner.py's local_part, by chunk's parts);
  // a tensor of its own, contiguous. Without Python: each torch call from Python costs a
  // worker several microseconds per call of a compiled step.
  void set_part(int64_t i, const at::Tensor& whole,
                const std::vector<std::tuple<int64_t, int64_t, int64_t>>& cuts) {
    at::Tensor part = whole;
    for (const auto& [dim, index, n] : cuts) part = part_of(part, dim, index, n);
    values.at(i) = part.clone(at::MemoryFormat::Contiguous);
  }
  py::object get(int64_t i) { return torch::jit::toPyObject(values.at(i)); }
  bool has(int64_t i) const { return !values.at(i).isNone(); }
  int64_t size() const { return static_cast<int64_t>(values.size()); }
  std::vector<c10::IValue> values;
};

class CompiledPlan {
 public:
  // steps: the plan's steps for this rank, each an `isa.Compute` (read by field name: its
  // `name` "aten.mm.default", `args`, `kwargs`, `outs`, `frees`) or None (a communication
  // step, given later by set_comm, or another rank's step).
  CompiledPlan(const py::list& steps, py::handle slot_type) {
    auto slot_of = [&](py::handle obj) -> int64_t {
      return py::isinstance(obj, slot_type) ? obj.attr("index").cast<int64_t>() : -1;
    };
    auto& producer = producer_;  // slot -> the last step writing it
    for (const auto& item : steps) {
      if (item.is_none()) {
        steps_.emplace_back(std::nullopt);
        continue;
      }
      if (!py::hasattr(item, "name") || !py::hasattr(item, "kwargs"))
        throw py::type_error("CompiledPlan: step " + std::to_string(steps_.size()) +
                             " is not an isa.Compute: " + py::repr(item).cast<std::string>());
      const auto name = item.attr("name").cast<std::string>();  // "aten.mm.default"
      const auto dot1 = name.find('.'), dot2 = name.rfind('.');
      if (dot1 == std::string::npos || dot2 == dot1)
        throw py::value_error("CompiledPlan: not an overload name: " + name);
      const auto qualified = name.substr(0, dot1) + "::" + name.substr(dot1 + 1, dot2 - dot1 - 1);
      const auto overload = name.substr(dot2 + 1);
      auto handle = md::find_op(qualified, overload);
      Step step{md::make_call(handle, qualified + "." + overload,
                              py::tuple(item.attr("args")), item.attr("kwargs").cast<py::dict>(),
                              slot_of)};
      for (auto o : item.attr("outs")) step.outs.push_back(o.cast<int64_t>());
      for (auto f : item.attr("frees")) step.frees.push_back(f.cast<int64_t>());
      const auto& returns = handle.schema().returns();
      step.spread = returns.size() == 1 && returns[0].type()->kind() == c10::TypeKind::ListType;
      if (step.outs.size() == 1) step.out_op = out_variant(handle);
      for (size_t i = 0; i < step.call.stack.size(); ++i) {
        const auto& v = step.call.stack[i];
        if (v.isTensor() && v.toTensor().defined() &&
            v.toTensor().unsafeGetTensorImpl()->is_wrapped_number())
          step.wrapped.push_back({i, v.toTensor(), {}});
      }
      if (!step.out_op && step.outs.size() == 1) {
        const auto& patches = step.call.patches;
        auto first = std::find_if(patches.begin(), patches.end(),
                                  [](const md::Patch& p) { return p.arg == 0 && !p.list; });
        if (first != patches.end()) {
          int64_t slot = first->keys[0];
          bool dies = std::count(step.frees.begin(), step.frees.end(), slot) > 0;
          int64_t uses = 0;
          for (const auto& p : patches) uses += std::count(p.keys.begin(), p.keys.end(), slot);
          if (dies && uses == 1 && (step.inplace_op = inplace_variant(handle))) {
            step.inplace_slot = slot;
            auto made = producer.find(slot);
            step.inplace_producer = made == producer.end() ? -1 : made->second;
          }
        }
      }
      if (returns.size() == 1 && returns[0].alias_info() != nullptr &&
          !returns[0].alias_info()->isWrite()) {
        const auto& patches = step.call.patches;
        auto first = std::find_if(patches.begin(), patches.end(),
                                  [](const md::Patch& p) { return p.arg == 0 && !p.list; });
        if (first != patches.end()) step.view_of = first->keys[0];
      }
      for (auto o : step.outs) producer[o] = static_cast<int64_t>(steps_.size());
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
      throw std::out_of_range("CompiledPlan.run: steps out of range");
    reused_ = in_place_ = 0;
    keep_ = true;
    torch::jit::Stack stack;  // reused: no allocation per step
    stack.reserve(16);
    for (int64_t k = begin; k < end; ++k) {
      auto& maybe = steps_[k];
      if (!maybe) continue;
      try {
        run_compute(*maybe, values, stack);
      } catch (const std::exception& e) {
        last_error_ = md::error_type(e) + ": " + md::error_text(e);
        return k;
      }
    }
    return -1;
  }

  // Communication step `k` of this rank: `step`, an isa.Comm (read by field name: its `kind`,
  // `args`, `outs`, `frees`, `shapes`, `dtype`, and the kind's own `reduce`, `dim`,
  // `split_dim`, `cat_dim`), with what the worker decides: the group (None for local
  // redistributions), this rank's index in it (or along the step's dim) and its size, the
  // send/recv peer's index in the pair's group, and whether it is started now and waited for
  // at a result's first use (`async_`: not on the main stream).
  void set_comm(int64_t k, py::handle step, py::handle group, int64_t index, int64_t size,
                int64_t peer, bool async, py::handle slot_type) {
    if (k < 0 || k >= static_cast<int64_t>(steps_.size()) || steps_[k])
      throw std::out_of_range("CompiledPlan.set_comm: not a communication step");
    auto field = [&](const char* name, py::object fallback) {
      return py::hasattr(step, name) ? py::object(step.attr(name)) : fallback;
    };
    CommStep c;
    c.op = step.attr("kind").cast<std::string>();
    for (auto a : step.attr("args"))
      c.args.push_back(py::isinstance(a, slot_type) ? a.attr("index").cast<int64_t>() : -1);
    for (auto o : step.attr("outs")) c.outs.push_back(o.cast<int64_t>());
    for (auto f : step.attr("frees")) c.frees.push_back(f.cast<int64_t>());
    for (auto a : c.args) {
      auto made = producer_.find(a);
      c.producers.push_back(made == producer_.end() || made->second >= k ? -1 : made->second);
      if (c.op == "all_reduce") {
        const int64_t m = storage_maker(a, k);
        c.makers.push_back(m);
        if (m >= 0) steps_[m]->feeds_bucket = true;
      }
    }
    if (!group.is_none()) c.comm = md::comm_of(group);
    c.index = index;
    c.size = size;
    c.peer = peer;
    c.reduce = field("reduce", py::str("sum")).cast<std::string>();
    c.dim = field("dim", py::int_(0)).cast<int64_t>();
    c.split_dim = field("split_dim", py::int_(0)).cast<int64_t>();
    c.cat_dim = field("cat_dim", py::int_(0)).cast<int64_t>();
    for (auto shape : step.attr("shapes")) c.shapes.push_back(shape.cast<std::vector<int64_t>>());
    c.dtype = md::dtype_named(step.attr("dtype"));
    c.async = async;
    if (comms_.size() < steps_.size()) comms_.resize(steps_.size());
    comms_[k] = std::move(c);
  }

  void set_uses(std::vector<std::vector<int64_t>> uses) { uses_ = std::move(uses); }

  // The group over the whole mesh whose members agree, at the end of every run_plan, on
  // whether any of them failed (runtime/plan_runner.py: the failure flag, a one-int MAX
  // all-reduce). Done here, not in Python: the flag's tensor, options and wrapper cost a
  // worker more than the all-reduce itself (~100 us of its CPU per call on a 2-core host).
  void set_agree(py::handle group) { agree_ = md::comm_of(group); }

  // The whole plan for this rank, without the GIL: compute steps and the communication steps
  // given by set_comm, in order. Collectives off the main stream are started and waited for
  // at their result's first use (a bucket's all-reduce overlaps the rest of the backward).
  // After a failure the rank computes nothing more but still takes part in every
  // communication, with zeros, so no peer waits forever; `inputs_failed`: from the start (an
  // input failed on this rank). Returns -1 or the failed step (the number of steps: after
  // them, or the inputs); with set_agree, kOtherFailed where this rank ran fine and another
  // failed (an exception where the flag's all-reduce fails: a peer died).
  int64_t run_plan(Env& env, const c10::Device& device, bool inputs_failed) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> one_run_at_a_time(lock_);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto& values = env.values;
    reused_ = in_place_ = reduced_in_place_ = reduced_shared_ = 0;
    ++runs_;
    keep_ = runs_ >= 2;
    trace_events_.clear();
    // (at most 3 events a step, one per collective waited for at the end, and the flag's:
    // reserved, so recording never allocates, nor throws, inside a step's error handling)
    if (trace_) trace_events_.reserve(4 * steps_.size() + 2);
    // With set_trace: what this thread did, step by step (see last_trace). Off: one branch
    // per step.
    auto traced = [&](int64_t k, int kind, auto&& body) {
      if (!trace_) return body();
      const double start = monotonic_seconds();
      try {
        body();
      } catch (...) {
        trace_events_.emplace_back(k, kind, start, monotonic_seconds());
        throw;
      }
      trace_events_.emplace_back(k, kind, start, monotonic_seconds());
    };
    int64_t failed = inputs_failed ? static_cast<int64_t>(steps_.size()) : -1;
    std::unordered_map<int64_t, std::shared_ptr<Pending>> pending;
    auto settle = [&](int64_t slot) {
      auto it = pending.find(slot);
      if (it == pending.end()) return;
      auto p = it->second;
      pending.erase(it);
      p->run();
    };
    auto any_pending = [&](const std::vector<int64_t>& slots) {
      return std::any_of(slots.begin(), slots.end(), [&](int64_t s) { return pending.count(s); });
    };
    auto fail_at = [&](int64_t k, const std::exception& e) {
      if (failed < 0) {
        failed = k;
        last_error_ = md::error_type(e) + ": " + md::error_text(e);
      }
    };
    torch::jit::Stack stack;
    stack.reserve(16);
    const int64_t n = static_cast<int64_t>(steps_.size());
    for (int64_t k = 0; k < n; ++k) {
      Step* compute = steps_[k] ? &*steps_[k] : nullptr;
      CommStep* comm = k < static_cast<int64_t>(comms_.size()) && comms_[k] ? &*comms_[k] : nullptr;
      if (!compute && !comm) continue;  // another rank's step
      try {
        if (k < static_cast<int64_t>(uses_.size()) && any_pending(uses_[k]))
          traced(k, kTraceWait, [&] {
            for (auto s : uses_[k]) settle(s);
          });
        if (compute) {
          if (failed < 0) traced(k, kTraceCompute, [&] { run_compute(*compute, values, stack); });
          continue;  // (its frees are done)
        }
        traced(k, kTraceComm, [&] { run_comm(k, *comm, values, pending, failed >= 0, device); });
        auto free_them = [&] {
          for (auto f : comm->frees) {
            settle(f);
            values.at(f) = c10::IValue();
          }
        };
        if (any_pending(comm->frees))
          traced(k, kTraceWait, free_them);
        else
          free_them();
      } catch (const std::exception& e) {
        fail_at(k, e);
      }
    }
    while (!pending.empty()) {
      auto it = pending.begin();
      int64_t slot = it->first;
      try {
        traced(n, kTraceWait, [&] { settle(slot); });
      } catch (const std::exception& e) {
        fail_at(n, e);
      }
    }
    agree_cpu_ = 0;
    if (agree_) {
      const double start = thread_cpu_seconds();
      const double wall = trace_ ? monotonic_seconds() : 0.0;
      // (recorded on every way out: the flag is the end of this rank's run)
      struct Mark {
        CompiledPlan& plan;
        int64_t n;
        double wall;
        ~Mark() {
          if (!plan.trace_) return;
          try {
            plan.trace_events_.emplace_back(n, kTraceAgree, wall, monotonic_seconds());
          } catch (...) {  // (a destructor: never throws; the record lacks the flag)
          }
        }
      } mark{*this, n, wall};
      bool any = false;
      try {
        if (!flag_.defined() || flag_.device() != device)
          flag_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
        flag_.fill_(failed >= 0 ? 1 : 0);
        agree_->all_reduce(flag_, "max");
        any = flag_.item<int32_t>() != 0;
      } catch (const std::exception&) {
        // (a peer died, or a GPU error of the failed step is still pending): this rank's own
        // failure is the cause to report; a rank that ran fine reports the flag's error
        agree_cpu_ = thread_cpu_seconds() - start;
        if (failed >= 0) return failed;
        throw;
      }
      agree_cpu_ = thread_cpu_seconds() - start;
      if (failed < 0 && any) return kOtherFailed;
    }
    return failed;
  }

  static constexpr int64_t kOtherFailed = -2;
  // last_trace's kinds: a compute step; a communication step (a collective on main, or the
  // start of one on another stream); waiting for started collectives to finish (before the
  // step that uses their results, at their last use, or at the end); the failure flag's
  // all-reduce (its step number is the number of steps).
  static constexpr int kTraceCompute = 0, kTraceComm = 1, kTraceWait = 2, kTraceAgree = 3;

  // Record the next runs' steps (see last_trace); off again with false.
  void set_trace(bool on) { trace_ = on; }
  // The last run_plan's record, when set_trace was on: (step, kind, start, end) in the order
  // they ended, in seconds of CLOCK_MONOTONIC (one clock for every process of a host).
  std::vector<std::tuple<int64_t, int, double, double>> last_trace() const {
    return trace_events_;
  }

  std::string last_error() const { return last_error_; }
  // The CPU seconds of the last run_plan's failure flag (what calibration keeps out of the
  // steps' time: runtime/plan_runner.py steps_cpu).
  double last_agree_cpu() const { return agree_cpu_; }
  bool has_comms() const { return !comms_.empty(); }
  int64_t reused() const { return reused_; }
  int64_t in_place() const { return in_place_; }
  // All-reduces of the last run_plan whose arguments took the result (reduces_in_place).
  int64_t reduced_in_place() const { return reduced_in_place_; }
  // Of those, all-reduces of a block every rank maps (CommStep::block).
  int64_t reduced_shared() const { return reduced_shared_; }
  int64_t size() const { return static_cast<int64_t>(steps_.size()); }

 private:
  // Replace the step's double wrapped numbers by float32 ones where all of the op's tensors
  // are float32: what TensorIterator's type promotion makes of them on every call.
  static void convert_wrapped(Step& step, torch::jit::Stack& stack) {
    std::optional<at::ScalarType> common;
    for (const auto& v : stack) {
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) continue;
        if (common && *common != t.scalar_type()) return;
        common = t.scalar_type();
      } else if (holds_tensors(v)) {
        return;
      }
    }
    // Only float32: half and bfloat16 ops read a scalar in float, unrounded; integers are
    // left as they are (7 into uint8 is not 7, and int / int is a float division).
    if (!common || *common != at::kFloat) return;
    for (auto& w : step.wrapped) {
      const at::ScalarType from = w.original.scalar_type();
      if (from != at::kDouble) continue;
      if (!w.converted.defined() || w.converted.scalar_type() != *common) {
        w.converted = w.original.to(*common);
        w.converted.unsafeGetTensorImpl()->set_wrapped_number(true);
      }
      stack[w.arg] = w.converted;
    }
  }

  // Whether `step` can run in place on its first argument now (see Step::inplace_op): held
  // only by its slot, and maybe as the buffer of the step that made it (which writes that
  // buffer again only once nothing else holds it).
  bool in_place_now(const Step& step, const std::vector<c10::IValue>& values) const {
    if (!step.inplace_ok) return false;
    const c10::IValue& v = values.at(step.inplace_slot);
    if (!v.isTensor()) return false;
    const at::Tensor& t = v.toTensor();
    size_t holders = 1;
    if (step.inplace_producer >= 0) {
      const auto& made_by = steps_[step.inplace_producer];
      if (made_by && made_by->buffer.defined() && made_by->buffer.is_same(t)) ++holders;
    }
    return t.defined() && t.use_count() == holders && t.storage().use_count() == 1 &&
           t.is_contiguous() && t.scalar_type() == step.inplace_dtype &&
           t.sizes().equals(step.inplace_sizes);
  }

  void run_compute(Step& step, std::vector<c10::IValue>& values, torch::jit::Stack& stack) {
    const bool in_place = step.inplace_op && in_place_now(step, values);
    md::fill_stack(step.call, stack, [&](int64_t k) -> const c10::IValue& {
      return values.at(k);
    });
    if (!step.wrapped.empty()) convert_wrapped(step, stack);
    at::Tensor& buffer = step.buffer;
    if (in_place) {
      step.inplace_op->callBoxed(&stack);
      ++reused_;
      ++in_place_;
    } else if (step.bucket_comm >= 0 && claim_block(*comms_[step.bucket_comm])) {
      // (a bucket's gradient, written where the all-reduce reads every rank's)
      const CommStep& c = *comms_[step.bucket_comm];
      const at::Tensor& flat = c.block_flats[c.block_half];
      stack.push_back(flat.narrow(0, step.bucket_at, step.made_numel).view(step.made_sizes));
      step.out_op->callBoxed(&stack);
      ++reused_;
      buffer = at::Tensor();  // (its result of the runs before the block: not written again)
    } else if (step.out_op && buffer.defined() && buffer.use_count() == 1 &&
               buffer.storage().use_count() == 1) {
      stack.push_back(buffer);  // nothing from the last run holds it: write it again
      step.out_op->callBoxed(&stack);
      ++reused_;
    } else if (step.inplace_op) {
      // Out of place; its result tells whether running in place would give the same.
      const c10::IValue& arg = values.at(step.inplace_slot);
      step.call.op.callBoxed(&stack);
      step.inplace_ok = false;
      if (arg.isTensor() && stack.size() == 1 && stack[0].isTensor()) {
        const at::Tensor& in = arg.toTensor();
        const at::Tensor& result = stack[0].toTensor();
        step.inplace_ok = in.defined() && result.defined() && in.is_contiguous() &&
                          result.is_contiguous() && in.scalar_type() == result.scalar_type() &&
                          in.sizes().equals(result.sizes());
        step.inplace_dtype = result.scalar_type();
        step.inplace_sizes = result.sizes().vec();
      }
    } else {
      step.call.op.callBoxed(&stack);
      // (not in a plan's first run_plan: a plan run once, as a step's first call is, compiled
      // for the state before it exists, keeps nothing it would not use again)
      if (keep_ && step.out_op && stack.size() == 1 && stack[0].isTensor()) {
        const at::Tensor& result = stack[0].toTensor();
        if (result.defined() && result.is_contiguous() &&
            result.numel() * static_cast<int64_t>(result.element_size()) <= kPlannedBytes)
          buffer = result;
      }
    }
    if (step.feeds_bucket && stack.size() == 1 && stack[0].isTensor()) {
      const at::Tensor& made = stack[0].toTensor();
      step.made_contiguous = made.defined() && made.is_contiguous();
      if (step.made_contiguous) {
        step.made_sizes = made.sizes().vec();
        step.made_numel = made.numel();
        step.made_dtype = made.scalar_type();
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
    for (auto f : step.frees) values.at(f) = c10::IValue();
  }

  // PlanRunner._comm in C++.
  // One of `c.buffers` that no tensor but it uses (not even a view) with this shape and
  // type; else a new one, kept (except in a plan's first run_plan) in place of one that does
  // not fit or, failing that, of the first (which stays alive while its holders need it).
  at::Tensor result_buffer(CommStep& c, at::IntArrayRef sizes,
                           const at::TensorOptions& options) const {
    auto fits = [&](const at::Tensor& b) {
      return b.defined() && b.sizes() == sizes && b.dtype() == options.dtype() &&
             b.device() == options.device();
    };
    for (auto& b : c.buffers)
      if (fits(b) && b.use_count() == 1 && b.storage().use_count() == 1) return b;
    if (!keep_) return at::empty(sizes, options);  // (a plan's first run_plan: above)
    auto& slot = fits(c.buffers[0]) ? c.buffers[1] : c.buffers[0];
    slot = at::empty(sizes, options);
    return slot;
  }

  // Whether `t` is laid out densely over all of its storage, from its start (any strides).
  static bool covers_storage(const at::Tensor& t) {
    return t.defined() && t.storage_offset() == 0 && t.is_non_overlapping_and_dense() &&
           t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
  }

  // Whether all-reduce `c`'s argument i is a slot that dies at the step and is passed once:
  // its result can take its place.
  static bool dies_here(const CommStep& c, size_t i) {
    const int64_t slot = c.args[i];
    return slot >= 0 && std::count(c.frees.begin(), c.frees.end(), slot) > 0 &&
           std::count(c.args.begin(), c.args.end(), slot) == 1;
  }

  // Whether all-reduce `c` can leave its result in its arguments `tensors` (no result
  // buffer, and every write to a line the rank has just read): each argument dies at the
  // step, is used once, is the only tensor on its storage (but for the buffer its producer
  // keeps for the next run) and covers that storage exactly, densely (in any layout: the
  // reduction is elementwise, and every rank lays the bucket out alike); one dtype. (A
  // tensor that Python has held keeps a reference here: a plan's own results qualify.)
  // compiler/simulate.py:_reduces_in_place is the same rule on the simulator's memory.
  bool reduces_in_place(const CommStep& c, const std::vector<at::Tensor>& tensors) const {
    if (tensors.empty() || tensors.size() != c.args.size() || c.outs.size() != c.args.size())
      return false;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      if (!dies_here(c, i)) return false;
      if (!t.defined() || t.scalar_type() != tensors[0].scalar_type())
        return false;
      int64_t holders = 2;  // its slot and `tensors`
      const int64_t made_by = i < c.producers.size() ? c.producers[i] : -1;
      if (made_by >= 0 && steps_[made_by] && steps_[made_by]->buffer.defined() &&
          steps_[made_by]->buffer.is_same(t))
        ++holders;
      if (t.use_count() != holders || t.storage().use_count() != 1 || !covers_storage(t))
        return false;
    }
    return true;
  }

  // The compute step (before step `before`) that made the storage `slot` lies in: back
  // through view ops to one with an out= overload; -1 where there is none.
  int64_t storage_maker(int64_t slot, int64_t before) const {
    for (int depth = 0; depth < 64 && slot >= 0; ++depth) {
      auto made = producer_.find(slot);
      if (made == producer_.end() || made->second >= before || !steps_[made->second]) return -1;
      const Step& s = *steps_[made->second];
      if (s.out_op) return made->second;
      before = made->second;
      slot = s.view_of;
    }
    return -1;
  }

  // Whether this run's results go into a half of `c`'s block: taken by its first maker, the
  // first half nothing else (an earlier run's gradients, still held) uses.
  bool claim_block(CommStep& c) {
    if (c.block_run == runs_) return true;
    for (int h = 0; h < 2; ++h) {
      const at::Tensor& flat = c.block_flats[h];
      if (flat.use_count() == 1 && flat.storage().use_count() == 1) {
        c.block_run = runs_;
        c.block_half = h;
        return true;
      }
    }
    return false;
  }

  // Whether all-reduce `c` can reduce its block this run: its makers wrote their results
  // there (and each argument is that result, where its maker put it), every argument dies at
  // the step and is used once (its result takes its place), and no other view of the block
  // is alive; the arguments it copies in (block_copy) are of their place's size. One dtype,
  // contiguous.
  bool block_ready(const CommStep& c, const std::vector<at::Tensor>& tensors) const {
    if (c.block_run != runs_ || tensors.size() != c.args.size() ||
        c.outs.size() != c.args.size() || c.block_copy.size() != tensors.size())
      return false;
    const at::Tensor& flat = c.block_flats[c.block_half];
    const auto* base = static_cast<const char*>(flat.data_ptr());
    const size_t es = flat.element_size();
    int64_t views = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      if (!dies_here(c, i)) return false;
      if (!t.defined() || t.scalar_type() != flat.scalar_type() || !t.is_contiguous())
        return false;
      const int64_t room =
          (i + 1 < c.block_at.size() ? c.block_at[i + 1] : flat.numel()) - c.block_at[i];
      if (c.block_copy[i]) {
        if (t.numel() > room || t.storage().is_alias_of(flat.storage())) return false;
        continue;
      }
      if (t.data_ptr() != base + c.block_at[i] * es || t.use_count() != 2 ||
          !t.storage().is_alias_of(flat.storage()))
        return false;
      ++views;
    }
    // (the flat and one tensor per argument made there: no other view of the half alive)
    return flat.storage().use_count() == 1 + views;
  }

  // At the second run of an all-reduce with a maker among its arguments (a plan run once
  // keeps no block), on every rank (a collective: Comm::share's vote makes every rank's
  // answer the same): a block for its arguments, each at a 64-byte aligned place in each
  // half, where this run's arguments could be reduced in place. An argument whose maker
  // made it whole and contiguous (and makes no other) is written there by that maker from
  // the next run on; the others are copied in.
  void set_up_block(int64_t k, CommStep& c, const std::vector<at::Tensor>& tensors,
                    bool failed) {
    if (!c.comm || tensors.empty() || tensors.size() != c.makers.size() ||
        std::count(c.makers.begin(), c.makers.end(), -1) ==
            static_cast<int64_t>(c.makers.size()))
      return;  // (the same on every rank: the plan's)
    bool ok = !failed && reduces_in_place(c, tensors);
    const at::ScalarType dtype = tensors[0].scalar_type();
    const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t align = std::max<int64_t>(1, 64 / es);
    std::vector<int64_t> at;
    std::vector<bool> copy;
    int64_t count = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      ok = ok && tensors[i].is_contiguous();
      const int64_t m = c.makers[i];
      // (its own dtype: an out= overload casts into its out, where a view (to.dtype) between
      // the maker and the argument changed it)
      bool made = m >= 0 && std::count(c.makers.begin(), c.makers.end(), m) == 1 &&
                  steps_[m]->made_contiguous && steps_[m]->made_dtype == dtype;
      made = made && steps_[m]->made_numel == tensors[i].numel();
      copy.push_back(!made);
      at.push_back(count);
      count += (tensors[i].numel() + align - 1) / align * align;  // (shapes: alike on all)
    }
    ok = ok && std::count(copy.begin(), copy.end(), false) > 0;  // (a maker writes there)
    const int64_t bytes = count * es;  // (a half: a multiple of 64)
    auto block = c.comm->share(static_cast<size_t>(2 * bytes), ok);
    if (!block) return;
    c.block = block;
    for (int h = 0; h < 2; ++h) {
      // (reported to torch's profiler as allocations of this thread, each freed with the last
      // view of it: the memory a rank's tensors take, counted as the allocator's are)
      char* half = block->mine() + h * bytes;
      c10::reportMemoryUsageToProfiler(half, bytes, 0, 0, c10::Device(c10::kCPU));
      c.block_flats[h] = at::from_blob(
          half, {count},
          [block, bytes](void* p) {
            c10::reportMemoryUsageToProfiler(p, -bytes, 0, 0, c10::Device(c10::kCPU));
          },
          at::TensorOptions().dtype(dtype));
    }
    c.block_at = at;
    c.block_copy = copy;
    for (size_t i = 0; i < c.makers.size(); ++i) {
      if (copy[i]) continue;
      Step& m = *steps_[c.makers[i]];
      m.bucket_comm = k;
      m.bucket_at = at[i];
    }
  }

  void run_comm(int64_t k, CommStep& c, std::vector<c10::IValue>& values,
                std::unordered_map<int64_t, std::shared_ptr<Pending>>& pending, bool failed,
                const c10::Device& device) {
    auto options = at::TensorOptions().dtype(c.dtype).device(device);
    auto value = [&](size_t i) -> at::Tensor {
      int64_t slot = i < c.args.size() ? c.args[i] : -1;
      if (!failed && slot >= 0 && values.at(slot).isTensor()) return values.at(slot).toTensor();
      std::vector<int64_t> shape = i < c.shapes.size() ? c.shapes[i] : std::vector<int64_t>{};
      return at::zeros(shape, options);
    };
    const std::string& op = c.op;
    if (op == "shard_local") {
      values.at(c.outs.at(0)) = part_of(value(0), c.dim, c.index, c.size).contiguous();
      return;
    }
    if (op == "partial_local") {
      at::Tensor v = value(0);
      values.at(c.outs.at(0)) = c.reduce != "sum" || c.index == 0 ? v : at::zeros_like(v);
      return;
    }
    if (op == "send") {
      at::Tensor v = value(0).contiguous();
      c.comm->send(v, c.peer, 0);
      return;
    }
    if (op == "recv") {
      at::Tensor buf = at::empty(c.shapes.at(0), options);
      c.comm->recv(buf, c.peer, 0);
      values.at(c.outs.at(0)) = buf;
      return;
    }
    const int64_t n = c.size;
    std::function<void()> finish;
    if (op == "all_reduce") {
      std::vector<at::Tensor> tensors;
      for (size_t i = 0; i < c.args.size(); ++i) tensors.push_back(value(i));
      if (++c.runs_seen == 2) {
        set_up_block(k, c, tensors, failed);
        // (their shapes were for the setup: no more recording them at every run)
        for (auto m : c.makers)
          if (m >= 0) steps_[m]->feeds_bucket = false;
      }
      bool shared = false;
      if (c.block) {
        const at::Tensor& flat = c.block_flats[c.block_half];
        const bool ready = !failed && block_ready(c, tensors);
        if (ready) {  // (the half is this run's: copy the others in before peers read it)
          for (size_t i = 0; i < tensors.size(); ++i) {
            if (!c.block_copy[i]) continue;
            at::Tensor place = flat.narrow(0, c.block_at[i], tensors[i].numel());
            place.copy_(tensors[i].reshape({-1}));
            tensors[i] = place.view(tensors[i].sizes());
          }
        }
        const size_t half = static_cast<size_t>(c.block_half * flat.numel() * flat.element_size());
        shared = c.comm->all_reduce_shared(*c.block, half, flat.numel(), flat.scalar_type(),
                                           c.reduce, ready);
      }
      if (shared) {
        ++reduced_in_place_;
        ++reduced_shared_;
        finish = [&values, outs = c.outs, tensors]() {
          for (size_t i = 0; i < outs.size(); ++i) values.at(outs[i]) = tensors[i];
        };
      } else if (!failed && reduces_in_place(c, tensors)) {
        // (each as the 1-d run of its storage: contiguous, whatever its layout)
        std::vector<at::Tensor> flat;
        for (const auto& t : tensors) flat.push_back(t.as_strided({t.numel()}, {1}, 0));
        md::Finish reduced = md::all_reduce_pieces(*c.comm, std::move(flat), c.reduce, n);
        ++reduced_in_place_;
        c.buffers = {};  // (a run that could not left them: none is needed any more)
        finish = [&values, outs = c.outs, tensors, reduced]() {
          reduced();
          for (size_t i = 0; i < outs.size(); ++i) values.at(outs[i]) = tensors[i];
        };
      } else {
        // One result buffer (the bucket's flat tensor), filled by the all-reduce from the
        // tensors where they are (shared memory reads them directly). A tensor that covers its
        // storage densely goes in as that storage's run, as reduces_in_place takes it: a rank
        // that could not reduce in place lays the bucket out as its peers that could.
        bool one_dtype = true;
        int64_t numel = 0;
        std::vector<at::Tensor> pieces;
        std::vector<bool> as_stored;
        for (auto& t : tensors) {
          one_dtype = one_dtype && t.scalar_type() == tensors[0].scalar_type();
          numel += t.numel();
          as_stored.push_back(covers_storage(t));
          pieces.push_back(as_stored.back() ? t.as_strided({t.numel()}, {1}, 0)
                                            : t.contiguous().view({-1}));
        }
        md::Finish reduced;
        if (one_dtype && !tensors.empty()) {
          at::Tensor flat = result_buffer(c, {numel}, tensors[0].options());
          reduced = md::all_reduce_into(*c.comm, flat, std::move(pieces), c.reduce, n);
        } else {  // (cat's type promotion)
          for (auto& p : pieces) p = p.reshape(-1);
          reduced = md::all_reduce(*c.comm, at::cat(pieces), c.reduce, n);
        }
        finish = [&values, outs = c.outs, tensors, as_stored, reduced]() {
          at::Tensor flat = reduced();
          int64_t offset = 0;
          for (size_t i = 0; i < outs.size() && i < tensors.size(); ++i) {
            const at::Tensor& t = tensors[i];
            values.at(outs[i]) = as_stored[i] ? flat.as_strided(t.sizes(), t.strides(), offset)
                                              : flat.narrow(0, offset, t.numel()).view(t.sizes());
            offset += t.numel();
          }
        };
      }
    } else {
      at::Tensor x = value(0);
      md::Finish result;
      if (op == "all_gather") {
        result = md::all_gather(*c.comm, x, n, c.dim, /*stack=*/false);
      } else if (op == "reduce_scatter") {
        result = md::reduce_scatter(*c.comm, x, c.reduce, c.index, n, c.dim);
      } else if (op == "all_to_all") {
        result = md::all_to_all(*c.comm, x, n, c.split_dim, c.cat_dim);
      } else {
        throw std::runtime_error("unknown communication " + op);
      }
      finish = [&values, slot = c.outs.at(0), result]() { values.at(slot) = result(); };
    }
    if (!c.async) {
      finish();
      return;
    }
    auto p = std::make_shared<Pending>(Pending{std::move(finish)});
    for (auto slot : c.outs) pending[slot] = p;
  }

  std::vector<std::optional<CommStep>> comms_;
  std::vector<std::vector<int64_t>> uses_;
  std::vector<std::optional<Step>> steps_;
  std::string last_error_;
  std::mutex lock_;
  std::shared_ptr<md::Comm> agree_;  // set_agree's group (none: no flag)
  at::Tensor flag_;                  // its flag, kept between runs
  double agree_cpu_ = 0;

  bool trace_ = false;
  std::vector<std::tuple<int64_t, int, double, double>> trace_events_;

  static double monotonic_seconds() {
    timespec t{};
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  static double thread_cpu_seconds() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  int64_t reused_ = 0;    // steps of the last run that wrote a buffer of the run before
  int64_t in_place_ = 0;  // of those, steps that wrote their argument (relu as relu_)
  int64_t reduced_in_place_ = 0;
  int64_t reduced_shared_ = 0;
  uint64_t runs_ = 0;  // run_plan calls (CommStep::block_run)
  bool keep_ = true;   // whether this run keeps result buffers (not a plan's first run_plan)
  std::unordered_map<int64_t, int64_t> producer_;  // slot -> the compute step that wrote it
};

}  // namespace

void bind_program(py::module& m) {
  py::class_<Env>(m, "Env")
      .def(py::init<int64_t>())
      .def("set", &Env::set)
      .def("__setitem__", &Env::set)
      .def("__getitem__", &Env::get)
      .def("set_none", &Env::set_none)
      .def("set_many", &Env::set_many)
      .def("set_part", &Env::set_part)
      .def("get", &Env::get)
      .def("has", &Env::has)
      .def("__len__", &Env::size);
  py::class_<CompiledPlan>(m, "CompiledPlan")
      .def(py::init<const py::list&, py::handle>())
      .def("run", &CompiledPlan::run)
      .def("last_error", &CompiledPlan::last_error)
      .def("reused", &CompiledPlan::reused)
      .def("in_place", &CompiledPlan::in_place)
      .def("reduced_in_place", &CompiledPlan::reduced_in_place)
      .def("reduced_shared", &CompiledPlan::reduced_shared)
      .def("set_comm", &CompiledPlan::set_comm, py::arg("k"), py::arg("step"), py::kw_only(),
           py::arg("group"), py::arg("index"), py::arg("size"), py::arg("peer"),
           py::arg("async_"), py::arg("slot_type"))
      .def("set_uses", &CompiledPlan::set_uses)
      .def("set_agree", &CompiledPlan::set_agree)
      .def("last_agree_cpu", &CompiledPlan::last_agree_cpu)
      .def("set_trace", &CompiledPlan::set_trace)
      .def("last_trace", &CompiledPlan::last_trace)
      .def_readonly_static("OTHER_FAILED", &CompiledPlan::kOtherFailed)
      .def("has_comms", &CompiledPlan::has_comms)
      .def(
          "run_plan",
          [](CompiledPlan& p, Env& env, py::handle device, bool inputs_failed) {
            return p.run_plan(
                env, torch::jit::toIValue(device, c10::DeviceObjType::get()).toDevice(),
                inputs_failed);
          },
          py::arg("env"), py::arg("device"), py::arg("inputs_failed") = false)
      .def("__len__", &CompiledPlan::size);
}
