// SparDL (docs/method-spec.md 4.11).
//
// The bucket is cut into P' blocks of `chunk` elements (P' = team size = P / d; block b is owned
// by team rank b). Within a team:
//   1. Spar-Reduce-Scatter: P' - 1 steps, each sending the top-k of one block (accumulated with
//      everything received for it so far) to the next rank of a butterfly-like schedule; at the
//      end every rank's own block holds every team member's contribution, of which it keeps the
//      top-h.
//   2. Spar-All-Gather across the d teams (d > 1): the d owners of a block exchange their top-h
//      lists, sum duplicates, keep the top k, and adapt h.
//   3. All-gather within the team (Bruck): every rank gets every block's final list.
// The averaged bucket is the final lists divided by P. Global residual collection: each rank's
// residual is its own residual + gradient everywhere except on the final lists, where it keeps
// what it accumulated but did not send on. Every message size follows from the block sizes, k
// and h, which all ranks know, so no counts are exchanged within the reduce-scatter.
#include "gradsparse/spardl.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "gradsparse/kernels.h"
#include "method_util.h"

namespace gradsparse {

std::vector<SrsStep> srs_schedule(int size, int rank) {
  std::vector<SrsStep> steps;
  if (size <= 1) return steps;
  int rounds = 0;
  while ((1 << rounds) < size) ++rounds;  // R = ceil(log2 P')
  std::vector<int> sizes{size - (1 << (rounds - 1))};
  for (int i = rounds - 2; i >= 0; --i) sizes.push_back(1 << i);
  for (int i = 0; i < rounds; ++i) {
    const int gap = 1 << (rounds - 1 - i);
    for (int j = 0; j < sizes[i]; ++j) {
      steps.push_back(SrsStep{(rank + gap + j) % size, (rank + gap) % size, (rank + j) % size,
                              ((rank - gap) % size + size) % size});
    }
  }
  return steps;
}

std::vector<BruckRound> bruck_rounds(int size, int rank) {
  std::vector<BruckRound> rounds;
  for (int gap = 1; gap < size; gap *= 2) {
    BruckRound round{((rank - gap) % size + size) % size, (rank + gap) % size, {}, {}};
    const int count = std::min(gap, size - gap);
    for (int b = 0; b < count; ++b) {
      round.send.push_back((rank + b) % size);
      round.recv.push_back((rank + gap + b) % size);
    }
    rounds.push_back(std::move(round));
  }
  return rounds;
}

SparDL::SparDL(double density, int teams) : density_(density), teams_(teams) {
  method_util::check_density("SparDL", density);
  GS_CHECK(teams >= 1, ValueError, "SparDL: teams must be >= 1, got ", teams);
}

Selection SparDL::select(Device& /*device*/, const BucketView& /*bucket*/, Collective& /*group*/) {
  throw std::logic_error("SparDL selects inside its own exchange: use run()");
}

namespace {

/// A sparse list in host memory (block-local indices ascending, values as float).
struct HostList {
  std::vector<int64_t> index;
  std::vector<float> value;
};

/// Parses a message already in host memory.
HostList parse_list(const std::vector<unsigned char>& raw, DType dtype, int64_t block) {
  const MessageHeader h = read_header(raw.data(), raw.size(), dtype, static_cast<uint64_t>(block));
  const MessageLayout layout(h.count, h.index_bytes, dtype);
  HostList out;
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_index(h.index_bytes, [&](auto i) {
      using I = decltype(i);
      const auto* idx = reinterpret_cast<const I*>(raw.data() + layout.indices_offset);
      const auto* val = reinterpret_cast<const T*>(raw.data() + layout.values_offset);
      for (uint64_t j = 0; j < h.count; ++j) {
        GS_CHECK(index_in_range(idx[j], block) && (j == 0 || idx[j - 1] < idx[j]), CorruptMessageError,
                 "SparDL: a received list has index ", static_cast<long long>(idx[j]), " at position ", j,
                 " outside its block of ", block, " or out of order");
        out.index.push_back(static_cast<int64_t>(idx[j]));
        out.value.push_back(Num<T>::to_float(val[j]));
      }
    });
  });
  return out;
}

/// Reads a message from device memory.
HostList read_list(Device& device, const void* message, size_t bytes, DType dtype, int64_t block) {
  std::vector<unsigned char> raw(bytes);
  device.copy_to_host(raw.data(), message, bytes);
  return parse_list(raw, dtype, block);
}

}  // namespace

ExchangeResult SparDL::run(Transport& transport, Device& device, const BucketView& bucket) {
  const int p = transport.size(), rank = transport.rank();
  GS_CHECK(p % teams_ == 0, ValueError, "SparDL: the world size ", p, " is not a multiple of teams=", teams_,
           "; choose teams dividing the number of ranks");
  const int team_size = p / teams_, team = rank / team_size, me = rank % team_size;
  auto global = [&](int team_rank) { return team * team_size + team_rank; };
  const int64_t n = bucket.numel;
  const size_t elem = dtype_size(bucket.dtype);
  const int64_t chunk = (n + team_size - 1) / team_size;
  auto begin = [&](int b) { return std::min<int64_t>(n, b * chunk); };
  auto length = [&](int b) { return std::min<int64_t>(n, (b + 1) * chunk) - begin(b); };
  const int64_t k = chunk > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::floor(chunk * density_))) : 0;
  if (chunk != chunk_) {  // h starts at floor(chunk δ / d) for a new bucket size
    chunk_ = chunk;
    h_ = std::max<int64_t>(1, static_cast<int64_t>(std::floor(chunk * density_ / teams_)));
    h_step_ = static_cast<int64_t>(std::floor((chunk * density_ - static_cast<double>(h_)) / 100.0));
    inertia_ = false;
  }
  const int64_t h = teams_ == 1 ? k : h_;
  auto message_bytes = [&](int b, int64_t pairs) {
    const int64_t count = std::min(pairs, length(b));
    return MessageLayout(static_cast<uint64_t>(count), index_bytes_for(length(b)), bucket.dtype).total_bytes;
  };

  // Error feedback, then agree on aborting before any data moves.
  ExchangeResult result;
  const int64_t nonfinite = method_util::update_pass(device, bucket);
  result.control = exchange_control(transport, device, ControlWord{0, 0, nonfinite, 0}, bucket,
                                    /*with_message=*/false);
  if (!result.nonfinite_ranks().empty()) {
    result.aborted = true;
    return result;
  }

  // A: the accumulation buffer, starting from this rank's residual + gradient (O, kept in the
  // residual until the end). A selection zeroes what it takes, so at the end A holds exactly what
  // this rank accumulated but did not send on.
  const void* own = bucket.residual != nullptr ? bucket.residual : bucket.grad;
  Buffer accumulated = device.allocate(static_cast<size_t>(n) * elem);
  device.copy(accumulated.data(), own, static_cast<size_t>(n) * elem);
  auto a_block = [&](int b) { return static_cast<void*>(accumulated.as<unsigned char>() + begin(b) * elem); };
  auto top = [&](int b, int64_t pairs) {
    const BucketView view{bucket.dtype, length(b), a_block(b), a_block(b)};
    return device.select_topk(view, std::min(pairs, length(b)), /*update=*/false);
  };

  // 1. Spar-Reduce-Scatter.
  std::vector<Selection> selected(team_size);
  const std::vector<SrsStep> schedule = srs_schedule(team_size, me);
  if (schedule.empty()) {
    selected[me] = top(me, h);
  } else {
    selected[schedule[0].send_block] = top(schedule[0].send_block, k);
    for (size_t s = 0; s < schedule.size(); ++s) {
      const SrsStep& step = schedule[s];
      const Selection& out = selected[step.send_block];
      const size_t in_bytes = message_bytes(step.recv_block, k);
      Buffer in = device.allocate(in_bytes);
      transport.sendrecv(device, out.message.data(), out.bytes, global(step.dest), in.data(), in_bytes,
                         global(step.source));
      device.scatter_add_message(bucket.dtype, a_block(step.recv_block), length(step.recv_block), in.data(), in_bytes,
                                 1.0f, global(step.source));
      if (s + 1 < schedule.size()) {
        selected[schedule[s + 1].send_block] = top(schedule[s + 1].send_block, k);
      } else {
        selected[step.recv_block] = top(step.recv_block, h);  // the own block (recv_block == me)
      }
    }
  }

  // 2. Spar-All-Gather across teams: the d owners of block `me` agree on its final list.
  HostList final_own = read_list(device, selected[me].message.data(), selected[me].bytes, bucket.dtype, length(me));
  if (teams_ > 1) {
    const size_t own_bytes = selected[me].bytes;  // every owner's top-h list has the same size
    std::vector<std::vector<unsigned char>> slots(teams_, std::vector<unsigned char>(own_bytes));
    device.copy_to_host(slots[0].data(), selected[me].message.data(), own_bytes);
    for (const BruckRound& round : bruck_rounds(teams_, team)) {
      std::vector<unsigned char> out, in(own_bytes * round.recv.size());
      for (int b = 0; b < static_cast<int>(round.send.size()); ++b)
        out.insert(out.end(), slots[b].begin(), slots[b].end());
      Buffer send_buffer = device.allocate(out.size()), recv_buffer = device.allocate(in.size());
      device.copy_from_host(send_buffer.data(), out.data(), out.size());
      transport.sendrecv(device, send_buffer.data(), out.size(), round.dest * team_size + me, recv_buffer.data(),
                         in.size(), round.source * team_size + me);
      device.copy_to_host(in.data(), recv_buffer.data(), in.size());
      const int gap = round.recv.empty() ? 0 : (round.recv[0] - round.send[0] + teams_) % teams_;
      for (size_t j = 0; j < round.recv.size(); ++j)
        std::memcpy(slots[gap + j].data(), in.data() + j * own_bytes, own_bytes);
    }
    // Slot j holds team (team + j) mod d's list: sum duplicates in team order, so every owner
    // computes the same union bit for bit.
    std::map<int64_t, float> sums;
    for (int t = 0; t < teams_; ++t) {
      const HostList list = parse_list(slots[(t - team + teams_) % teams_], bucket.dtype, length(me));
      for (size_t j = 0; j < list.index.size(); ++j) {
        float& v = sums[list.index[j]];
        v = dispatch_dtype(bucket.dtype, [&](auto tt) {
          using T = decltype(tt);
          return Num<T>::to_float(Num<T>::from_float(v + list.value[j]));
        });
      }
    }
    Candidates u;
    for (const auto& [i, v] : sums) {
      u.index.push_back(i);
      u.value.push_back(v);
    }
    const int64_t union_size = static_cast<int64_t>(u.size());
    std::vector<size_t> keep;
    if (union_size > k) {
      keep = method_util::largest(u, static_cast<size_t>(k));
    } else {
      for (size_t j = 0; j < u.size(); ++j) keep.push_back(j);
    }
    final_own = HostList{};
    for (size_t j : keep) {
      final_own.index.push_back(u.index[j]);
      final_own.value.push_back(u.value[j]);
    }
    // Adapt h: keep going (doubling every second time) while the union stays on the same side
    // of k, else turn back at half the step.
    if ((union_size > k) != (h_step_ > 0)) {
      if (inertia_) {
        h_step_ *= 2;
        inertia_ = false;
      } else {
        inertia_ = true;
      }
    } else {
      h_step_ = std::llabs(h_step_) > 1 ? static_cast<int64_t>(-0.5 * static_cast<double>(h_step_)) : -h_step_;
      inertia_ = false;
    }
    h_ = std::max<int64_t>({h_ + h_step_, k / teams_, 1});
  }

  // 3. All-gather of the final lists within the team (sizes first: they vary when d > 1).
  std::vector<Selection> lists(team_size);
  lists[me] =
      device.emit(BucketView{bucket.dtype, length(me), nullptr, nullptr}, final_own.index, final_own.value, false);
  for (const BruckRound& round : bruck_rounds(team_size, me)) {
    std::vector<int64_t> send_sizes, recv_sizes(round.recv.size());
    for (int b : round.send) send_sizes.push_back(static_cast<int64_t>(lists[b].bytes));
    Buffer ss = device.allocate(send_sizes.size() * 8), rs = device.allocate(recv_sizes.size() * 8);
    device.copy_from_host(ss.data(), send_sizes.data(), send_sizes.size() * 8);
    transport.sendrecv(device, ss.data(), send_sizes.size() * 8, global(round.dest), rs.data(), recv_sizes.size() * 8,
                       global(round.source));
    device.copy_to_host(recv_sizes.data(), rs.data(), recv_sizes.size() * 8);
    size_t out_bytes = 0, in_bytes = 0;
    for (int64_t b : send_sizes) out_bytes += static_cast<size_t>(b);
    for (size_t j = 0; j < recv_sizes.size(); ++j) {
      // A final list holds at most min(k, block length) pairs: its size is a layout within that.
      const int64_t b = recv_sizes[j], most = static_cast<int64_t>(message_bytes(round.recv[j], k));
      GS_CHECK(b >= static_cast<int64_t>(kMessageHeaderBytes) && b <= most && b % 8 == 0, CorruptMessageError,
               "SparDL: rank ", global(round.source), " announced a ", b, "-byte list for block ", round.recv[j],
               ", whose lists take 32 to ", most, " bytes in multiples of 8");
      in_bytes += static_cast<size_t>(b);
    }
    Buffer out = device.allocate(out_bytes), in = device.allocate(in_bytes);
    size_t at = 0;
    for (int b : round.send) {
      device.copy(out.as<unsigned char>() + at, lists[b].message.data(), lists[b].bytes);
      at += lists[b].bytes;
    }
    transport.sendrecv(device, out.data(), out_bytes, global(round.dest), in.data(), in_bytes, global(round.source));
    at = 0;
    for (size_t j = 0; j < round.recv.size(); ++j) {
      Selection& list = lists[round.recv[j]];
      list.bytes = static_cast<size_t>(recv_sizes[j]);
      list.message = device.allocate(list.bytes);
      device.copy(list.message.data(), in.as<unsigned char>() + at, list.bytes);
      at += list.bytes;
      const MessageHeader h = read_device_header(device, list.message.data(), list.bytes, bucket.dtype,
                                                 length(round.recv[j]), global(round.source));
      check_message_size(h, list.bytes, global(round.source));
    }
  }

  // Output: every block's final list / P. Residual: O, except on the final lists, where it takes
  // what this rank accumulated and kept.
  device.fill_zero(bucket.grad, static_cast<size_t>(n) * elem);
  for (int b = 0; b < team_size; ++b) {
    if (length(b) == 0) continue;
    auto* out = static_cast<unsigned char*>(bucket.grad) + begin(b) * elem;
    device.scatter_add_message(bucket.dtype, out, length(b), lists[b].message.data(), lists[b].bytes,
                               static_cast<float>(p), global(b));
    if (bucket.residual != nullptr) {
      const HostList list = read_list(device, lists[b].message.data(), lists[b].bytes, bucket.dtype, length(b));
      const Selection kept = device.gather(BucketView{bucket.dtype, length(b), a_block(b), nullptr}, list.index);
      device.assign_message(bucket.dtype, static_cast<unsigned char*>(bucket.residual) + begin(b) * elem, length(b),
                            kept.message.data(), kept.bytes);
    }
    const MessageHeader h =
        read_device_header(device, lists[b].message.data(), lists[b].bytes, bucket.dtype, length(b), -1);
    result.union_size += static_cast<int64_t>(h.count);
    for (int t = 0; t < teams_; ++t) result.control[t * team_size + b].count = static_cast<int64_t>(h.count);
  }
  return result;
}

MethodState SparDL::state() const {
  return {{"chunk", static_cast<double>(chunk_)},
          {"h", static_cast<double>(h_)},
          {"h_step", static_cast<double>(h_step_)},
          {"inertia", inertia_ ? 1.0 : 0.0}};
}

void SparDL::load_state(const MethodState& state) {
  chunk_ = static_cast<int64_t>(state.at("chunk"));
  h_ = static_cast<int64_t>(state.at("h"));
  h_step_ = static_cast<int64_t>(state.at("h_step"));
  inertia_ = state.at("inertia") != 0.0;
}

}  // namespace gradsparse
