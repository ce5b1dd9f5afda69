// One process group's collectives as the C++ executor calls them: blocking, from any thread,
// with or without the GIL. Two kinds: a torch.distributed backend handed over from Python
// (gloo, NCCL: a c10d::Backend), and a shared-memory group (shm.cpp) that falls back to its
// gloo backend for what it does not cover.

#pragma once

#include <torch/extension.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace md {

namespace py = pybind11;

// Waits for a started collective (empty: it had finished when it returned).
using Wait = std::function<void()>;

// Memory of each member of a group that every member maps (Comm::share): `ranks[r]` is member
// r's `bytes`, in this process; the mappings end with the last reference.
struct SharedBlock {
  virtual ~SharedBlock() = default;
  std::vector<char*> ranks;
  int rank = 0;  // this member
  size_t bytes = 0;
  char* mine() const { return ranks.at(rank); }
};

class Comm {
 public:
  virtual ~Comm() = default;
  // Started collectives; `op`: "sum", "avg", "max", "min" or "prod". The tensors must live
  // until the wait has returned.
  virtual Wait start_all_reduce(at::Tensor& t, const std::string& op) = 0;
  // out = the all-reduce of the concatenation of `pieces` (contiguous, out's dtype, as many
  // elements in all as out): a gradient bucket. By default copied into out, then reduced
  // there; shared memory reads the pieces where they are.
  virtual Wait start_all_reduce_into(at::Tensor& out, const std::vector<at::Tensor>& pieces,
                                     const std::string& op) {
    if (pieces.size() == 1) {
      out.view({-1}).copy_(pieces[0].reshape({-1}));
    } else {
      std::vector<at::Tensor> flat;
      for (const auto& p : pieces) flat.push_back(p.reshape({-1}));
      at::Tensor whole = out.view({-1});
      at::cat_out(whole, flat);
    }
    return start_all_reduce(out, op);
  }
  // The all-reduce of the concatenation of `pieces` (contiguous, one dtype), left in them: a
  // gradient bucket whose gradients take the result. By default through one flat copy, copied
  // back when it is done; shared memory reduces them where they are.
  virtual Wait start_all_reduce_pieces(std::vector<at::Tensor>& pieces, const std::string& op) {
    if (pieces.size() == 1) return start_all_reduce(pieces[0], op);
    std::vector<at::Tensor> flat;
    for (const auto& p : pieces) flat.push_back(p.reshape({-1}));
    auto whole = std::make_shared<at::Tensor>(at::cat(flat));
    Wait reduced = start_all_reduce(*whole, op);
    return [reduced, whole, pieces]() mutable {
      if (reduced) reduced();
      int64_t at = 0;
      for (auto& p : pieces) {
        p.view({-1}).copy_(whole->narrow(0, at, p.numel()));
        at += p.numel();
      }
    };
  }
  // Collective, `bytes` alike on every member: a SharedBlock (zeros). nullptr on every member
  // where any could not make one or passed `ok` false, and where the backend has no memory
  // to share (gloo, NCCL: then no member communicates).
  virtual std::shared_ptr<SharedBlock> share(size_t bytes, bool ok) { return nullptr; }
  // Collective: the all-reduce in place of the `count` elements of `dtype` at byte `offset`
  // (a multiple of 64) of every member's `block` (from share), each member with `ok`. False,
  // and nothing done, on every member where any passed `ok` false or another offset.
  virtual bool all_reduce_shared(SharedBlock& block, size_t offset, size_t count,
                                 at::ScalarType dtype, const std::string& op, bool ok) {
    return false;
  }
  virtual Wait start_all_gather(std::vector<at::Tensor>& outs, const at::Tensor& input) = 0;
  virtual Wait start_reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& inputs,
                                    const std::string& op) = 0;
  virtual Wait start_all_to_all(at::Tensor& out, const at::Tensor& input) = 0;
  // Point to point with the member at index dst / src; messages of one direction arrive in
  // the order they were started.
  virtual Wait start_send(at::Tensor& t, int64_t dst, int64_t tag) = 0;
  virtual Wait start_recv(at::Tensor& t, int64_t src, int64_t tag) = 0;

  void send(at::Tensor& t, int64_t dst, int64_t tag) { finish(start_send(t, dst, tag)); }
  void recv(at::Tensor& t, int64_t src, int64_t tag) { finish(start_recv(t, src, tag)); }

  void all_reduce(at::Tensor& t, const std::string& op) { finish(start_all_reduce(t, op)); }
  void all_gather(std::vector<at::Tensor>& outs, const at::Tensor& input) {
    finish(start_all_gather(outs, input));
  }
  void reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& inputs, const std::string& op) {
    finish(start_reduce_scatter(out, inputs, op));
  }
  void all_to_all(at::Tensor& out, const at::Tensor& input) {
    finish(start_all_to_all(out, input));
  }

 private:
  static void finish(const Wait& w) {
    if (w) w();
  }
};

// The Comm of a group object from Python: a c10d backend (ProcessGroupGloo, ProcessGroupNCCL)
// or a runtime/shm.py ShmProcessGroup. Called with the GIL.
std::shared_ptr<Comm> comm_of(py::handle group);

// Defined in shm.cpp: the Comm of a ShmProcessGroup (None if `group` is not one).
std::shared_ptr<Comm> shm_comm_of(py::handle group);

}  // namespace md
