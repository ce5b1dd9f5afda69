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

Wait waiter(c10::intrusive_ptr<c10d::Work> work);

class BackendComm : public Comm {
 public:
  explicit BackendComm(c10::intrusive_ptr<c10d::Backend> backend)
      : backend_(std::move(backend)) {}

  Wait start_all_reduce(at::Tensor& t, const std::string& op) override {
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    return waiter(backend_->allreduce(ts, opts));
  }

  Wait start_all_gather(std::vector<at::Tensor>& outs, const at::Tensor& input) override {
    std::vector<std::vector<at::Tensor>> out_lists{outs};
    std::vector<at::Tensor> ins{input};
    return waiter(backend_->allgather(out_lists, ins));
  }

  Wait start_reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& inputs,
                            const std::string& op) override {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> in_lists{inputs};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    return waiter(backend_->reduce_scatter(outs, in_lists, opts));
  }

  Wait start_all_to_all(at::Tensor& out, const at::Tensor& input) override {
    at::Tensor in = input;
    std::vector<int64_t> even;
    return waiter(backend_->alltoall_base(out, in, even, even));
  }

  Wait start_send(at::Tensor& t, int64_t dst, int64_t tag) override {
    std::vector<at::Tensor> ts{t};
    return waiter(backend_->send(ts, static_cast<int>(dst), static_cast<int>(tag)));
  }

  Wait start_recv(at::Tensor& t, int64_t src, int64_t tag) override {
    std::vector<at::Tensor> ts{t};
    return waiter(backend_->recv(ts, static_cast<int>(src), static_cast<int>(tag)));
  }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
};

Wait waiter(c10::intrusive_ptr<c10d::Work> work) {
  return [work = std::move(work)] { work->wait(); };
}

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
