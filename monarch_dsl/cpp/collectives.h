// What each collective computes, over a Comm (comm.h): the one implementation of all-reduce,
// all-gather, reduce-scatter and all-to-all semantics, for the executor's Reduce
// (executor.cpp) and for compiled plans (program.cpp).
//
// Each starts its collective and returns a Finish: calling it (once) waits for the collective
// and returns the result; the tensors the collective works on live until then. `reduction`:
// "sum", "avg", "max", "min" or "prod" (avg: a sum, then divided by `size`, the number of
// members). After a failure a caller still takes part, with zeros, so no peer waits forever.

#pragma once

#include "comm.h"

#include <functional>
#include <string>
#include <vector>

namespace md {

using Finish = std::function<at::Tensor()>;

// `t` all-reduced in place (contiguous); the result is `t`.
Finish all_reduce(Comm& comm, at::Tensor t, const std::string& reduction, int64_t size);

// `out` = the all-reduce of the concatenation of `pieces` (contiguous, out's dtype, as many
// elements in all as `out`): see Comm::start_all_reduce_into. The result is `out`.
Finish all_reduce_into(Comm& comm, at::Tensor out, std::vector<at::Tensor> pieces,
                       const std::string& reduction, int64_t size);

// The all-reduce of the concatenation of `pieces` (contiguous, one dtype), left in them: see
// Comm::start_all_reduce_pieces. The result is an undefined tensor (the pieces hold it).
Finish all_reduce_pieces(Comm& comm, std::vector<at::Tensor> pieces,
                         const std::string& reduction, int64_t size);

// Every member's `input`, in member order, concatenated along `dim` (`stack`: stacked along a
// new dim `dim`).
Finish all_gather(Comm& comm, const at::Tensor& input, int64_t size, int64_t dim, bool stack);

// Chunk `index` (this member's) of the reduction of `input`, chunked into `size` along `dim`.
Finish reduce_scatter(Comm& comm, const at::Tensor& input, const std::string& reduction,
                      int64_t index, int64_t size, int64_t dim);

// Piece i of `input` split into `size` along `split_dim` goes to member i; the pieces
// received, in member order, concatenated along `cat_dim`.
Finish all_to_all(Comm& comm, const at::Tensor& input, int64_t size, int64_t split_dim,
                  int64_t cat_dim);

}  // namespace md
