// The worker's executor of eager instructions: events for borrows, collectives and copies
// between meshes, and aten ops called through the dispatcher without the GIL. The ref table is
// refs.h; the stream threads that run the instructions are streams.h.
//
// runtime/core_executor.py feeds it. Ops, deletes and borrows run here; every other
// instruction (collectives, transfers, fetches, remote functions, plans) is a Python callable
// that the stream's thread runs under the GIL, in its place in the stream's order, working on
// the same ref table through the mapping interface below.
//
// A ref holds a value or a failure (the root cause: rank, controller line, op, error). An op
// with a failed input is not run: its outputs take that failure. An op that raises gets a new
// root failure, reported to Python once.
//
// Locking: the ref table's lock is never held while taking the GIL or while a value is
// destroyed (refs.h), so Python threads that wait for it cannot deadlock with stream threads.

#include "boxed.h"
#include "collectives.h"
#include "comm.h"
#include "refs.h"
#include "streams.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Dtype.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>

namespace py = pybind11;

namespace {

using md::exec::Entry;
using md::exec::Failure;
using md::exec::FailurePtr;

enum class Kind { Op, Reduce, Transfer, Delete, Signal, Wait, BorrowBegin, BorrowEnd, Python, Barrier };

struct OpCall {
  md::BoxedCall call;
  std::vector<int64_t> outs;  // -1: a tensor output nobody holds
  std::string line;
};

// A collective over a slice of mesh dims (isa.Reduce): `group` names the group, whose getter
// Python registered (set_group).
struct ReduceCall {
  std::string group;
  int64_t src, out;
  std::string reduction;  // sum avg min max prod stack
  bool scatter;
  std::vector<int64_t> shape;  // of the input: placeholders of failed inputs
  at::ScalarType dtype;
  std::string line, what, what_error;  // what: "reduce over ('gpu',)", as Python names it
};

// A copy between meshes (isa.Transfer): this rank sends `src` to, or receives `out` from, the
// other rank of each pair it is in, through the pair's group (`groups`, one per pair).
struct TransferCall {
  int64_t src, out;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (sender, receiver) ranks
  std::vector<std::string> groups;                 // "" where this rank is not in the pair
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  std::string line;
};

struct Item {
  Kind kind;
  std::shared_ptr<OpCall> op;
  std::shared_ptr<ReduceCall> reduce;
  std::shared_ptr<TransferCall> transfer;
  std::vector<int64_t> refs;  // Delete
  int64_t event = 0, src = 0, dst = 0;
  PyObject* fn = nullptr;  // Python / Barrier: a callable (owned; released under the GIL)
  std::shared_ptr<std::atomic<int64_t>> counter;  // Barrier: streams still to arrive
};

class Executor {
 public:
  Executor(int64_t rank, py::object ref_type, py::object device_sentinel, py::object device,
           py::object failure_type, py::object report)
      : rank_(rank),
        ref_type_(std::move(ref_type)),
        device_sentinel_(std::move(device_sentinel)),
        device_(torch::jit::toIValue(device, c10::DeviceObjType::get())),
        failure_type_(std::move(failure_type)),
        report_(std::move(report)),
        streams_(device_.toDevice(), [this](Item& item) { run(item); }) {}

  ~Executor() { close(); }

  // ---- the ref table, as a mapping (Python handlers use it like the reference's dict) ----
  py::object get(int64_t ref, py::object missing) {
    auto e = refs_.lookup(ref);
    return e ? to_python(*e) : missing;
  }

  // [get(r) for r in refs], in one call, read at one point in time (a compiled step's inputs).
  py::list get_many(const std::vector<int64_t>& refs) {
    std::vector<std::optional<Entry>> got(refs.size());
    refs_.locked([&](auto find) {
      for (size_t k = 0; k < refs.size(); ++k)
        if (const Entry* e = find(refs[k])) got[k] = *e;
    });
    py::list out(refs.size());
    for (size_t k = 0; k < refs.size(); ++k)
      out[k] = got[k] ? to_python(*got[k]) : py::none();
    return out;
  }

  py::object getitem(int64_t ref) {
    auto e = refs_.lookup(ref);
    if (!e) throw py::key_error(std::to_string(ref));
    return to_python(*e);
  }

  void set(int64_t ref, py::handle value) {
    refs_.store(ref, md::exec::from_python(value, failure_type_));
  }

  py::object pop(int64_t ref, py::object missing) {
    auto e = refs_.take(ref);
    return e ? to_python(*e) : missing;
  }

  bool contains(int64_t ref) { return refs_.contains(ref); }

  size_t size() { return refs_.size(); }

  std::vector<int64_t> keys() { return refs_.keys(); }

  // ---- instructions, queued on a stream (called with the GIL) ----------------------------
  // Prepare an op call: raises if it cannot be called from C++ (the caller runs it in
  // Python instead).
  void call_op(const std::string& stream, const std::string& op, const py::tuple& args,
               const py::dict& kwargs, std::vector<int64_t> outs, std::string line) {
    push(stream, op_item(op, args, kwargs, std::move(outs), std::move(line)));
  }

  // Where isa.CallOp (a named tuple) keeps each field: read from its `_fields` once, so a
  // field added or moved there is found by name here (a missing one is an error, not a
  // silent fall back to Python).
  struct CallOpFields {
    int op, args, kwargs, outs, stream, loc;
  };
  const CallOpFields& callop_fields(py::handle callop_type) {
    if (!callop_fields_) {
      auto names = callop_type.attr("_fields").cast<std::vector<std::string>>();
      auto index = [&](const char* name) {
        auto it = std::find(names.begin(), names.end(), name);
        if (it == names.end())
          throw py::type_error(std::string("run_batch: isa.CallOp has no field ") + name);
        return static_cast<int>(it - names.begin());
      };
      callop_fields_ = CallOpFields{index("op"),  index("args"),   index("kwargs"),
                                    index("outs"), index("stream"), index("loc")};
    }
    return *callop_fields_;
  }

  // A message's (mesh, instruction) pairs, in order: those of meshes this rank is not in
  // (`member[mesh]` false or missing; mesh < 0: every rank) are skipped; eager ops
  // (`callop_type`, isa.CallOp, its fields found by name) are prepared here and queued with
  // one lock and one wake-up per stream for a run of them; every other instruction, and an op
  // C++ cannot prepare, goes to `other(mesh, instruction)` in its place (what that queues comes
  // after the ops before it).
  void run_batch(const py::tuple& items, const py::dict& member, py::handle callop_type,
                 const py::function& other) {
    constexpr size_t kFlushEvery = 64;  // ops: the streams start on a long batch early
    std::vector<std::pair<Stream*, std::vector<Item>>> pending;
    size_t held = 0;
    auto flush = [&] {
      for (auto& [stream, queued] : pending) Streams::enqueue(*stream, queued);
      held = 0;
    };
    auto* callop = reinterpret_cast<PyTypeObject*>(callop_type.ptr());
    for (auto entry : items) {
      PyObject* pair = entry.ptr();
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
        throw py::type_error("run_batch: items are (mesh, instruction) pairs");
      PyObject* mesh = PyTuple_GET_ITEM(pair, 0);
      PyObject* ins = PyTuple_GET_ITEM(pair, 1);
      if (PyLong_AsLongLong(mesh) >= 0) {
        PyObject* in = PyDict_GetItemWithError(member.ptr(), mesh);
        if (!in) {
          if (PyErr_Occurred()) throw py::error_already_set();
          continue;
        }
        int yes = PyObject_IsTrue(in);
        if (yes < 0) throw py::error_already_set();
        if (!yes) continue;
      }
      if (Py_TYPE(ins) == callop) {
        const auto& at = callop_fields(callop_type);
        std::optional<Item> item;
        std::string stream;
        try {
          auto field = [&](int i) { return py::handle(PyTuple_GET_ITEM(ins, i)); };
          stream = field(at.stream).cast<std::string>();
          std::vector<int64_t> outs;
          for (auto o : py::reinterpret_borrow<py::tuple>(field(at.outs)))
            outs.push_back(o.is_none() ? -1 : o.cast<int64_t>());
          item = op_item(field(at.op).cast<std::string>(),
                         py::reinterpret_borrow<py::tuple>(field(at.args)),
                         py::reinterpret_borrow<py::dict>(field(at.kwargs)), std::move(outs),
                         field(at.loc).cast<std::string>());
        } catch (const std::exception&) {  // (py::error_already_set too: a mesh coordinate...)
        }
        if (item) {
          Stream* s = streams_.named(stream);
          auto it = std::find_if(pending.begin(), pending.end(),
                                 [&](const auto& p) { return p.first == s; });
          if (it == pending.end()) it = pending.insert(pending.end(), {s, {}});
          it->second.push_back(std::move(*item));
          if (++held >= kFlushEvery) flush();
          continue;
        }
      }
      flush();
      other(py::handle(mesh), py::handle(ins));
    }
    flush();
  }

  // `get()` (called once, under the GIL, on the stream thread of the first collective that
  // uses it) returns (process group, this rank's index in it, its size).
  void set_group(const std::string& key, py::function get) {
    std::lock_guard<std::mutex> g(groups_lock_);
    getters_[key] = std::move(get);
  }

  // isa.Reduce `ins` (read by field name: stream, src, out, reduction, scatter, shape, dtype,
  // loc) over the process group named `group` (set_group); `what` / `what_error` name it in a
  // failure's op and in the error of a rank whose peer's input failed.
  void reduce(py::handle ins, const std::string& group, std::string what,
              std::string what_error) {
    Item item{Kind::Reduce};
    item.reduce = std::make_shared<ReduceCall>(ReduceCall{
        group, ins.attr("src").cast<int64_t>(), ins.attr("out").cast<int64_t>(),
        ins.attr("reduction").cast<std::string>(), ins.attr("scatter").cast<bool>(),
        ins.attr("shape").cast<std::vector<int64_t>>(), md::dtype_named(ins.attr("dtype")),
        ins.attr("loc").cast<std::string>(), std::move(what), std::move(what_error)});
    push(ins.attr("stream").cast<std::string>(), std::move(item));
  }

  // isa.Transfer `ins` (read by field name: stream, src, out, pairs, shape, dtype, loc); per
  // pair, the process group named `groups[i]` ("" for a pair this rank is not in).
  void transfer(py::handle ins, std::vector<std::string> groups) {
    Item item{Kind::Transfer};
    item.transfer = std::make_shared<TransferCall>(TransferCall{
        ins.attr("src").cast<int64_t>(), ins.attr("out").cast<int64_t>(),
        ins.attr("pairs").cast<std::vector<std::pair<int64_t, int64_t>>>(), std::move(groups),
        ins.attr("shape").cast<std::vector<int64_t>>(), md::dtype_named(ins.attr("dtype")),
        ins.attr("loc").cast<std::string>()});
    push(ins.attr("stream").cast<std::string>(), std::move(item));
  }

  void delete_refs(const std::string& stream, std::vector<int64_t> refs) {
    Item item{Kind::Delete};
    item.refs = std::move(refs);
    push(stream, std::move(item));
  }

  void signal(const std::string& stream, int64_t event) {
    Item item{Kind::Signal};
    item.event = event;
    push(stream, std::move(item));
  }

  void wait(const std::string& stream, int64_t event) {
    Item item{Kind::Wait};
    item.event = event;
    push(stream, std::move(item));
  }

  void borrow_begin(const std::string& stream, int64_t event, int64_t src, int64_t dst) {
    Item item{Kind::BorrowBegin};
    item.event = event;
    item.src = src;
    item.dst = dst;
    push(stream, std::move(item));
  }

  void borrow_end(const std::string& stream, int64_t event, int64_t dst) {
    Item item{Kind::BorrowEnd};
    item.event = event;
    item.dst = dst;
    push(stream, std::move(item));
  }

  void python(const std::string& stream, const py::function& fn) {
    Item item{Kind::Python};
    item.fn = fn.inc_ref().ptr();
    push(stream, std::move(item));
  }

  // `done()` runs (under the GIL) once every stream has run what it was given before.
  void barrier(const py::function& done) {
    std::vector<Stream*> all = streams_.all();
    if (all.empty()) {
      done();
      return;
    }
    auto left = std::make_shared<std::atomic<int64_t>>(static_cast<int64_t>(all.size()));
    for (auto* s : all) {
      Item item{Kind::Barrier};
      item.fn = done.inc_ref().ptr();  // each arrival releases one reference
      item.counter = left;
      Streams::enqueue(*s, std::move(item));
    }
  }

  std::vector<std::string> streams() { return streams_.names(); }

  // Stop the stream threads after what they were given (called with the GIL; releases it).
  void close() {
    {
      py::gil_scoped_release nogil;
      streams_.close();
    }
    refs_.clear();
    std::lock_guard<std::mutex> g(groups_lock_);
    groups_.clear();
    getters_.clear();
  }

 private:
  std::optional<CallOpFields> callop_fields_;  // (callop_fields)
  using Streams = md::exec::Streams<Item>;
  using Stream = Streams::Stream;

  // An eager op, prepared (raises for what the dispatcher cannot take).
  Item op_item(const std::string& op, const py::tuple& args, const py::dict& kwargs,
               std::vector<int64_t> outs, std::string line) {
    return Item{Kind::Op, std::make_shared<OpCall>(
                              OpCall{prepare(op, args, kwargs), std::move(outs), std::move(line)})};
  }

  md::BoxedCall prepare(const std::string& op, const py::tuple& args, const py::dict& kwargs) {
    auto sep = op.find("::");
    auto dot = op.find('.', sep == std::string::npos ? 0 : sep + 2);
    std::string qualified = dot == std::string::npos ? op : op.substr(0, dot);
    std::string overload = dot == std::string::npos ? "default" : op.substr(dot + 1);
    auto handle = md::find_op(qualified, overload);
    auto ref_of = [this](py::handle obj) -> int64_t {
      if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(ref_type_.ptr())) return -1;
      return PyLong_AsLongLong(PyTuple_GET_ITEM(obj.ptr(), 0));
    };
    auto special = [this](py::handle obj) -> std::optional<c10::IValue> {
      if (obj.ptr() == device_sentinel_.ptr()) return device_;
      return std::nullopt;
    };
    return md::make_call(handle, op, args, kwargs, ref_of, special);
  }

  py::object to_python(const Entry& e) { return md::exec::to_python(e, failure_type_); }

  void push(const std::string& name, Item item) { streams_.push(name, std::move(item)); }

  void run(Item& item) {
    switch (item.kind) {
      case Kind::Op:
        run_op(*item.op);
        break;
      case Kind::Reduce:
        run_reduce(*item.reduce);
        break;
      case Kind::Transfer:
        run_transfer(*item.transfer);
        break;
      case Kind::Delete:
        for (auto r : item.refs) refs_.take(r);
        break;
      case Kind::Signal:
        set_event(item.event);
        break;
      case Kind::Wait:
        wait_event(item.event);
        break;
      case Kind::BorrowBegin:
        wait_event(item.event);  // the origin stream got here: the value is ready
        if (auto e = refs_.lookup(item.src)) refs_.store(item.dst, std::move(*e));
        break;
      case Kind::BorrowEnd:
        refs_.take(item.dst);
        set_event(item.event);
        break;
      case Kind::Python: {
        py::gil_scoped_acquire gil;
        md::exec::keep_python_thread_state();
        auto fn = py::reinterpret_steal<py::object>(item.fn);
        item.fn = nullptr;
        run_python_step(fn, "monarch_dsl executor: internal error in a Python step:\n");
        break;
      }
      case Kind::Barrier: {
        bool last = item.counter->fetch_sub(1) == 1;
        py::gil_scoped_acquire gil;
        md::exec::keep_python_thread_state();
        auto fn = py::reinterpret_steal<py::object>(item.fn);
        item.fn = nullptr;
        if (last) run_python_step(fn, "");
        break;
      }
    }
  }

  // Runs a Python step (under the GIL); what it lets out is said on stderr. A MemoryError at
  // a worker's budget's last pages can come before the step's own code runs (its frame), and
  // its caller may be waiting for its answer (a fetch: the controller hung): the step runs once
  // more with kStepRoom more, the runtime's own room (as runtime/memory.py's grace()).
  static void run_python_step(const py::object& fn, const char* what) {
    constexpr size_t kStepRoom = size_t{16} << 20;  // runtime/memory.py's GRACE
    auto say = [what](py::error_already_set& err) {
      if (*what) PySys_WriteStderr("%s", what);
      err.restore();
      PyErr_Print();
    };
    try {
      fn();
    } catch (py::error_already_set& e) {
      std::optional<rlim_t> before;
      if (!e.matches(PyExc_MemoryError) || !(before = md::exec::grow_data_limit(kStepRoom))) {
        say(e);
        return;
      }
      try {
        fn();
      } catch (py::error_already_set& again) {
        say(again);
      }
      md::exec::set_data_limit(*before);
    }
  }

  void run_op(OpCall& op) {
    // The inputs, or the failure of one of them.
    FailurePtr failed, root;
    torch::jit::Stack stack;
    refs_.locked([&](auto find) {
      for (const auto& p : op.call.patches) {
        for (auto k : p.keys) {
          const Entry* e = find(k);
          if (!e) {
            failed = std::make_shared<Failure>(Failure{
                rank_, op.line, op.call.name, "internal error: no value for %" + std::to_string(k),
                ""});
          } else if (e->failure) {
            failed = e->failure;
          }
          if (failed) break;
        }
        if (failed) break;
      }
      if (!failed) {
        try {  // a held value of the wrong kind for its argument (None in a Tensor[])
          md::fill_stack(op.call, stack, [&](int64_t k) -> const c10::IValue& {
            return find(k)->value;
          });
        } catch (const std::exception& e) {
          root = failure_of(e, op.line, op.call.name);
        }
      }
    });
    if (root) {
      fail(op.outs, root, true);
      return;
    }
    if (failed) {
      fail(op.outs, failed, false);
      return;
    }
    try {
      op.call.op.callBoxed(&stack);
    } catch (const std::exception& e) {
      stack.clear();
      fail(op.outs, failure_of(e, op.line, op.call.name), true);
      return;
    }
    // The tensor results in order (a list return spreads), as the reference's pytree leaves
    // are: an undefined tensor is None there (convolution_backward's ungrad input), and a
    // wrapped number a Python number, so neither takes an output ref.
    std::vector<c10::IValue> tensors;
    auto is_result = [](const c10::IValue& x) {
      return x.isTensor() && x.toTensor().defined() &&
             !x.toTensor().unsafeGetTensorImpl()->is_wrapped_number();
    };
    for (auto& v : stack) {
      if (is_result(v)) {
        tensors.push_back(std::move(v));
      } else if (v.isList()) {
        for (const auto& x : v.toListRef())
          if (is_result(x)) tensors.push_back(x);
      }
    }
    for (size_t i = 0; i < op.outs.size() && i < tensors.size(); ++i)
      if (op.outs[i] >= 0) refs_.store(op.outs[i], Entry{std::move(tensors[i]), nullptr});
    stack.clear();
  }

  struct Group {
    std::shared_ptr<md::Comm> comm;
    int64_t index, size;
  };

  // The group `key`, made on first use by its Python getter. No lock is held while the GIL is
  // taken (a Python thread holding the GIL may be waiting in set_group for the lock).
  Group& group(const std::string& key) {
    {
      std::lock_guard<std::mutex> g(groups_lock_);
      auto it = groups_.find(key);
      if (it != groups_.end()) return it->second;
    }
    py::gil_scoped_acquire gil;
    py::function getter;
    {
      std::lock_guard<std::mutex> g(groups_lock_);
      auto it = getters_.find(key);
      if (it == getters_.end()) throw std::runtime_error("no process group named " + key);
      getter = it->second;
    }
    auto t = getter().cast<py::tuple>();  // a rendezvous of the group's members
    Group made{md::comm_of(t[0]), t[1].cast<int64_t>(), t[2].cast<int64_t>()};
    std::lock_guard<std::mutex> g(groups_lock_);
    return groups_.emplace(key, std::move(made)).first->second;  // (one thread per stream)
  }

  // isa.Reduce, as the reference executor's reduce() does it: every rank of the group takes
  // part even when its input failed (with zeros), after a flag all-reduce tells all of them
  // whether any input failed -- then every rank's result is failed, none hangs.
  void run_reduce(ReduceCall& r) {
    Entry in = refs_.lookup(r.src).value_or(Entry{});
    FailurePtr failed = in.failure;
    const bool own_failed = failed != nullptr;
    at::Tensor result;
    try {
      if (!own_failed && !in.value.isTensor())
        throw std::runtime_error("internal error: no value for %" + std::to_string(r.src));
      if (!own_failed && in.value.toTensor().device() != device_.toDevice()) {
        // (a remote function's CPU tensor on a GPU worker): this rank alone would fail in the
        // collective while the others wait in it; it is a failed input instead.
        failed = std::make_shared<Failure>(Failure{
            rank_, r.line, r.what_error,
            "RuntimeError: the input is on " + in.value.toTensor().device().str() +
                ", not on this worker's device",
            ""});
      }
      Group& grp = group(r.group);
      auto options = at::TensorOptions().device(device_.toDevice());
      at::Tensor flag = at::full({1}, failed ? 1 : 0, options.dtype(at::kInt));
      grp.comm->all_reduce(flag, "max");
      if (!failed && flag.item<int>() != 0) {
        failed = std::make_shared<Failure>(Failure{
            rank_, r.line, r.what, "the input of another rank of the group had failed", ""});
      }
      at::Tensor src = failed ? at::zeros(r.shape, options.dtype(r.dtype)) : in.value.toTensor();
      const bool in_place = r.out == r.src && !failed;
      result = collective(grp, src, r, in_place);
      if (failed && !own_failed) report(failed);  // this rank's input was fine: a root cause
    } catch (const std::exception& e) {
      fail({r.out}, failure_of(e, r.line, r.what_error), true);
      return;
    }
    if (failed) {
      fail({r.out}, failed, false);
      return;
    }
    if (r.out == r.src) {
      at::Tensor src = in.value.toTensor();
      if (!result.is_same(src)) src.copy_(result);
      return;
    }
    refs_.store(r.out, Entry{result, nullptr});
  }

  // isa.Transfer, as the reference executor's transfer(): a sender sends a flag (1: a value,
  // 0: its source had failed) and the value (zeros after a failure), so a receiver fails with
  // it instead of hanging or using zeros. Every send is started before the first receive.
  void run_transfer(TransferCall& t) {
    Entry in = refs_.lookup(t.src).value_or(Entry{});
    auto options = at::TensorOptions().device(device_.toDevice());
    std::optional<Entry> local;        // a pair of this rank with itself: a copy
    at::Tensor flag_in, value_in;      // what this rank receives
    std::vector<md::Wait> waits;
    try {
      std::vector<std::pair<std::shared_ptr<md::Comm>, int64_t>> receives;
      for (size_t i = 0; i < t.pairs.size(); ++i) {
        auto [a, b] = t.pairs[i];
        if (a == rank_ && b == rank_) {
          // contiguous, as a received copy is (the controller describes it so)
          local = in.failure ? in
                             : Entry{in.value.toTensor().detach().clone(at::MemoryFormat::Contiguous),
                                     nullptr};
          continue;
        }
        if (a != rank_ && b != rank_) continue;
        Group& grp = group(t.groups.at(i));
        const int64_t peer = 1 - grp.index;  // a pair's group: members sorted by rank
        if (a == rank_) {
          const bool ok = !in.failure;
          if (ok && !in.value.isTensor())
            throw std::runtime_error("internal error: no value for %" + std::to_string(t.src));
          at::Tensor flag = at::full({1}, ok ? 1 : 0, options.dtype(at::kLong));
          at::Tensor value = ok ? in.value.toTensor().detach().contiguous()
                                : at::zeros(t.shape, options.dtype(t.dtype));
          waits.push_back(keep(grp.comm->start_send(flag, peer, 0), flag));
          waits.push_back(keep(grp.comm->start_send(value, peer, 1), value));
        } else {
          receives.emplace_back(grp.comm, peer);
        }
      }
      for (auto& [comm, peer] : receives) {  // (one sender per receiver)
        flag_in = at::zeros({1}, options.dtype(at::kLong));
        value_in = at::empty(t.shape, options.dtype(t.dtype));
        waits.push_back(keep(comm->start_recv(flag_in, peer, 0), flag_in));
        waits.push_back(keep(comm->start_recv(value_in, peer, 1), value_in));
      }
      for (auto& w : waits)
        if (w) w();
    } catch (const std::exception& e) {
      for (auto& w : waits) {  // what was started finishes before its tensors go
        try {
          if (w) w();
        } catch (const std::exception&) {
        }
      }
      fail({t.out}, failure_of(e, t.line, "to_mesh"), true);
      return;
    }
    Entry result;
    if (flag_in.defined()) {
      if (flag_in.item<int64_t>() != 1) {
        fail({t.out}, std::make_shared<Failure>(Failure{rank_, t.line, "to_mesh",
                                                        "the source value had failed", ""}),
             false);
        return;
      }
      result = Entry{value_in, nullptr};
    } else if (local) {
      result = *local;
    } else {
      return;  // a sender only
    }
    refs_.store(t.out, std::move(result));
  }

  // A wait that keeps `t` alive until it has returned.
  static md::Wait keep(md::Wait wait, at::Tensor t) {
    if (!wait) return {};
    return [wait = std::move(wait), t = std::move(t)] { wait(); };
  }

  // The collective's result (collectives.h); an in-place all-reduce of a contiguous tensor
  // works on `src` itself (at 64 MiB two copies halved the bandwidth).
  static at::Tensor collective(Group& grp, const at::Tensor& src, const ReduceCall& r,
                               bool in_place) {
    md::Comm& comm = *grp.comm;
    if (r.reduction == "stack") {
      if (r.scatter) return md::all_to_all(comm, src, grp.size, 0, 0)();  // piece i to rank i
      return md::all_gather(comm, src, grp.size, 0, /*stack=*/true)();
    }
    if (r.scatter) return md::reduce_scatter(comm, src, r.reduction, grp.index, grp.size, 0)();
    if (in_place && src.is_contiguous()) return md::all_reduce(comm, src, r.reduction, grp.size)();
    return md::all_reduce(comm, src.clone(at::MemoryFormat::Contiguous), r.reduction, grp.size)();
  }

  // A root failure of this rank at controller line `line`, in `op`, raised as `e`: named as
  // Python would name it ("ValueError: ..." for an exception raised by Python code).
  FailurePtr failure_of(const std::exception& e, const std::string& line, const std::string& op) {
    std::string text;
    if (auto py_error = dynamic_cast<const py::error_already_set*>(&e)) {
      py::gil_scoped_acquire gil;
      text = py::handle(py_error->type()).attr("__name__").cast<std::string>() + ": " +
             py::str(py_error->value()).cast<std::string>();
    } else {
      text = md::error_type(e) + ": " + md::error_text(e);
    }
    return std::make_shared<Failure>(Failure{rank_, line, op, std::move(text), ""});
  }

  void report(const FailurePtr& f) {
    py::gil_scoped_acquire gil;
    try {
      report_(to_python(Entry{c10::IValue(), f}));
    } catch (py::error_already_set& e) {
      e.restore();
      PyErr_Print();
    }
  }

  void fail(const std::vector<int64_t>& outs, const FailurePtr& f, bool root) {
    for (auto r : outs)
      if (r >= 0) refs_.store(r, Entry{c10::IValue(), f});
    if (root) report(f);
  }

  // Events order streams: the host thread waits for the flag; on CUDA the waiting stream
  // also waits on the GPU for the work the signalling stream had issued.
  void set_event(int64_t event) {
    std::optional<c10::Event> gpu;
    if (device_.toDevice().is_cuda()) {
      c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
      gpu.emplace(c10::DeviceType::CUDA);
      gpu->record(cuda.getStream(device_.toDevice()));
    }
    {
      std::lock_guard<std::mutex> g(events_lock_);
      auto& e = events_[event];
      e.set = true;
      e.gpu = std::move(gpu);
    }
    events_cv_.notify_all();
  }

  void wait_event(int64_t event) {
    std::optional<c10::Event> gpu;
    {
      std::unique_lock<std::mutex> g(events_lock_);
      events_cv_.wait(g, [&] { return events_[event].set; });
      gpu = std::move(events_[event].gpu);
      events_.erase(event);
    }
    if (gpu) {
      c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
      gpu->block(cuda.getStream(device_.toDevice()));
    }
  }

  struct EventState {
    bool set = false;
    std::optional<c10::Event> gpu;
  };

  int64_t rank_;
  py::object ref_type_, device_sentinel_;
  c10::IValue device_;
  py::object failure_type_, report_;

  md::exec::RefTable refs_;

  std::mutex groups_lock_;
  std::unordered_map<std::string, py::function> getters_;
  std::unordered_map<std::string, Group> groups_;

  std::mutex events_lock_;
  std::condition_variable events_cv_;
  std::unordered_map<int64_t, EventState> events_;

  Streams streams_;  // last: its threads stop (close()) before the rest goes
};

}  // namespace

void bind_executor(py::module& m) {
  py::class_<Executor>(m, "Executor")
      .def(py::init<int64_t, py::object, py::object, py::object, py::object, py::object>(),
           py::arg("rank"), py::arg("ref_type"), py::arg("device_sentinel"), py::arg("device"),
           py::arg("failure_type"), py::arg("report"))
      .def("get", &Executor::get, py::arg("ref"), py::arg("default") = py::none())
      .def("get_many", &Executor::get_many)
      .def("__getitem__", &Executor::getitem)
      .def("__setitem__", &Executor::set)
      .def("pop", &Executor::pop, py::arg("ref"), py::arg("default") = py::none())
      .def("__contains__", &Executor::contains)
      .def("__len__", &Executor::size)
      .def("keys", &Executor::keys)
      .def("call_op", &Executor::call_op)
      .def("run_batch", &Executor::run_batch)
      .def("set_group", &Executor::set_group)
      .def("reduce", &Executor::reduce, py::arg("ins"), py::arg("group"), py::arg("what"),
           py::arg("what_error"))
      .def("transfer", &Executor::transfer, py::arg("ins"), py::arg("groups"))
      .def("delete", &Executor::delete_refs)
      .def("signal", &Executor::signal)
      .def("wait", &Executor::wait)
      .def("borrow_begin", &Executor::borrow_begin)
      .def("borrow_end", &Executor::borrow_end)
      .def("python", &Executor::python)
      .def("barrier", &Executor::barrier)
      .def("streams", &Executor::streams)
      .def("close", &Executor::close);
}
