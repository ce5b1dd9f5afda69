// Shared-memory collectives for CPU tensors of ranks on one host (issue 5).
//
// A group of `size` processes maps one POSIX shared-memory segment. Rank 0 creates it (the
// name is unique: the Python side puts its pid and a random token in it), the others attach,
// and as soon as every member has attached rank 0 shm_unlink's the name: from then on the
// mapping lives exactly as long as the processes that map it, so neither stop() nor a crash
// can leak a /dev/shm entry. (Stale names left by a creator killed inside the constructor are
// swept by monarch_dsl/runtime/shm.py, which knows the creator's pid from the name.)
//
// Layout: a header (magic, sizes, per-rank pids and barrier counts, the barrier counter),
// then one slot per rank of `capacity` bytes split in two halves (double buffering: chunk c
// uses half c % 2, so one chunk's copies-out overlap the next chunk's copies-in and each chunk
// needs two barriers, not three), then one ring channel per ordered pair of ranks for
// send/recv.
//
// Synchronisation: a monotonic 32-bit arrival counter in the segment; barrier k is passed once
// it reaches k * size. Waiters spin briefly, then yield the core for a while (ranks often
// outnumber cores: with 4 ranks on 2 cores yielding cut a 4 KiB all-reduce from ~77 us to
// ~23 us), then sleep on the counter with futex (a shared,
// not private, futex: the word lives in the shared mapping) with a timeout; arrivals wake
// sleepers only when some sleep. Every wait has a deadline (the group's timeout) and checks,
// while it waits, whether a peer process died or the group was aborted, and raises an error
// naming the group, the operation and the ranks it was waiting for.
//
// All-reduce of a chunk (parallel: every rank reduces its own slice):
//   1. rank r copies the slices j != r of its input chunk into its slot (half b);
//   2. barrier;
//   3. rank r reduces slice r: its own input slice (read where it is) and slice r of every
//      other slot, in rank order (so every rank gets bit-identical results), into its output
//      and into its slot;
//   4. barrier;
//   5. rank r copies slice j of slot j (j != r) into its output.
// All-gather, reduce-scatter and broadcast follow the same pattern. The GIL is released for
// the whole of each call.
//
// Shared blocks (share, all_reduce_shared): memory of each rank that every rank maps, made
// for a gradient bucket whose gradients are written there by the steps that make them
// (cpp/program.cpp). Its all-reduce needs no copies in or out: after a barrier, rank r
// reduces slice r of every rank's block, in rank order, into every rank's block; a second
// barrier ends it. Per rank that moves 2 x the bucket's bytes (2 ranks), where the chunked
// all-reduce above moves 3.5 x. Each rank makes its block's segment (named after its pid, as
// the group's, so a stale one is swept the same way) and unlinks it once every rank mapped
// it. Both are collectives with a vote: where any rank could not (or was told `ok` = false),
// every rank gets the same "no" and nothing is left behind.

#include "comm.h"

#include <torch/extension.h>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint64_t kMagic = 0x6d645f73686d3031ULL;  // "md_shm01"
constexpr int kMaxRanks = 256;
constexpr size_t kLine = 64;
// Waiting: spin this many pauses, then yield the core this many times, then sleep (futex).
// MD_SHM_SPINS / MD_SHM_YIELDS override them (read when a group is made).
constexpr int kSpins = 64;
constexpr int kYields = 5000;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 ? std::atoi(v) : fallback;
}

using Clock = std::chrono::steady_clock;

struct alignas(kLine) RankInfo {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> barriers;  // barriers this rank has entered (diagnostics)
  // ShmGroup::vote: (vote number << 32) | token, in the slot of the number's parity (a rank
  // can be one vote ahead of a peer that has not read the last one yet, never two)
  std::atomic<uint64_t> votes[2];
};

struct alignas(kLine) Counter {
  std::atomic<uint32_t> value;  // the futex word
  std::atomic<uint32_t> sleepers;
};

struct alignas(kLine) Header {
  std::atomic<uint64_t> magic;  // set last by the creator: the segment is initialised
  uint64_t size;
  uint64_t capacity;       // bytes per rank slot (two halves)
  uint64_t ring_capacity;  // bytes per send/recv channel
  uint64_t total_bytes;
  std::atomic<uint32_t> attached;
  std::atomic<int32_t> aborted_by;  // -1, or the rank that gave up (timeout, error)
  Counter arrivals;
  RankInfo ranks[kMaxRanks];
};

struct alignas(kLine) Channel {  // one direction between two ranks: a byte ring
  std::atomic<uint64_t> written;
  alignas(kLine) std::atomic<uint64_t> read;
  alignas(kLine) Counter signal;  // bumped by both sides after each move
};

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// kill(pid, 0) alone counts zombies (killed, not yet reaped) as alive.
bool process_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');
  return !(close_paren != nullptr && close_paren[1] == ' ' && close_paren[2] == 'Z');
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

enum class Op { Sum, Avg, Max, Min, Prod };

Op parse_op(const std::string& s) {
  if (s == "sum") return Op::Sum;
  if (s == "avg") return Op::Avg;
  if (s == "max") return Op::Max;
  if (s == "min") return Op::Min;
  if (s == "prod" || s == "product") return Op::Prod;
  throw std::invalid_argument("shm collectives: unknown reduce op '" + s +
                              "' (sum, avg, max, min, prod)");
}

template <typename T> struct Acc { using type = T; };
template <> struct Acc<c10::Half> { using type = float; };
template <> struct Acc<c10::BFloat16> { using type = float; };

// out[i] = op over k of srcs[k][i], in k order, accumulated in Acc<T> and rounded once.
template <typename T>
__attribute__((optimize("O3", "tree-vectorize"))) void reduce_block(
    T* out, T* out2, const T* const* srcs, int n_src, size_t count, Op op, int divisor) {
  using A = typename Acc<T>::type;
  constexpr size_t B = 512;
  A acc[B];
  for (size_t base = 0; base < count; base += B) {
    const size_t m = std::min(B, count - base);
    const T* s0 = srcs[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    for (int k = 1; k < n_src; ++k) {
      const T* s = srcs[k] + base;
      switch (op) {
        case Op::Sum:
        case Op::Avg:
          for (size_t i = 0; i < m; ++i) acc[i] = acc[i] + static_cast<A>(s[i]);
          break;
        case Op::Prod:
          for (size_t i = 0; i < m; ++i) acc[i] = acc[i] * static_cast<A>(s[i]);
          break;
        case Op::Max:
          for (size_t i = 0; i < m; ++i) {
            A v = static_cast<A>(s[i]);
            acc[i] = (v > acc[i] || v != v) ? v : acc[i];  // NaN propagates, like torch
          }
          break;
        case Op::Min:
          for (size_t i = 0; i < m; ++i) {
            A v = static_cast<A>(s[i]);
            acc[i] = (v < acc[i] || v != v) ? v : acc[i];
          }
          break;
      }
    }
    if (op == Op::Avg) {
      const A d = static_cast<A>(divisor);
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / d;
    }
    T* o = out + base;
    for (size_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i]);
    if (out2 != nullptr) std::memcpy(out2 + base, o, m * sizeof(T));  // from cache
  }
}

// out (and out2 unless null) = the reduction of srcs.
using ReduceFn = void (*)(void*, void*, const void* const*, int, size_t, Op, int);

template <typename T>
void reduce_erased(void* out, void* out2, const void* const* srcs, int n, size_t count, Op op,
                   int d) {
  reduce_block<T>(static_cast<T*>(out), static_cast<T*>(out2),
                  reinterpret_cast<const T* const*>(srcs), n, count, op, d);
}

ReduceFn reducer(at::ScalarType t, Op op) {
  const bool floating = at::isFloatingType(t);
  if (op == Op::Avg && !floating)
    throw std::invalid_argument("shm collectives: avg needs a floating dtype, got " +
                                std::string(c10::toString(t)));
  switch (t) {
    case at::kFloat: return reduce_erased<float>;
    case at::kDouble: return reduce_erased<double>;
    case at::kHalf: return reduce_erased<c10::Half>;
    case at::kBFloat16: return reduce_erased<c10::BFloat16>;
    case at::kLong: return reduce_erased<int64_t>;
    case at::kInt: return reduce_erased<int32_t>;
    case at::kShort: return reduce_erased<int16_t>;
    case at::kChar: return reduce_erased<int8_t>;
    case at::kByte: return reduce_erased<uint8_t>;
    default:
      throw std::invalid_argument("shm collectives: unsupported dtype " +
                                  std::string(c10::toString(t)));
  }
}

// [begin, end) of piece `i` of `n` nearly equal pieces of `count` items.
inline std::pair<size_t, size_t> piece(size_t count, int n, int i) {
  const size_t q = count / n, r = count % n;
  const size_t b = i * q + std::min<size_t>(i, r);
  return {b, b + q + (static_cast<size_t>(i) < r ? 1 : 0)};
}

void check_cpu(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string("shm collectives: ") + what + " must be a CPU tensor");
  if (!t.is_contiguous())
    throw std::invalid_argument(std::string("shm collectives: ") + what + " must be contiguous");
}

// The bytes of several buffers read as one (a bucket's gradients as its flat buffer).
class Concat {
 public:
  void add(const char* data, size_t bytes) {
    data_.push_back(data);
    ends_.push_back(bytes_ += bytes);
  }
  size_t bytes() const { return bytes_; }
  // Calls f(pointer, offset, n) for each run of bytes [begin, begin + n) of the concatenation
  // that lies in one buffer (offset: from `begin`).
  template <typename F>
  void for_each_run(size_t begin, size_t n, F f) const {
    size_t i = std::upper_bound(ends_.begin(), ends_.end(), begin) - ends_.begin();
    size_t done = 0;
    while (done < n && i < data_.size()) {
      const size_t start = i == 0 ? 0 : ends_[i - 1];
      const size_t m = std::min(n - done, ends_[i] - begin);
      f(data_[i] + (begin - start), done, m);
      begin += m;
      done += m;
      ++i;
    }
  }
  // Copies bytes [begin, begin + n) of the concatenation to `to` (a rank's slot: never one
  // of the buffers).
  void copy_to(char* to, size_t begin, size_t n) const {
    for_each_run(begin, n, [to](const char* from, size_t at, size_t m) {
      std::memcpy(to + at, from, m);
    });
  }

 private:
  std::vector<const char*> data_;
  std::vector<size_t> ends_;  // where each buffer ends in the concatenation
  size_t bytes_ = 0;
};

// Releases the GIL for a call when the calling thread holds it (Python callers do; the C++
// executor's stream threads call without it).
struct NoGil {
  std::optional<py::gil_scoped_release> release;
  NoGil() {
    if (PyGILState_Check()) release.emplace();
  }
};

class ShmGroup {
 public:
  ShmGroup(std::string name, int rank, int size, int64_t capacity, double timeout_s,
           int64_t ring_capacity)
      : name_(std::move(name)), rank_(rank), size_(size), timeout_s_(timeout_s) {
    if (size < 1 || size > kMaxRanks) throw std::invalid_argument("shm group: bad size");
    if (rank < 0 || rank >= size) throw std::invalid_argument("shm group: bad rank");
    if (name_.empty() || name_[0] != '/') name_ = "/" + name_;
    // Each half holds a chunk whose bytes divide into `size` slices (any dtype, aligned).
    capacity_ = align_up(std::max<int64_t>(capacity, 2 * 64 * size), 2 * kLine);
    ring_capacity_ = align_up(std::max<int64_t>(ring_capacity, 4096), kLine);
    header_bytes_ = align_up(sizeof(Header), 4096);
    channel_bytes_ = align_up(sizeof(Channel), kLine) + ring_capacity_;
    total_ = header_bytes_ + size_ * capacity_ + size_ * size_ * channel_bytes_;
    NoGil nogil;
    open_segment();
  }

  ~ShmGroup() { close(); }

  void close() {
    if (base_ != nullptr) {
      if (rank_ == 0 && !unlinked_) shm_unlink(name_.c_str());
      munmap(base_, total_);
      base_ = nullptr;
    }
  }

  // ---------------------------------------------------------------- collectives
  void all_reduce(at::Tensor t, const std::string& op_name) {
    check_cpu(t, "all_reduce's tensor");
    all_reduce_into(t, {t}, op_name);
  }

  // out = the reduction over ranks of the concatenation of `pieces` (flattened), each rank's
  // pieces alike. A gradient bucket's all-reduce: its gradients are read where they are,
  // with no flat copy first (the pieces may be `out` itself: an in-place all-reduce).
  void all_reduce_into(at::Tensor out, const std::vector<at::Tensor>& pieces,
                       const std::string& op_name) {
    check_cpu(out, "all_reduce's output");
    const Concat input = concat(pieces, out.scalar_type(), "all_reduce's inputs");
    const size_t es = out.element_size();
    if (input.bytes() != out.numel() * es)
      throw std::invalid_argument("shm all_reduce: the inputs' size differs from the output's");
    Concat output;
    output.add(static_cast<const char*>(out.data_ptr()), out.numel() * es);
    reduce_concat(input, output, out.scalar_type(), es, op_name);
  }

  // The reduction over ranks of the concatenation of `pieces`, left in them (a bucket whose
  // gradients take the result themselves: no result buffer, and every write is to a line
  // this rank has just read).
  void all_reduce_pieces(const std::vector<at::Tensor>& pieces, const std::string& op_name) {
    if (pieces.empty()) throw std::invalid_argument("shm all_reduce: no tensors");
    const auto dtype = pieces[0].scalar_type();
    const Concat both = concat(pieces, dtype, "all_reduce's tensors");
    // (a byte in two pieces would be written by one and read again, reduced, by the other)
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    for (const auto& p : pieces) {
      const auto at = reinterpret_cast<uintptr_t>(p.data_ptr());
      if (p.numel() > 0) spans.emplace_back(at, at + p.numel() * p.element_size());
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second)
        throw std::invalid_argument("shm all_reduce: the tensors overlap in memory");
    reduce_concat(both, both, dtype, pieces[0].element_size(), op_name);
  }

  // outs[j] receives rank j's `input` (all the same shape and dtype as input).
  void all_gather_into(std::vector<at::Tensor> outs, at::Tensor input) {
    check_cpu(input, "all_gather's input");
    if (static_cast<int>(outs.size()) != size_)
      throw std::invalid_argument("shm all_gather: needs one output per rank");
    for (auto& o : outs) {
      check_cpu(o, "all_gather's outputs");
      if (o.numel() != input.numel() || o.scalar_type() != input.scalar_type())
        throw std::invalid_argument("shm all_gather: outputs must match the input");
    }
    std::vector<char*> dst(size_);
    for (int j = 0; j < size_; ++j) dst[j] = static_cast<char*>(outs[j].data_ptr());
    const char* src = static_cast<const char*>(input.data_ptr());
    const size_t bytes = input.numel() * input.element_size();
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    const size_t per_chunk = half_bytes() / 64 * 64;
    for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += per_chunk) {
      const size_t n = std::min(per_chunk, bytes - off);
      const int h = next_half();
      std::memcpy(slot(rank_, h), src + off, n);
      barrier("all_gather");
      for (int j = 0; j < size_; ++j)
        std::memcpy(dst[j] + off, j == rank_ ? src + off : slot(j, h), n);
      if (bytes == 0) break;
    }
  }

  at::Tensor all_gather(at::Tensor input) {
    std::vector<int64_t> shape{size_};
    for (auto s : input.sizes()) shape.push_back(s);
    at::Tensor out = at::empty(shape, input.options());
    all_gather_into(out.unbind(0), input.contiguous());
    return out;
  }

  // out = op over ranks of inputs[rank_] (inputs: one tensor per rank, like gloo's).
  void reduce_scatter(at::Tensor out, std::vector<at::Tensor> inputs, const std::string& op_name) {
    check_cpu(out, "reduce_scatter's output");
    if (static_cast<int>(inputs.size()) != size_)
      throw std::invalid_argument("shm reduce_scatter: needs one input per rank");
    for (auto& t : inputs) {
      check_cpu(t, "reduce_scatter's inputs");
      if (t.numel() != out.numel() || t.scalar_type() != out.scalar_type())
        throw std::invalid_argument("shm reduce_scatter: inputs must match the output");
    }
    const Op op = parse_op(op_name);
    const ReduceFn fn = reducer(out.scalar_type(), op);
    const size_t es = out.element_size();
    std::vector<const char*> in(size_);
    for (int j = 0; j < size_; ++j) in[j] = static_cast<const char*>(inputs[j].data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    const size_t count = out.numel();
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    // A half holds `size` pieces of `per` items (piece j: what rank j reduces).
    const size_t per = std::max<size_t>(1, half_bytes() / size_ / es);
    std::vector<const void*> srcs(size_);
    for (size_t off = 0; off < count || (count == 0 && off == 0); off += per) {
      const size_t n = std::min(per, count - off);
      const int h = next_half();
      for (int j = 0; j < size_; ++j)
        if (j != rank_) std::memcpy(slot(rank_, h) + j * per * es, in[j] + off * es, n * es);
      barrier("reduce_scatter");
      for (int k = 0; k < size_; ++k)
        srcs[k] = k == rank_ ? in[rank_] + off * es : slot(k, h) + rank_ * per * es;
      fn(dst + off * es, nullptr, srcs.data(), size_, n, op, size_);
      if (count == 0) break;
    }
  }

  void broadcast(at::Tensor t, int root) {
    check_cpu(t, "broadcast's tensor");
    if (root < 0 || root >= size_) throw std::invalid_argument("shm broadcast: bad root");
    char* data = static_cast<char*>(t.data_ptr());
    const size_t bytes = t.numel() * t.element_size();
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    const size_t per_chunk = half_bytes();
    for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += per_chunk) {
      const size_t n = std::min(per_chunk, bytes - off);
      const int h = next_half();
      if (rank_ == root) std::memcpy(slot(root, h), data + off, n);
      barrier("broadcast");
      if (rank_ != root) std::memcpy(data + off, slot(root, h), n);
      if (bytes == 0) break;
    }
  }

  // ---------------------------------------------------------------- shared blocks
  // Collective, `bytes` alike on every rank: a block of `bytes` per rank (zeros), mapped by
  // every rank; nullptr on every rank where any could not make or map one, or passed `ok`
  // false.
  std::shared_ptr<md::SharedBlock> share(size_t bytes, bool ok) {
    ok = ok && blocks_on_;  // (MD_SHM_BLOCKS=0: this rank says no)
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    auto block = std::make_shared<Block>();
    block->rank = rank_;
    block->bytes = std::max<size_t>(bytes, 1);
    block->ranks.assign(size_, nullptr);
    const uint64_t k = blocks_++;
    const std::string mine = block_name(getpid(), k);
    // (the name goes on every way out, a peer's death or a timeout in a vote included)
    struct Unlink {
      const std::string* name = nullptr;
      ~Unlink() {
        if (name != nullptr) shm_unlink(name->c_str());
      }
    } unlink;
    if (ok) {
      const int fd = shm_open(mine.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0) {
        unlink.name = &mine;
        block->ranks[rank_] = map_block(fd, block->bytes, true);
      }
    }
    constexpr uint64_t kShare = 1ull << 31;  // (a share's yes: no all-reduce's token)
    const bool mapped_mine = vote(block->ranks[rank_] != nullptr ? kShare : 0, "share");
    bool mapped_all = mapped_mine;
    if (mapped_mine) {
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        const int fd = shm_open(block_name(hdr()->ranks[r].pid.load(), k).c_str(), O_RDWR, 0);
        if (fd >= 0) block->ranks[r] = map_block(fd, block->bytes, false);
        mapped_all = mapped_all && block->ranks[r] != nullptr;
      }
      mapped_all = vote(mapped_all ? kShare : 0, "share");  // (every rank opened every name)
    }
    if (!mapped_all) return nullptr;  // (Block's destructor unmaps what was mapped)
    return block;
  }

  // Collective: the all-reduce in place of the `count` elements of `dtype` at byte `offset`
  // (a multiple of 64) of every rank's `block` (see the header). False, and nothing done, on
  // every rank where any passed `ok` false or another offset (or its block is too small, or
  // the dtype is not reduced here).
  bool all_reduce_shared(md::SharedBlock& block, size_t offset, size_t count,
                         at::ScalarType dtype, const std::string& op_name, bool ok) {
    ReduceFn fn = nullptr;
    Op op = Op::Sum;
    size_t es = 0;
    try {
      op = parse_op(op_name);
      fn = reducer(dtype, op);
      es = c10::elementSize(dtype);
    } catch (const std::invalid_argument&) {
      ok = false;  // (every rank has the same dtype and op: every rank says no)
    }
    ok = ok && static_cast<int>(block.ranks.size()) == size_ && block.rank == rank_ &&
         offset % kLine == 0 && offset + count * es <= block.bytes;
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    if (!vote(ok ? 1 + (offset / kLine) % (1ull << 30) : 0, "all_reduce")) return false;
    const auto [b, e] = piece(count, size_, rank_);
    const size_t at = offset + b * es;
    std::vector<const void*> srcs(size_);
    for (int r = 0; r < size_; ++r) srcs[r] = block.ranks[r] + at;
    char* out = block.ranks[rank_] + at;
    const int other = size_ == 2 ? 1 - rank_ : -1;
    fn(out, other >= 0 ? block.ranks[other] + at : nullptr, srcs.data(), size_, e - b, op, size_);
    if (size_ > 2)
      for (int r = 0; r < size_; ++r)
        if (r != rank_) std::memcpy(block.ranks[r] + at, out, (e - b) * es);
    barrier("all_reduce");
    return true;
  }

  void barrier_py() {
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    barrier("barrier");
  }

  // ---------------------------------------------------------------- send / recv
  // Messages in one direction are matched in order; each carries (bytes, tag), checked by the
  // receiver. send returns once the message is in the ring (the receiver may not have it yet).
  void send(at::Tensor t, int dst, int64_t tag) {
    check_cpu(t, "send's tensor");
    check_peer(dst);
    const uint64_t hdr[2] = {static_cast<uint64_t>(t.numel() * t.element_size()),
                             static_cast<uint64_t>(tag)};
    const char* data = static_cast<const char*>(t.data_ptr());
    NoGil nogil;
    std::lock_guard<std::mutex> lock(send_mu_);
    Channel* ch = channel(rank_, dst);
    put(ch, dst, reinterpret_cast<const char*>(hdr), sizeof(hdr));
    put(ch, dst, data, hdr[0]);
  }

  // Sends now if the whole message fits in the ring's free space; false (nothing sent) if not.
  bool try_send(at::Tensor t, int dst, int64_t tag) {
    check_cpu(t, "send's tensor");
    check_peer(dst);
    const size_t bytes = t.numel() * t.element_size();
    std::lock_guard<std::mutex> lock(send_mu_);
    Channel* ch = channel(rank_, dst);
    const uint64_t used = ch->written.load(std::memory_order_relaxed) -
                          ch->read.load(std::memory_order_acquire);
    if (ring_capacity_ - used < bytes + 16) return false;
    const uint64_t hdr[2] = {bytes, static_cast<uint64_t>(tag)};
    put(ch, dst, reinterpret_cast<const char*>(hdr), sizeof(hdr));
    put(ch, dst, static_cast<const char*>(t.data_ptr()), bytes);
    return true;
  }

  void recv(at::Tensor t, int src, int64_t tag) {
    check_cpu(t, "recv's tensor");
    check_peer(src);
    const size_t bytes = t.numel() * t.element_size();
    char* data = static_cast<char*>(t.data_ptr());
    NoGil nogil;
    std::lock_guard<std::mutex> lock(recv_mu_);
    Channel* ch = channel(src, rank_);
    uint64_t hdr[2];
    take(ch, src, reinterpret_cast<char*>(hdr), sizeof(hdr));
    if (hdr[0] != bytes || static_cast<int64_t>(hdr[1]) != tag) {
      abort_group();
      std::ostringstream s;
      s << "shm group " << name_ << ": rank " << rank_ << " expected a message of " << bytes
        << " bytes with tag " << tag << " from rank " << src << ", got " << hdr[0]
        << " bytes with tag " << static_cast<int64_t>(hdr[1]);
      throw std::runtime_error(s.str());
    }
    take(ch, src, data, bytes);
  }

  // ---------------------------------------------------------------- properties
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t capacity() const { return capacity_; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }
  bool closed() const { return base_ == nullptr; }

 private:
  Header* hdr() const { return reinterpret_cast<Header*>(base_); }
  size_t half_bytes() const { return capacity_ / 2; }
  char* slot(int r, int h) const {
    return base_ + header_bytes_ + r * capacity_ + h * half_bytes();
  }
  Channel* channel(int src, int dst) const {
    return reinterpret_cast<Channel*>(base_ + header_bytes_ + size_ * capacity_ +
                                      (src * size_ + dst) * channel_bytes_);
  }
  char* ring(Channel* ch) const {
    return reinterpret_cast<char*>(ch) + align_up(sizeof(Channel), kLine);
  }
  static Concat concat(const std::vector<at::Tensor>& pieces, at::ScalarType dtype,
                       const char* what) {
    Concat c;
    for (const auto& p : pieces) {
      check_cpu(p, what);
      if (p.scalar_type() != dtype)
        throw std::invalid_argument("shm all_reduce: the tensors differ in dtype");
      c.add(static_cast<const char*>(p.data_ptr()), p.numel() * p.element_size());
    }
    return c;
  }

  // output = the reduction over ranks of input (both concatenations of as many bytes; output
  // may be input: written only where this rank read it, or after it was copied to its slot).
  void reduce_concat(const Concat& input, const Concat& output, at::ScalarType dtype,
                     size_t es, const std::string& op_name) {
    const Op op = parse_op(op_name);
    const ReduceFn fn = reducer(dtype, op);
    const size_t count = input.bytes() / es;
    NoGil nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    const size_t per_chunk = half_bytes() / es;
    const char* what = "all_reduce";
    std::vector<const void*> srcs(size_);
    for (size_t off = 0; off < count || (count == 0 && off == 0); off += per_chunk) {
      const size_t n = std::min(per_chunk, count - off);
      const int h = next_half();
      for (int j = 0; j < size_; ++j) {
        if (j == rank_) continue;
        // the others' slices into this rank's slot
        auto [b, e] = piece(n, size_, j);
        input.copy_to(slot(rank_, h) + b * es, (off + b) * es, (e - b) * es);
      }
      barrier(what);
      const auto mine_at = piece(n, size_, rank_);
      const size_t b = mine_at.first, e = mine_at.second;
      // this rank's slice: its own input read where it is (no copy into the output first;
      // run by run when it spans several buffers), the others' from their slots, in rank
      // order; into the output (run by run too) and this rank's slot
      input.for_each_run((off + b) * es, (e - b) * es, [&](const char* mine, size_t at,
                                                           size_t bytes) {
        output.for_each_run((off + b) * es + at, bytes, [&](const char* to, size_t at2,
                                                            size_t m) {
          const size_t first = b * es + at + at2;
          for (int k = 0; k < size_; ++k) srcs[k] = k == rank_ ? mine + at2 : slot(k, h) + first;
          fn(const_cast<char*>(to), size_ > 1 ? slot(rank_, h) + first : nullptr, srcs.data(),
             size_, m / es, op, size_);
        });
      });
      barrier(what);
      for (int j = 0; j < size_; ++j) {
        if (j == rank_) continue;
        auto [b2, e2] = piece(n, size_, j);
        output.for_each_run((off + b2) * es, (e2 - b2) * es, [&](const char* to, size_t at,
                                                                 size_t m) {
          std::memcpy(const_cast<char*>(to), slot(j, h) + b2 * es + at, m);
        });
      }
      if (count == 0) break;
    }
  }

  int next_half() { return static_cast<int>(chunks_++ & 1); }

  // A shared block's mappings, unmapped with the last reference.
  struct Block : md::SharedBlock {
    ~Block() override {
      for (char* p : ranks)
        if (p != nullptr) munmap(p, bytes);
    }
  };

  // Rank `pid`'s segment for block k: the group's prefix, the pid (what sweep_stale reads),
  // the group's token and k.
  std::string block_name(int pid, uint64_t k) const {
    const size_t dot = name_.find('.');
    const std::string prefix = name_.substr(0, dot);
    const std::string token = name_.substr(name_.rfind('.') + 1);
    return prefix + "." + std::to_string(pid) + "." + token + "b" + std::to_string(k);
  }

  // Maps `bytes` of segment `fd` (closed): this rank's own made that long with its pages
  // reserved (posix_fallocate: a /dev/shm too small for it is a "no" now, not a SIGBUS when a
  // step first writes there); a peer's only where it is that long already.
  static char* map_block(int fd, size_t bytes, bool own) {
    void* p = MAP_FAILED;
    struct stat st {};
    const bool sized = own ? posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0
                           : fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
    if (sized) p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }

  // Collective (a barrier): whether every rank gave the same `token`, not 0 (0: no).
  bool vote(uint64_t token, const char* what) {
    const uint64_t k = ++votes_ & 0xffffffffu;
    const uint64_t mine = (k << 32) | (token & 0xffffffffu);
    hdr()->ranks[rank_].votes[k & 1].store(mine, std::memory_order_release);
    barrier(what);
    bool all = (mine & 0xffffffffu) != 0;
    for (int r = 0; r < size_; ++r) {
      const uint64_t v = hdr()->ranks[r].votes[k & 1].load(std::memory_order_acquire);
      if ((v >> 32) != k)
        fail(what, "rank " + std::to_string(r) + " is at another vote (" +
                       std::to_string(v >> 32) + ", this rank " + std::to_string(k) + ")");
      all = all && v == mine;
    }
    return all;
  }

  void check_open() const {
    if (base_ == nullptr) throw std::runtime_error("shm group " + name_ + " is closed");
  }
  void check_peer(int peer) const {
    check_open();
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw std::invalid_argument("shm send/recv: bad peer rank " + std::to_string(peer));
  }

  [[noreturn]] void fail(const std::string& what, const std::string& why) {
    std::ostringstream s;
    s << "shm group " << name_ << " (rank " << rank_ << " of " << size_ << "): " << what << ": "
      << why;
    throw std::runtime_error(s.str());
  }

  void abort_group() {
    if (base_ == nullptr) return;
    int32_t expected = -1;
    hdr()->aborted_by.compare_exchange_strong(expected, rank_);
    wake(&hdr()->arrivals);
    for (int s = 0; s < size_; ++s)
      for (int d = 0; d < size_; ++d)
        if (s != d) wake(&channel(s, d)->signal);
  }

  static void wake(Counter* c) {
    if (c->sleepers.load(std::memory_order_seq_cst) > 0)
      futex(&c->value, FUTEX_WAKE, INT32_MAX, nullptr);
  }

  static void bump(Counter* c) {
    c->value.fetch_add(1, std::memory_order_seq_cst);
    wake(c);
  }

  // Waits until ready() holds: spins a little, then sleeps on `c` (any change of its value
  // wakes us to re-check). Raises on timeout, on abort, and when a peer process is gone.
  template <typename Ready, typename Missing>
  void wait(Counter* c, Ready ready, Missing missing, const char* what) {
    if (ready()) return;
    // Spin (the peers are usually microseconds away), then yield the core (ranks may
    // outnumber cores), then sleep on the futex.
    for (int i = 0; i < spins_; ++i) {
      cpu_relax();
      if (ready()) return;
    }
    for (int i = 0; i < yields_; ++i) {
      sched_yield();
      if (ready()) return;
    }
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration<double>(timeout_s_);
    auto next_check = start + std::chrono::milliseconds(100);
    for (;;) {
      const uint32_t seen = c->value.load(std::memory_order_seq_cst);
      if (ready()) return;
      const int32_t ab = hdr()->aborted_by.load();
      if (ab >= 0 && ab != rank_)
        fail(what, "the group was aborted by rank " + std::to_string(ab));
      const auto now = Clock::now();
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(100);
        for (int r : missing()) {
          const int pid = hdr()->ranks[r].pid.load();
          if (pid > 0 && !process_alive(pid)) {
            abort_group();
            fail(what, "rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                           ") exited without taking part");
          }
        }
      }
      if (now >= deadline) {
        abort_group();
        std::ostringstream s;
        s << "timed out after " << timeout_s_ << " s waiting for rank(s)";
        for (int r : missing()) s << " " << r;
        fail(what, s.str());
      }
      timespec ts{0, 20 * 1000 * 1000};  // re-check liveness and the deadline every 20 ms
      c->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!ready()) futex(&c->value, FUTEX_WAIT, seen, &ts);
      c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (ready()) return;
      sched_yield();
    }
  }

  void barrier(const char* what) {
    check_open();
    if (size_ == 1) return;
    Header* h = hdr();
    const uint32_t k = ++barriers_;
    h->ranks[rank_].barriers.store(k, std::memory_order_relaxed);
    h->arrivals.value.fetch_add(1, std::memory_order_seq_cst);
    wake(&h->arrivals);
    const uint32_t target = k * static_cast<uint32_t>(size_);
    wait(
        &h->arrivals,
        [&] {
          return static_cast<int32_t>(h->arrivals.value.load(std::memory_order_acquire) -
                                      target) >= 0;
        },
        [&] {
          std::vector<int> late;
          for (int r = 0; r < size_; ++r)
            if (static_cast<int32_t>(h->ranks[r].barriers.load() - k) < 0) late.push_back(r);
          return late;
        },
        what);
  }

  void put(Channel* ch, int dst, const char* data, size_t bytes) {
    char* buf = ring(ch);
    uint64_t w = ch->written.load(std::memory_order_relaxed);
    size_t done = 0;
    while (done < bytes) {
      uint64_t r = ch->read.load(std::memory_order_acquire);
      if (w - r >= ring_capacity_) {
        wait(
            &ch->signal,
            [&] { return w - ch->read.load(std::memory_order_acquire) < ring_capacity_; },
            [&] { return std::vector<int>{dst}; }, "send");
        r = ch->read.load(std::memory_order_acquire);
      }
      const size_t pos = w % ring_capacity_;
      const size_t n = std::min({bytes - done, ring_capacity_ - (w - r), ring_capacity_ - pos});
      std::memcpy(buf + pos, data + done, n);
      done += n;
      w += n;
      ch->written.store(w, std::memory_order_release);
      bump(&ch->signal);
    }
  }

  void take(Channel* ch, int src, char* data, size_t bytes) {
    const char* buf = ring(ch);
    uint64_t r = ch->read.load(std::memory_order_relaxed);
    size_t done = 0;
    while (done < bytes) {
      uint64_t w = ch->written.load(std::memory_order_acquire);
      if (w == r) {
        wait(
            &ch->signal, [&] { return ch->written.load(std::memory_order_acquire) != r; },
            [&] { return std::vector<int>{src}; }, "recv");
        w = ch->written.load(std::memory_order_acquire);
      }
      const size_t pos = r % ring_capacity_;
      const size_t n = std::min({bytes - done, static_cast<size_t>(w - r), ring_capacity_ - pos});
      std::memcpy(data + done, buf + pos, n);
      done += n;
      r += n;
      ch->read.store(r, std::memory_order_release);
      bump(&ch->signal);
    }
  }

  void open_segment() {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    int fd = -1;
    if (rank_ == 0) {
      fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) fail("create", std::string("shm_open: ") + std::strerror(errno));
      if (ftruncate(fd, total_) != 0) {
        const int e = errno;
        ::close(fd);
        shm_unlink(name_.c_str());
        fail("create", std::string("ftruncate: ") + std::strerror(e));
      }
    } else {
      // The creator may not have made it yet (the name travels ahead through the store).
      for (;;) {
        fd = shm_open(name_.c_str(), O_RDWR, 0600);
        if (fd >= 0) {
          struct stat st;
          if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= total_) break;
          ::close(fd);
          fd = -1;
        } else if (errno != ENOENT) {
          fail("attach", std::string("shm_open: ") + std::strerror(errno));
        }
        if (Clock::now() >= deadline)
          fail("attach", "timed out after " + std::to_string(timeout_s_) +
                             " s waiting for rank 0 to create the segment");
        usleep(200);
      }
    }
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      if (rank_ == 0) shm_unlink(name_.c_str());
      fail("map", std::string("mmap: ") + std::strerror(e));
    }
    base_ = static_cast<char*>(p);
    Header* h = hdr();
    if (rank_ == 0) {
      // ftruncate zero-fills: every counter starts at 0.
      h->size = size_;
      h->capacity = capacity_;
      h->ring_capacity = ring_capacity_;
      h->total_bytes = total_;
      h->aborted_by.store(-1);
      h->ranks[0].pid.store(getpid());
      h->magic.store(kMagic, std::memory_order_release);
    } else {
      while (h->magic.load(std::memory_order_acquire) != kMagic) {
        if (Clock::now() >= deadline) {
          close();
          fail("attach", "the segment was never initialised by rank 0");
        }
        usleep(100);
      }
      if (h->size != static_cast<uint64_t>(size_) || h->capacity != capacity_ ||
          h->ring_capacity != ring_capacity_) {
        close();
        fail("attach", "the segment was made for another group shape");
      }
      h->ranks[rank_].pid.store(getpid());
    }
    h->attached.fetch_add(1);
    wake(&h->arrivals);
    // Everyone waits until all have attached (a barrier); then the name can go.
    try {
      wait(
          &h->arrivals, [&] { return h->attached.load() >= static_cast<uint32_t>(size_); },
          [&] {
            std::vector<int> missing;
            for (int r = 0; r < size_; ++r)
              if (h->ranks[r].pid.load() == 0) missing.push_back(r);
            return missing;
          },
          "attach");
    } catch (...) {
      close();
      throw;
    }
    if (rank_ == 0) {
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
  }

  std::string name_;
  int rank_, size_;
  double timeout_s_;
  size_t capacity_ = 0, ring_capacity_ = 0, header_bytes_ = 0, channel_bytes_ = 0, total_ = 0;
  char* base_ = nullptr;
  bool unlinked_ = false;
  uint32_t barriers_ = 0;
  uint64_t votes_ = 0;
  uint64_t blocks_ = 0;
  int spins_ = env_int("MD_SHM_SPINS", kSpins);
  int yields_ = env_int("MD_SHM_YIELDS", kYields);
  int blocks_on_ = env_int("MD_SHM_BLOCKS", 1);  // 0: no shared blocks (share gives nullptr)
  uint64_t chunks_ = 0;
  std::mutex mu_, send_mu_, recv_mu_;
};

// A ShmProcessGroup (runtime/shm.py) for the C++ executor: shared memory for what fits (CPU,
// contiguous, a dtype it reduces, at most the group's size limit), its gloo group otherwise.
class ShmComm : public md::Comm {
 public:
  ShmComm(py::handle group, ShmGroup* shm, int64_t size_limit)
      : group_(py::reinterpret_borrow<py::object>(group)), shm_(shm), size_limit_(size_limit) {}

  ~ShmComm() override {
    py::gil_scoped_acquire gil;
    group_ = py::object();
  }

  md::Wait start_all_reduce(at::Tensor& t, const std::string& op) override {
    if (!fits(t) || (op == "avg" && !t.is_floating_point()))
      return fallback().start_all_reduce(t, op);
    shm_->all_reduce(t, op);
    return {};
  }

  md::Wait start_all_reduce_into(at::Tensor& out, const std::vector<at::Tensor>& pieces,
                                 const std::string& op) override {
    bool ok = fits(out) && (op != "avg" || out.is_floating_point());
    for (const auto& p : pieces) ok = ok && fits(p) && p.scalar_type() == out.scalar_type();
    if (!ok) return md::Comm::start_all_reduce_into(out, pieces, op);
    shm_->all_reduce_into(out, pieces, op);
    return {};
  }

  md::Wait start_all_reduce_pieces(std::vector<at::Tensor>& pieces,
                                   const std::string& op) override {
    bool ok = !pieces.empty() && (op != "avg" || pieces[0].is_floating_point());
    int64_t bytes = 0;  // (the bucket's, against the size limit: as all_reduce_into's output)
    for (const auto& p : pieces) {
      ok = ok && fits(p) && p.scalar_type() == pieces[0].scalar_type();
      bytes += p.numel() * p.element_size();
    }
    if (!ok || bytes > size_limit_) return md::Comm::start_all_reduce_pieces(pieces, op);
    shm_->all_reduce_pieces(pieces, op);
    return {};
  }

  // (a bucket over the size limit is all-reduced by gloo: no block for it, on any rank)
  std::shared_ptr<md::SharedBlock> share(size_t bytes, bool ok) override {
    if (static_cast<int64_t>(bytes) > size_limit_) return nullptr;
    return shm_->share(bytes, ok);
  }

  bool all_reduce_shared(md::SharedBlock& block, size_t offset, size_t count,
                         at::ScalarType dtype, const std::string& op, bool ok) override {
    return shm_->all_reduce_shared(block, offset, count, dtype, op, ok);
  }

  md::Wait start_all_gather(std::vector<at::Tensor>& outs, const at::Tensor& input) override {
    bool ok = fits(input);
    for (const auto& o : outs) ok = ok && fits(o);
    if (!ok) return fallback().start_all_gather(outs, input);
    shm_->all_gather_into(outs, input);
    return {};
  }

  md::Wait start_reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& inputs,
                                const std::string& op) override {
    bool ok = fits(out);
    for (const auto& t : inputs) ok = ok && fits(t);
    if (!ok) return fallback().start_reduce_scatter(out, inputs, op);
    shm_->reduce_scatter(out, inputs, op);
    return {};
  }

  md::Wait start_all_to_all(at::Tensor& out, const at::Tensor& input) override {
    return fallback().start_all_to_all(out, input);
  }

  // A send returns at once when the ring has room and no earlier send is still waiting for
  // it; otherwise a thread sends it after the earlier ones (as the Python wrapper's sender
  // does), so a rank that sends and receives in one transfer cannot block its peer.
  md::Wait start_send(at::Tensor& t, int64_t dst, int64_t tag) override {
    if (!fits(t)) return fallback().start_send(t, dst, tag);
    std::lock_guard<std::mutex> g(send_lock_);
    const bool idle = !last_send_.valid() ||
                      last_send_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    if (idle && shm_->try_send(t, static_cast<int>(dst), tag)) return {};
    auto before = last_send_;
    last_send_ = std::async(std::launch::async, [shm = shm_, t, dst, tag, before] {
                   if (before.valid()) before.wait();  // (its error is its own sender's)
                   shm->send(t, static_cast<int>(dst), tag);
                 }).share();
    auto sent = last_send_;
    return [sent] { sent.get(); };
  }

  md::Wait start_recv(at::Tensor& t, int64_t src, int64_t tag) override {
    if (!fits(t)) return fallback().start_recv(t, src, tag);
    shm_->recv(t, static_cast<int>(src), tag);
    return {};
  }

 private:
  bool fits(const at::Tensor& t) const {
    switch (t.scalar_type()) {
      case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kLong:
      case at::kInt: case at::kShort: case at::kChar: case at::kByte:
        break;
      default:
        return false;
    }
    return t.device().is_cpu() && t.is_contiguous() &&
           static_cast<int64_t>(t.numel() * t.element_size()) <= size_limit_;
  }

  // The group's gloo backend, made by Python on first use (every member gets here at the
  // same collective, as the Python path does).
  md::Comm& fallback() {
    std::lock_guard<std::mutex> g(fallback_lock_);
    if (!fallback_) {
      py::gil_scoped_acquire gil;
      fallback_ = md::comm_of(group_.attr("gloo")());
    }
    return *fallback_;
  }

  py::object group_;  // keeps the ShmGroup alive
  ShmGroup* shm_;
  int64_t size_limit_;
  std::mutex fallback_lock_;
  std::shared_ptr<md::Comm> fallback_;
  std::mutex send_lock_;
  std::shared_future<void> last_send_;
};

}  // namespace

std::shared_ptr<md::Comm> md::shm_comm_of(py::handle group) {
  if (!py::hasattr(group, "shm") || !py::isinstance<ShmGroup>(group.attr("shm"))) return nullptr;
  auto* shm = group.attr("shm").cast<ShmGroup*>();
  return std::make_shared<ShmComm>(group, shm, group.attr("size_limit").cast<int64_t>());
}

void bind_shm(py::module& m) {
  py::class_<ShmGroup>(m, "ShmGroup", R"doc(
A shared-memory group of `size` processes on one host (see cpp/shm.cpp). Rank 0 creates the
POSIX segment `name`, the others attach; the name is unlinked once all have attached.
Collectives work in place on contiguous CPU tensors and release the GIL.)doc")
      .def(py::init<std::string, int, int, int64_t, double, int64_t>(), py::arg("name"),
           py::arg("rank"), py::arg("size"), py::arg("capacity_bytes") = 8 << 20,
           py::arg("timeout") = 300.0, py::arg("ring_bytes") = 1 << 20)
      .def("all_reduce", &ShmGroup::all_reduce, py::arg("tensor"), py::arg("op") = "sum")
      .def("all_reduce_into", &ShmGroup::all_reduce_into, py::arg("output"), py::arg("inputs"),
           py::arg("op") = "sum")
      .def("all_reduce_pieces", &ShmGroup::all_reduce_pieces, py::arg("tensors"),
           py::arg("op") = "sum")
      .def("all_gather", &ShmGroup::all_gather, py::arg("tensor"))
      .def("all_gather_into", &ShmGroup::all_gather_into, py::arg("outputs"), py::arg("input"))
      .def("reduce_scatter", &ShmGroup::reduce_scatter, py::arg("output"), py::arg("inputs"),
           py::arg("op") = "sum")
      .def("broadcast", &ShmGroup::broadcast, py::arg("tensor"), py::arg("root"))
      .def("barrier", &ShmGroup::barrier_py)
      .def("send", &ShmGroup::send, py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0)
      .def("try_send", &ShmGroup::try_send, py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0)
      .def("recv", &ShmGroup::recv, py::arg("tensor"), py::arg("src"), py::arg("tag") = 0)
      .def("close", &ShmGroup::close)
      .def_property_readonly("name", &ShmGroup::name)
      .def_property_readonly("rank", &ShmGroup::rank)
      .def_property_readonly("size", &ShmGroup::size)
      .def_property_readonly("capacity", &ShmGroup::capacity)
      .def_property_readonly("closed", &ShmGroup::closed)
      .def_property("timeout", &ShmGroup::timeout, &ShmGroup::set_timeout);
}
