// SparDL's exchange (spardl.h, docs/method-spec.md 4.11): the schedule of a step, one function per
// phase. Every message size follows from the block sizes, k and h, which every rank knows, so no
// counts are exchanged within the reduce-scatter, nor, with one team, in the all-gather; across
// teams the merged lists' sizes travel before them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "gradsparse/kernels.h"
#include "gradsparse/one_pass.h"
#include "gradsparse/spardl.h"

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

namespace {

/// Positions (into `c`) of the `k` candidates of largest magnitude (ties: lowest index), in
/// ascending index order (all of them when there are at most k).
std::vector<size_t> largest(const Candidates& c, size_t k) {
  std::vector<size_t> order(c.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = j;
  k = std::min(k, order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](size_t a, size_t b) {
                      const float ma = std::fabs(c.value[a]), mb = std::fabs(c.value[b]);
                      return ma != mb ? ma > mb : c.index[a] < c.index[b];
                    });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

/// One step of one rank: the team, the blocks, and the accumulation buffer A, which starts as
/// this rank's residual + gradient. A selection from A zeroes what it takes, so at the end A
/// holds exactly what this rank accumulated but did not send on. In float16 A starts divided by
/// P, as DDP's all-reduce divides first: partial sums of P values can exceed float16's largest
/// finite value (65504) where their average does not; run() multiplies A back at the end.
struct Step {
  Transport& transport;
  Device& device;
  const BucketView& bucket;
  SparDLExchange::Sizes sizes;
  int team_size, team, me;
  int64_t chunk;
  Buffer accumulated;
  bool divided_first;  // A started divided by P (divides_first)

  Step(Transport& t, Device& d, const BucketView& b, SparDLExchange::Sizes s)
      : transport(t), device(d), bucket(b), sizes(s) {
    team_size = t.size() / s.teams;
    team = t.rank() / team_size;
    me = t.rank() % team_size;
    chunk = (b.numel + team_size - 1) / team_size;
    const size_t bytes = static_cast<size_t>(b.numel) * dtype_size(b.dtype);
    accumulated = d.allocate(bytes);
    d.copy(accumulated.data(), b.residual != nullptr ? b.residual : b.grad, bytes);
    divided_first = divides_first(b.dtype) && b.numel > 0;
    if (divided_first) d.divide(b.dtype, accumulated.data(), b.numel, static_cast<float>(t.size()));
  }

  int global(int team_rank) const { return team * team_size + team_rank; }
  int64_t begin(int b) const { return std::min<int64_t>(bucket.numel, b * chunk); }
  int64_t length(int b) const { return std::min<int64_t>(bucket.numel, (b + 1) * chunk) - begin(b); }
  void* at(void* base, int b) const {
    return static_cast<unsigned char*>(base) + static_cast<size_t>(begin(b)) * dtype_size(bucket.dtype);
  }
  /// The bytes of a list of at most `pairs` pairs of block b.
  size_t list_bytes(int b, int64_t pairs) const {
    const int64_t count = std::min(pairs, length(b));
    return MessageLayout(static_cast<uint64_t>(count), index_bytes_for(length(b)), bucket.dtype).total_bytes;
  }
  /// The top `pairs` of block b of A (zeroed in A). Where candidates are listed (`listing`: on the
  /// CPU by default), one pass lists those above `bound` (learned from the same step of the
  /// schedule in the last call) and the exact top is taken among them, as Top-k selects;
  /// elsewhere, or when the candidates fall short, the exact top-k's passes over the block. The
  /// same pairs either way.
  Selection top(int b, int64_t pairs, CandidateBound& bound, Listing listing) {
    void* block = at(accumulated.data(), b);
    const BucketView view{bucket.dtype, length(b), block, block};
    pairs = std::min(pairs, length(b));
    if (!lists_candidates(device, listing)) return device.select_topk(view, pairs, /*update=*/false);
    OnePass pass(device, view, bound, pairs, listing, {0, -1}, /*sums=*/false, /*update=*/false);
    Selection s = pass.largest(pairs);
    bound.learn(pass);
    return s;
  }
  MessageView view(const Selection& list, int b) const { return list.view(bucket.dtype, length(b)); }
};

/// Spar-Reduce-Scatter within the team: returns the top h of this rank's own block, holding every
/// team member's contribution.
Selection reduce_scatter(Step& s, std::vector<CandidateBound>& bounds, Listing listing) {
  const std::vector<SrsStep> schedule = srs_schedule(s.team_size, s.me);
  // One bound per selection of the schedule: the blocks sent at steps 0 .. P' - 2, then the own.
  bounds.resize(schedule.size() + 1);
  if (schedule.empty()) return s.top(s.me, s.sizes.h, bounds[0], listing);
  Selection out = s.top(schedule[0].send_block, s.sizes.k, bounds[0], listing);
  for (size_t j = 0; j < schedule.size(); ++j) {
    const SrsStep& step = schedule[j];
    const size_t in_bytes = s.list_bytes(step.recv_block, s.sizes.k);
    Buffer in = s.device.allocate(in_bytes);
    s.transport.sendrecv(s.device, out.message.data(), out.bytes, s.global(step.dest), in.data(), in_bytes,
                         s.global(step.source));
    const MessageView m = read_message(s.device, in.data(), in_bytes, s.bucket.dtype,
                                       static_cast<uint64_t>(s.length(step.recv_block)), s.global(step.source));
    s.device.scatter_add(m, s.at(s.accumulated.data(), step.recv_block), 1.0f);
    // The next block to send; after the last step, the own block (recv_block == me).
    out = j + 1 < schedule.size() ? s.top(schedule[j + 1].send_block, s.sizes.k, bounds[j + 1], listing)
                                  : s.top(step.recv_block, s.sizes.h, bounds[j + 1], listing);
  }
  return out;
}

/// Spar-All-Gather across teams: the owners of block `me` in every team exchange their top-h
/// lists (Bruck rounds among them), sum duplicates in team order (so every owner computes the
/// same union bit for bit), and keep the top k. Returns the final list; `merged` gets the union's size.
Selection merge_across_teams(Step& s, const Selection& own, int64_t& merged) {
  const int teams = s.sizes.teams;
  const size_t own_bytes = own.bytes;  // every owner's top-h list has the same size
  std::vector<std::vector<unsigned char>> slots(teams, std::vector<unsigned char>(own_bytes));
  s.device.copy_to_host(slots[0].data(), own.message.data(), own_bytes);
  for (const BruckRound& round : bruck_rounds(teams, s.team)) {
    std::vector<unsigned char> out, in(own_bytes * round.recv.size());
    for (int b = 0; b < static_cast<int>(round.send.size()); ++b)
      out.insert(out.end(), slots[b].begin(), slots[b].end());
    Buffer send_buffer = s.device.allocate(out.size()), recv_buffer = s.device.allocate(in.size());
    s.device.copy_from_host(send_buffer.data(), out.data(), out.size());
    s.transport.sendrecv(s.device, send_buffer.data(), out.size(), round.dest * s.team_size + s.me, recv_buffer.data(),
                         in.size(), round.source * s.team_size + s.me);
    s.device.copy_to_host(in.data(), recv_buffer.data(), in.size());
    const int gap = round.recv.empty() ? 0 : (round.recv[0] - round.send[0] + teams) % teams;
    for (size_t j = 0; j < round.recv.size(); ++j)
      std::memcpy(slots[gap + j].data(), in.data() + j * own_bytes, own_bytes);
  }
  // Slot j holds team (team + j) mod d's list.
  std::map<int64_t, float> sums;
  for (int t = 0; t < teams; ++t) {
    const int slot = (t - s.team + teams) % teams;
    const int source = t * s.team_size + s.me;
    const HostMessage list(view_host_message(slots[slot].data(), slots[slot].size(), s.bucket.dtype,
                                             static_cast<uint64_t>(s.length(s.me)), source));
    list.check_indices();
    const std::vector<int64_t> index = list.index_list();
    const std::vector<float> value = list.value_list();
    for (size_t j = 0; j < index.size(); ++j) {
      float& v = sums[index[j]];
      v = dispatch_dtype(s.bucket.dtype, [&](auto tt) {
        using T = decltype(tt);
        return Num<T>::to_float(Num<T>::from_float(v + value[j]));
      });
    }
  }
  Candidates u;
  for (const auto& [i, v] : sums) {
    u.index.push_back(i);
    u.value.push_back(v);
  }
  merged = static_cast<int64_t>(u.size());
  const std::vector<size_t> keep = largest(u, static_cast<size_t>(s.sizes.k));
  std::vector<int64_t> index;
  std::vector<float> value;
  for (size_t j : keep) {
    index.push_back(u.index[j]);
    value.push_back(u.value[j]);
  }
  return s.device.emit(BucketView{s.bucket.dtype, s.length(s.me), nullptr, nullptr}, index, value, false);
}

/// The sizes in bytes of the final lists of the blocks `recv`, which this round receives. With one
/// team each is the top h of its block, whose size every rank knows, so none travels; across
/// teams a merged list holds the top k of a union that may be smaller than k, so the lists'
/// sizes are exchanged first (one more message per round).
std::vector<int64_t> list_sizes(Step& s, const BruckRound& round, const std::vector<Selection>& lists) {
  std::vector<int64_t> recv_sizes(round.recv.size());
  if (s.sizes.teams == 1) {
    for (size_t j = 0; j < round.recv.size(); ++j)
      recv_sizes[j] = static_cast<int64_t>(s.list_bytes(round.recv[j], s.sizes.h));
    return recv_sizes;
  }
  std::vector<int64_t> send_sizes;
  for (int b : round.send) send_sizes.push_back(static_cast<int64_t>(lists[b].bytes));
  Buffer ss = s.device.allocate(send_sizes.size() * 8), rs = s.device.allocate(recv_sizes.size() * 8);
  s.device.copy_from_host(ss.data(), send_sizes.data(), send_sizes.size() * 8);
  s.transport.sendrecv(s.device, ss.data(), send_sizes.size() * 8, s.global(round.dest), rs.data(),
                       recv_sizes.size() * 8, s.global(round.source));
  s.device.copy_to_host(recv_sizes.data(), rs.data(), recv_sizes.size() * 8);
  for (size_t j = 0; j < recv_sizes.size(); ++j) {
    // A final list holds at most min(k, block length) pairs: its size is a layout within that.
    const int64_t b = recv_sizes[j], most = static_cast<int64_t>(s.list_bytes(round.recv[j], s.sizes.k));
    GS_CHECK(b >= static_cast<int64_t>(kMessageHeaderBytes) && b <= most && b % 8 == 0, CorruptMessageError,
             "SparDL: rank ", s.global(round.source), " announced a ", b, "-byte list for block ", round.recv[j],
             ", whose lists take 32 to ", most, " bytes in multiples of 8");
  }
  return recv_sizes;
}

/// The Bruck all-gather of the final lists within the team.
void allgather_lists(Step& s, std::vector<Selection>& lists) {
  for (const BruckRound& round : bruck_rounds(s.team_size, s.me)) {
    const std::vector<int64_t> recv_sizes = list_sizes(s, round, lists);
    size_t out_bytes = 0, in_bytes = 0;
    for (int b : round.send) out_bytes += lists[b].bytes;
    for (int64_t b : recv_sizes) in_bytes += static_cast<size_t>(b);
    Buffer out = s.device.allocate(out_bytes), in = s.device.allocate(in_bytes);
    size_t at = 0;
    for (int b : round.send) {
      s.device.copy(out.as<unsigned char>() + at, lists[b].message.data(), lists[b].bytes);
      at += lists[b].bytes;
    }
    s.transport.sendrecv(s.device, out.data(), out_bytes, s.global(round.dest), in.data(), in_bytes,
                         s.global(round.source));
    at = 0;
    for (size_t j = 0; j < round.recv.size(); ++j) {
      const int b = round.recv[j];
      Selection& list = lists[b];
      list.bytes = static_cast<size_t>(recv_sizes[j]);
      list.message = s.device.allocate(list.bytes);
      s.device.copy(list.message.data(), in.as<unsigned char>() + at, list.bytes);
      at += list.bytes;
      const MessageView m = read_message(s.device, list.message.data(), list.bytes, s.bucket.dtype,
                                         static_cast<uint64_t>(s.length(b)), s.global(round.source));
      check_message_size(m, list.bytes);
      list.count = m.count;
    }
  }
}

/// float16: whether any rank keeps, on some final list, a partial sum that float16 cannot hold
/// once multiplied back (several ranks' values past 65504 where their average was finite). Its
/// residual would lose that mass, so every rank learns every rank's count (one all-gather of a
/// count) and, where any is > 0, aborts the step with the residuals untouched (residual +
/// gradient) and `result.unheld` set.
bool unheld_anywhere(Step& s, const std::vector<Selection>& kept, ExchangeResult& result) {
  int64_t mine = 0;
  for (int b = 0; b < s.team_size; ++b) {
    if (kept[b].count == 0) continue;
    for (float v : HostMessage(s.device, s.view(kept[b], b)).value_list()) mine += !std::isfinite(v);
  }
  result.unheld = allgather_counts(s.transport, s.device, {mine}, 8);
  result.aborted = std::any_of(result.unheld.begin(), result.unheld.end(), [](int64_t c) { return c > 0; });
  return result.aborted;
}

}  // namespace

ExchangeResult SparDLExchange::run(Transport& transport, Device& device, const BucketView& bucket,
                                   const Selection& mine) const {
  // Agree on aborting before any data moves (the selection carries the update's non-finite count).
  ExchangeResult result = agree(transport, device, bucket, ControlWord{0, mine.nonfinite, 0}, false);
  if (result.aborted) return result;
  Step s(transport, device, bucket, sizes);

  std::vector<Selection> lists(s.team_size);
  lists[s.me] = reduce_scatter(s, bounds_, listing);
  if (sizes.teams > 1) lists[s.me] = merge_across_teams(s, lists[s.me], result.merged);
  allgather_lists(s, lists);

  // Output: every block's final list / P. Residual: residual + gradient, except on the final
  // lists, where it takes what this rank accumulated and kept (A multiplied back where it was
  // divided first).
  const auto p = static_cast<float>(transport.size());
  if (s.divided_first) device.divide(bucket.dtype, s.accumulated.data(), bucket.numel, 1.0f / p);
  std::vector<MessageView> views(s.team_size);
  std::vector<std::vector<int64_t>> indices(s.team_size);
  for (int b = 0; b < s.team_size; ++b) {
    if (s.length(b) == 0) continue;
    views[b] = s.view(lists[b], b);
    views[b].source_rank = s.global(b);  // the list of block b's owner
    if (bucket.residual != nullptr) {
      const HostMessage list(device, views[b]);
      list.check_indices();  // before the gather below reads A there
      indices[b] = list.index_list();
    }
    result.union_size += views[b].count;
    for (int t = 0; t < sizes.teams; ++t) result.control[t * s.team_size + b].count = views[b].count;
  }
  // What this rank keeps on each final list (read as stored: a partial sum multiplied back past
  // float16's range is Inf there). A step aborted for it leaves the output as it was.
  std::vector<Selection> kept(s.team_size);
  if (bucket.residual != nullptr) {
    for (int b = 0; b < s.team_size; ++b) {
      void* block = s.at(s.accumulated.data(), b);
      if (s.length(b) > 0) kept[b] = device.gather(BucketView{bucket.dtype, s.length(b), block, block}, indices[b]);
    }
    if (s.divided_first && unheld_anywhere(s, kept, result)) return result;
  }
  // Every list is added to the output (scatter_add checks its indices) before any residual is
  // rewritten, so that a corrupt list fails the step with the residual whole (residual + gradient).
  clear_output(device, bucket);
  for (int b = 0; b < s.team_size; ++b)
    if (s.length(b) > 0) device.scatter_add(views[b], s.at(bucket.grad, b), s.divided_first ? 1.0f : p);
  if (bucket.residual == nullptr) return result;
  if (bucket.taken != nullptr) {  // the residual at every position of the final lists, before they rewrite it
    std::vector<int64_t> global;
    for (int b = 0; b < s.team_size; ++b)
      for (int64_t i : indices[b]) global.push_back(s.begin(b) + i);
    *bucket.taken = device.gather(bucket, global);
  }
  for (int b = 0; b < s.team_size; ++b)
    if (s.length(b) > 0) device.assign(s.view(kept[b], b), s.at(bucket.residual, b));
  return result;
}

}  // namespace gradsparse
