// What each collective computes (see collectives.h).

#include "collectives.h"

namespace md {

namespace {

// The reduction the Comm does: avg is a sum that the result's maker divides.
std::string comm_op(const std::string& reduction) {
  return reduction == "avg" ? "sum" : reduction;
}

}  // namespace

Finish all_reduce(Comm& comm, at::Tensor t, const std::string& reduction, int64_t size) {
  Wait wait = comm.start_all_reduce(t, comm_op(reduction));
  return [t, wait, avg = reduction == "avg", size]() mutable {
    if (wait) wait();
    if (avg) t.div_(size);
    return t;
  };
}

Finish all_reduce_into(Comm& comm, at::Tensor out, std::vector<at::Tensor> pieces,
                       const std::string& reduction, int64_t size) {
  Wait wait = comm.start_all_reduce_into(out, pieces, comm_op(reduction));
  return [out, pieces = std::move(pieces), wait, avg = reduction == "avg", size]() mutable {
    if (wait) wait();
    if (avg) out.div_(size);
    return out;
  };
}

Finish all_reduce_pieces(Comm& comm, std::vector<at::Tensor> pieces,
                         const std::string& reduction, int64_t size) {
  Wait wait = comm.start_all_reduce_pieces(pieces, comm_op(reduction));
  return [pieces = std::move(pieces), wait, avg = reduction == "avg", size]() mutable {
    if (wait) wait();
    if (avg)
      for (auto& p : pieces) p.div_(size);
    return at::Tensor();
  };
}

Finish all_gather(Comm& comm, const at::Tensor& input, int64_t size, int64_t dim, bool stack) {
  at::Tensor in = input.contiguous();
  if (dim == 0 && (stack || in.dim() > 0)) {
    // Along dim 0 each rank's piece is a contiguous slice of the result: gathered into the
    // result itself (no second buffer of the whole, no concatenating copy).
    std::vector<int64_t> shape = in.sizes().vec();
    if (stack) shape.insert(shape.begin(), 1);
    const int64_t rows = shape[0];
    shape[0] = rows * size;
    at::Tensor result = at::empty(shape, in.options());
    std::vector<at::Tensor> outs;
    for (int64_t i = 0; i < size; ++i) {
      at::Tensor piece = result.narrow(0, i * rows, rows);
      outs.push_back(stack ? piece.squeeze(0) : piece);
    }
    Wait wait = comm.start_all_gather(outs, in);
    return [result, outs, in, wait]() {
      if (wait) wait();
      return result;
    };
  }
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < size; ++i) outs.push_back(at::empty_like(in));
  Wait wait = comm.start_all_gather(outs, in);
  return [outs, in, wait, dim, stack]() {
    if (wait) wait();
    return stack ? at::stack(outs, dim) : at::cat(outs, dim);
  };
}

Finish reduce_scatter(Comm& comm, const at::Tensor& input, const std::string& reduction,
                      int64_t index, int64_t size, int64_t dim) {
  std::vector<at::Tensor> chunks;
  for (auto& c : input.chunk(size, dim)) chunks.push_back(c.contiguous());
  at::Tensor out = at::empty_like(chunks.at(index));
  Wait wait = comm.start_reduce_scatter(out, chunks, comm_op(reduction));
  return [out, chunks, wait, avg = reduction == "avg", size]() mutable {
    if (wait) wait();
    if (avg) out.div_(size);
    return out;
  };
}

Finish all_to_all(Comm& comm, const at::Tensor& input, int64_t size, int64_t split_dim,
                  int64_t cat_dim) {
  at::Tensor src = input.movedim(split_dim, 0).contiguous();
  at::Tensor out = at::empty_like(src);
  Wait wait = comm.start_all_to_all(out, src);
  return [out, src, wait, size, split_dim, cat_dim]() {
    if (wait) wait();
    if (split_dim == cat_dim) return out.movedim(0, split_dim).contiguous();  // (no copy at 0)
    std::vector<at::Tensor> pieces;
    for (auto& p : out.chunk(size, 0)) pieces.push_back(p.movedim(0, split_dim));
    return at::cat(pieces, cat_dim).contiguous();
  };
}

}  // namespace md
