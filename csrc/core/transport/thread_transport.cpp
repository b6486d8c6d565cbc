// ThreadTransport: N ranks as threads sharing one ThreadGroup. A collective publishes each rank's
// pointer in a slot, meets at a barrier, reads the other slots, and meets again so that no rank
// reuses its buffer while another still reads it.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/transport.h"

namespace gradsparse {
namespace {

class ThreadGroupImpl;

class ThreadTransport final : public Transport {
 public:
  ThreadTransport(std::shared_ptr<ThreadGroupImpl> group, int rank);
  int rank() const override { return rank_; }
  int size() const override;
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override;
  void allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) override;
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override;
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override;

 private:
  std::shared_ptr<ThreadGroupImpl> group_;
  int rank_;
};

class ThreadGroupImpl final : public ThreadGroup {
 public:
  ThreadGroupImpl(int size, std::chrono::milliseconds timeout)
      : size_(size),
        timeout_(timeout),
        inbox_(static_cast<size_t>(size)),
        slots_(size),
        sizes_(size),
        ops_(size),
        lists_(size),
        mailbox_(static_cast<size_t>(size) * size) {}

  std::unique_ptr<Transport> transport(int rank) override {
    GS_CHECK(rank >= 0 && rank < size_, ValueError, "ThreadGroup.transport: rank ", rank, " is outside [0, ", size_,
             ")");
    return std::make_unique<ThreadTransport>(std::static_pointer_cast<ThreadGroupImpl>(shared_from_this()), rank);
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = reason.empty() ? "aborted" : reason;
    wake_all();
  }

  int size() const { return size_; }

  /// Point-to-point: a FIFO mailbox per (source, destination) pair.
  void post(int from, int to, const void* data, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    mailbox_[static_cast<size_t>(from) * size_ + to].emplace_back(static_cast<const char*>(data),
                                                                  static_cast<const char*>(data) + bytes);
    inbox_[static_cast<size_t>(to)].notify_all();  // only `to` waits on its inbox
  }

  std::vector<char> take(int from, int to) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& box = mailbox_[static_cast<size_t>(from) * size_ + to];
    const bool arrived =
        inbox_[static_cast<size_t>(to)].wait_for(lock, timeout_, [&] { return !box.empty() || !aborted_.empty(); });
    throw_if_aborted(to);
    if (!arrived) {
      aborted_ = str("rank ", to, " waited ", timeout_.count(), " ms for a message from rank ", from);
      wake_all();
      throw_if_aborted(to);
    }
    std::vector<char> message = std::move(box.front());
    box.pop_front();
    return message;
  }

  /// Publishes (pointer, size, collective, and allgatherv's size list) for `rank` and waits for
  /// every rank; returns a consistent view.
  void publish(int rank, const void* ptr, size_t bytes, std::string op, const std::vector<size_t>* list = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_[rank] = ptr;
      sizes_[rank] = bytes;
      ops_[rank] = std::move(op);
      lists_[rank] = list;
    }
    barrier(rank);
  }

  const void* slot(int rank) const { return slots_[rank]; }
  size_t slot_size(int rank) const { return sizes_[rank]; }
  const std::string& slot_op(int rank) const { return ops_[rank]; }
  const std::vector<size_t>* slot_list(int rank) const { return lists_[rank]; }

  /// Generation barrier with timeout and abort.
  void barrier(int rank) {
    std::unique_lock<std::mutex> lock(mu_);
    throw_if_aborted(rank);
    const uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done = cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || !aborted_.empty(); });
    if (generation_ != gen) return;
    if (!done && aborted_.empty()) {
      aborted_ = str("rank ", rank, " waited ", timeout_.count(),
                     " ms for the other ranks at a collective; a rank has stopped or took another path");
      wake_all();
    }
    throw_if_aborted(rank);
  }

 private:
  /// After an abort: every rank waiting anywhere wakes up and throws. Called with mu_ held.
  void wake_all() {
    cv_.notify_all();
    for (std::condition_variable& inbox : inbox_) inbox.notify_all();
  }
  void throw_if_aborted(int rank) const {
    if (!aborted_.empty()) throw CommError(str("ThreadTransport rank ", rank, ": ", aborted_));
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;                  ///< the barrier's
  std::vector<std::condition_variable> inbox_;  ///< each rank's, for the messages posted to it
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string aborted_;
  std::vector<const void*> slots_;
  std::vector<size_t> sizes_;
  std::vector<std::string> ops_;                   ///< the collective each rank issued (allreduce_sum with its dtype)
  std::vector<const std::vector<size_t>*> lists_;  ///< the size list each rank passed to allgatherv
  std::vector<std::deque<std::vector<char>>> mailbox_;
};

ThreadTransport::ThreadTransport(std::shared_ptr<ThreadGroupImpl> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

int ThreadTransport::size() const { return group_->size(); }

void check_cpu(const Device& device, const char* op) {
  GS_CHECK(device.kind() == DeviceKind::kCPU, ValueError, "ThreadTransport.", op,
           " needs CPU buffers; it runs ranks as threads of one process");
}

/// The error of a rank whose peers issued another collective (or an all-reduce of another dtype)
/// over as many bytes: they would have read each other's buffers as their own kind. Every rank
/// sees the difference, so every rank raises. Empty when all agree.
std::string other_collective(ThreadGroupImpl& g, int rank) {
  for (int r = 0; r < g.size(); ++r) {
    if (g.slot_op(r) != g.slot_op(rank))
      return str("ThreadTransport.", g.slot_op(rank), ": rank ", r, " issued ", g.slot_op(r), " but rank ", rank,
                 " issued ", g.slot_op(rank), "; every rank must issue the same collective");
  }
  return "";
}

/// A size list as allgatherv's errors show it: [4, 0, 8].
std::string size_list(const std::vector<size_t>& sizes) {
  std::string text = "[";
  for (size_t r = 0; r < sizes.size(); ++r) text += (r == 0 ? "" : ", ") + std::to_string(sizes[r]);
  return text + "]";
}

void check_sizes_agree(ThreadGroupImpl& g, int rank, const char* op) {
  const std::string other = other_collective(g, rank);
  GS_CHECK(other.empty(), CommError, other);
  for (int r = 0; r < g.size(); ++r) {
    GS_CHECK(g.slot_size(r) == g.slot_size(rank), CommError, "ThreadTransport.", op, ": rank ", r, " passed ",
             g.slot_size(r), " bytes but rank ", rank, " passed ", g.slot_size(rank),
             "; every rank must issue the same collective");
  }
}

void ThreadTransport::allgather(const Device& device, const void* send, void* recv, size_t bytes) {
  check_cpu(device, "allgather");
  GS_CHECK(bytes > 0, ValueError, "ThreadTransport.allgather: zero-length collective");
  group_->publish(rank_, send, bytes, "allgather");
  std::string error;
  try {
    check_sizes_agree(*group_, rank_, "allgather");
  } catch (const CommError& e) {
    error = e.what();
  }
  if (error.empty()) {
    for (int r = 0; r < group_->size(); ++r) std::memcpy(static_cast<char*>(recv) + r * bytes, group_->slot(r), bytes);
  }
  group_->barrier(rank_);
  if (!error.empty()) throw CommError(error);
  count_allgather(bytes);
}

void ThreadTransport::allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) {
  check_cpu(device, "allgatherv");
  check_allgatherv(sizes, "ThreadTransport");
  group_->publish(rank_, send, sizes[rank_], "allgatherv", &sizes);
  // Every rank compares every rank's size list with its own (all were published, as every rank
  // issued allgatherv): where any two differ, each rank finds one that differs from its own, so
  // every rank raises, not only those whose own blocks were misjudged.
  std::string error = other_collective(*group_, rank_);
  for (int r = 0; r < group_->size() && error.empty(); ++r) {
    if (*group_->slot_list(r) != sizes)
      error = str("ThreadTransport.allgatherv: rank ", r, " passed the sizes ", size_list(*group_->slot_list(r)),
                  " but rank ", rank_, " passed ", size_list(sizes), "; every rank must pass the same sizes");
  }
  if (error.empty()) {
    const std::vector<size_t> offsets = block_offsets(sizes);
    for (int r = 0; r < group_->size(); ++r)
      if (sizes[r] > 0) std::memcpy(static_cast<char*>(recv) + offsets[r], group_->slot(r), sizes[r]);
  }
  group_->barrier(rank_);
  if (!error.empty()) throw CommError(error);
  count_allgatherv(sizes);
}

void ThreadTransport::allreduce_sum(const Device& device, void* data, size_t count, DType dtype) {
  check_cpu(device, "allreduce_sum");
  const size_t bytes = count * dtype_size(dtype);
  GS_CHECK(bytes > 0, ValueError, "ThreadTransport.allreduce_sum: zero-length collective");
  group_->publish(rank_, data, bytes, str("allreduce_sum of ", dtype_name(dtype)));
  std::string error;
  try {
    check_sizes_agree(*group_, rank_, "allreduce_sum");
  } catch (const CommError& e) {
    error = e.what();
  }
  // Every rank sums all contributions in rank order into scratch: identical results everywhere.
  std::vector<unsigned char> sum(bytes);
  auto add_up = [&](auto zero, auto load, auto store) {
    for (size_t i = 0; i < count; ++i) {
      auto acc = zero;
      for (int r = 0; r < group_->size(); ++r) acc += load(group_->slot(r), i);
      store(sum.data(), i, acc);
    }
  };
  if (error.empty()) {
    if (dtype == DType::kFloat64) {
      add_up(
          0.0, [](const void* p, size_t i) { return static_cast<const double*>(p)[i]; },
          [](void* p, size_t i, double v) { static_cast<double*>(p)[i] = v; });
    } else if (dtype == DType::kInt64) {
      add_up(
          int64_t{0}, [](const void* p, size_t i) { return static_cast<const int64_t*>(p)[i]; },
          [](void* p, size_t i, int64_t v) { static_cast<int64_t*>(p)[i] = v; });
    } else {
      dispatch_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        add_up(
            0.0f, [](const void* p, size_t i) { return Num<T>::to_float(static_cast<const T*>(p)[i]); },
            [](void* p, size_t i, float v) { static_cast<T*>(p)[i] = Num<T>::from_float(v); });
      });
    }
  }
  group_->barrier(rank_);  // everyone has read every slot
  if (!error.empty()) throw CommError(error);
  std::memcpy(data, sum.data(), bytes);
  count_allreduce(bytes);
}

void ThreadTransport::sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv,
                               size_t recv_bytes, int src) {
  check_cpu(device, "sendrecv");
  GS_CHECK(dst >= 0 && dst < size() && src >= 0 && src < size(), ValueError, "ThreadTransport.sendrecv: peer ", dst,
           "/", src, " is outside the group of ", size());
  if (send_bytes > 0) group_->post(rank_, dst, send, send_bytes);
  if (recv_bytes > 0) {
    const std::vector<char> message = group_->take(src, rank_);
    GS_CHECK(message.size() == recv_bytes, CommError, "ThreadTransport.sendrecv: rank ", rank_, " expected ",
             recv_bytes, " bytes from rank ", src, " but got ", message.size(),
             "; every pair must agree on message sizes");
    std::memcpy(recv, message.data(), recv_bytes);
  }
  count_sendrecv(send_bytes, recv_bytes);
}

}  // namespace

std::shared_ptr<ThreadGroup> ThreadGroup::create(int size, std::chrono::milliseconds timeout) {
  GS_CHECK(size >= 1, ValueError, "ThreadGroup: size must be >= 1, got ", size);
  return std::make_shared<ThreadGroupImpl>(size, timeout);
}

}  // namespace gradsparse
