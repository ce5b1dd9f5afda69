// Collectives of a c10d backend for the C++ executor (see comm.h).

#include "comm.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace md {

c10d::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum" || op == "avg") return c10d::ReduceOp::SUM;  // avg: the caller divides
  if (op == "max") return c10d::ReduceOp::MAX;
  if (op == "min") return c10d::ReduceOp::MIN;
  if (op == "prod") return c10d::ReduceOp::PRODUCT;
  throw std::invalid_argument("unknown reduction " + op);
}

class BackendComm : public Comm {
 public:
  explicit BackendComm(c10::intrusive_ptr<c10d::Backend> backend)
      : backend_(std::move(backend)) {}

  void all_reduce(at::Tensor& t, const std::string& op) override {
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    backend_->allreduce(ts, opts)->wait();
  }

  void all_gather(std::vector<at::Tensor>& outs, const at::Tensor& input) override {
    std::vector<std::vector<at::Tensor>> out_lists{outs};
    std::vector<at::Tensor> ins{input};
    backend_->allgather(out_lists, ins)->wait();
  }

  void reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& inputs,
                      const std::string& op) override {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> in_lists{inputs};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    backend_->reduce_scatter(outs, in_lists, opts)->wait();
  }

  void all_to_all(at::Tensor& out, const at::Tensor& input) override {
    at::Tensor in = input;
    std::vector<int64_t> even;
    backend_->alltoall_base(out, in, even, even)->wait();
  }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
};

std::shared_ptr<Comm> backend_comm(py::handle group) {
  return std::make_shared<BackendComm>(group.cast<c10::intrusive_ptr<c10d::Backend>>());
}

std::shared_ptr<Comm> comm_of(py::handle group) {
  if (auto shm = shm_comm_of(group)) return shm;
  try {
    return backend_comm(group);
  } catch (const py::cast_error&) {
    throw std::invalid_argument("not a process group the C++ executor can use: " +
                                py::repr(group).cast<std::string>());
  }
}

}  // namespace md
