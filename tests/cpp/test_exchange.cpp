// The exchanges, each alone, and reduce_bucket over ThreadTransport, 1 to 8 ranks, against a
// reference computed from all ranks' data; mass conservation; the non-finite policy; faults.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/exchange.h"
#include "gradsparse/methods.h"
#include "gradsparse/numeric.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/spardl.h"
#include "reference.h"
#include "threads.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;
using gradsparse::testing::Forwarding;
using gradsparse::testing::OnError;
using gradsparse::testing::rethrow_first;
using gradsparse::testing::run_ranks;

namespace {

constexpr int64_t kN = 40000;

std::vector<float> grad_of(int rank, int64_t n = kN) { return ref::random_vector<float>(n, 100 + rank); }
std::vector<float> residual_of(int rank, int64_t n = kN) { return ref::random_vector<float>(n, 200 + rank, 0.3f); }

enum class Kind { kTopK, kThreshold };

std::unique_ptr<Method> make_method(Kind kind) {
  if (kind == Kind::kTopK) return std::make_unique<TopK>(0.01);
  return std::make_unique<Threshold>(2.0);
}

class GatherAdd : public ::testing::TestWithParam<std::tuple<int, Kind>> {};

// With P ranks, the result must be sum over ranks of the reference selection / P, added in rank
// order (bit-identical), on every rank; and for every element, P * update + sum of new residuals
// must equal sum of (grad + old residual) (docs/method-spec.md ruling 6).
TEST_P(GatherAdd, MatchesReferenceAndConservesMass) {
  const auto [p, kind] = GetParam();
  std::vector<float> expected(kN, 0.0f);
  std::vector<std::vector<float>> want_residuals(p);
  std::vector<double> mass_before(kN, 0.0);
  for (int r = 0; r < p; ++r) {
    std::vector<float> res = residual_of(r);
    const std::vector<float> g = grad_of(r);
    for (int64_t i = 0; i < kN; ++i) mass_before[i] += double(res[i]) + double(g[i]);
    const auto pairs = kind == Kind::kTopK ? ref::topk(&res, g, target_count(0.01, kN)) : ref::threshold(&res, g, 2.0);
    for (size_t j = 0; j < pairs.indices.size(); ++j) expected[pairs.indices[j]] += pairs.values[j] / float(p);
    want_residuals[r] = res;
  }
  std::vector<std::vector<float>> outputs(p), residuals(p);
  std::vector<ReduceReport> reports(p);
  rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
    CpuDevice device;
    outputs[rank] = grad_of(rank);
    residuals[rank] = residual_of(rank);
    auto method = make_method(kind);
    BucketView bucket{DType::kFloat32, kN, outputs[rank].data(), residuals[rank].data()};
    reports[rank] = reduce_bucket(method.get(), transport, device, bucket, ReduceOptions{});
  }));
  for (int r = 0; r < p; ++r) {
    ASSERT_EQ(outputs[r], expected) << "rank " << r;
    ASSERT_EQ(residuals[r], want_residuals[r]) << "rank " << r;
    EXPECT_EQ(reports[r].selected_all, reports[0].selected_all);
    EXPECT_EQ(reports[r].traffic.bytes_sent > 0, p > 1);  // one rank moves nothing
  }
  for (int64_t i = 0; i < kN; ++i) {
    double after = double(p) * outputs[0][i];
    for (int r = 0; r < p; ++r) after += residuals[r][i];
    ASSERT_NEAR(after, mass_before[i], 1e-5 * (1.0 + std::fabs(mass_before[i]))) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GatherAdd,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Values(Kind::kTopK, Kind::kThreshold)));

// The sparse reduce-scatter (ReduceOptions::shard_only): each rank's shard equals gather-and-add's
// result there, bit for bit, zeros elsewhere; the residuals are gather-and-add's; and a rank sends
// less (its pairs once, not once per peer) from 3 ranks on.
TEST(ScatterToOwners, EachShardEqualsGatherAndAdd) {
  const int64_t n = 40320;  // divisible by 1 to 8
  for (int p = 1; p <= 8; ++p) {
    for (Kind kind : {Kind::kTopK, Kind::kThreshold}) {
      std::vector<std::vector<float>> outputs[2], residuals[2];
      std::vector<ReduceReport> reports[2];
      for (int mode = 0; mode < 2; ++mode) {
        outputs[mode].resize(p);
        residuals[mode].resize(p);
        reports[mode].resize(p);
        rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
          CpuDevice device;
          outputs[mode][rank] = grad_of(rank, n);
          residuals[mode][rank] = residual_of(rank, n);
          auto method = make_method(kind);
          BucketView bucket{DType::kFloat32, n, outputs[mode][rank].data(), residuals[mode][rank].data()};
          ReduceOptions options;
          options.shard_only = mode == 1;
          reports[mode][rank] = reduce_bucket(method.get(), transport, device, bucket, options);
        }));
      }
      const int64_t shard = n / p;
      for (int r = 0; r < p; ++r) {
        ASSERT_EQ(residuals[1][r], residuals[0][r]) << "p=" << p << " rank " << r;
        for (int64_t i = 0; i < n; ++i) {
          const float want = i / shard == r ? outputs[0][r][i] : 0.0f;
          ASSERT_EQ(outputs[1][r][i], want) << "p=" << p << " rank " << r << " element " << i;
        }
        EXPECT_EQ(reports[1][r].selected_all, reports[0][r].selected_all);
        if (p >= 3) EXPECT_LT(reports[1][r].traffic.bytes_received, reports[0][r].traffic.bytes_received);
      }
    }
  }
}

// Refused before the selection, on every rank: the residual is as it was (the selection used to
// zero its entries first).
TEST(ScatterToOwners, RefusesABucketThatDoesNotSplitIntoEqualShards) {
  const auto errors = run_ranks(3, [&](int rank, Transport& transport) {
    CpuDevice device;
    std::vector<float> grad = grad_of(rank, 1000), residual = residual_of(rank, 1000);
    TopK method(0.01);
    BucketView bucket{DType::kFloat32, 1000, grad.data(), residual.data()};
    ReduceOptions options;
    options.shard_only = true;
    try {
      reduce_bucket(&method, transport, device, bucket, options);
    } catch (...) {
      EXPECT_EQ(residual, residual_of(rank, 1000)) << "rank " << rank;
      throw;
    }
  });
  for (const std::exception_ptr& error : errors) {
    ASSERT_TRUE(error);
    try {
      std::rethrow_exception(error);
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("does not split into 3 equal shards"), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Each exchange alone (exchange.h), run on hand-made selections: rank r selects the indices
// {i : i % (r + 2) == 0} of a bucket of 60 (ranks overlap on multiples of 6, 12, ...), or, for the
// shared and fixed-size exchanges, the same 20 indices on every rank.

constexpr int64_t kSmall = 60;

std::vector<int64_t> indices_of(int rank, bool shared) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < kSmall; ++i)
    if (shared ? i % 3 == 0 : i % (rank + 2) == 0) out.push_back(i);
  return out;
}

/// Every rank's result and residual after `exchange` ran on the selection indices_of(rank): the
/// selection's values are the rank's residual there (gradient zero), so what the exchange moves
/// is known from the residuals alone.
struct Outcome {
  std::vector<std::vector<float>> output, residual;
  std::vector<ExchangeResult> result;
  std::vector<Traffic> traffic;
};

Outcome run_exchange(const Exchange& exchange, int p, bool shared) {
  Outcome o{std::vector<std::vector<float>>(p), std::vector<std::vector<float>>(p), std::vector<ExchangeResult>(p),
            std::vector<Traffic>(p)};
  rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
    CpuDevice device;
    o.output[rank].assign(kSmall, 0.0f);
    o.residual[rank] = residual_of(rank, kSmall);
    const BucketView bucket{DType::kFloat32, kSmall, o.output[rank].data(), o.residual[rank].data()};
    const Selection mine = device.gather(bucket, indices_of(rank, shared));
    if (exchange.selection_zeroes()) device.zero_at(bucket, mine.view(bucket));
    o.result[rank] = exchange.run(transport, device, bucket, mine);
    o.traffic[rank] = transport.traffic();
  }));
  return o;
}

/// sum over ranks of `value(r, i)` / P at every element some rank selected, in rank order.
std::vector<float> average_of(int p, bool shared, const std::function<float(int, int64_t)>& value) {
  std::vector<float> want(kSmall, 0.0f);
  for (int r = 0; r < p; ++r)
    for (int64_t i : indices_of(r, shared)) want[i] += value(r, i) / float(p);
  return want;
}

TEST(EachExchange, GatherAndAddAddsEveryRanksPairs) {
  for (int p : {1, 2, 3, 5}) {
    const Outcome o = run_exchange(gather_and_add(), p, false);
    const auto want = average_of(p, false, [](int r, int64_t i) { return residual_of(r, kSmall)[i]; });
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(o.output[r], want) << "P=" << p << " rank " << r;
      for (int64_t i : indices_of(r, false)) ASSERT_EQ(o.residual[r][i], 0.0f);
      EXPECT_EQ(o.result[r].union_size, o.result[r].total_count());
      EXPECT_EQ(o.traffic[r].collectives, 2);  // control words, messages
    }
  }
}

TEST(EachExchange, FixedGatherIsOneCollectiveWithTheSameResult) {
  for (int p : {1, 2, 4}) {
    const Outcome fixed = run_exchange(fixed_gather(), p, true), gathered = run_exchange(gather_and_add(), p, true);
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(fixed.output[r], gathered.output[r]) << "P=" << p;
      EXPECT_EQ(fixed.traffic[r].collectives, 1);  // the messages only: no control words
      EXPECT_EQ(gathered.traffic[r].collectives, 2);
      // The same messages; each rank's fixed-size one carries its 32-byte header where the
      // gathered one travels bare after an 8-byte control word.
      EXPECT_EQ(fixed.traffic[r].bytes_sent - gathered.traffic[r].bytes_sent,
                (p - 1) * static_cast<int64_t>(kMessageHeaderBytes - control_bytes(kSmall)))
          << "P=" << p;
    }
  }
}

TEST(EachExchange, UnionAllreduceSumsEveryRanksValueOnTheUnion) {
  for (int p : {1, 2, 3, 5}) {
    const Outcome o = run_exchange(union_allreduce(), p, false);
    std::vector<bool> in_union(kSmall, false);
    for (int r = 0; r < p; ++r)
      for (int64_t i : indices_of(r, false)) in_union[i] = true;
    std::vector<float> want(kSmall, 0.0f);
    for (int64_t i = 0; i < kSmall; ++i) {
      if (!in_union[i]) continue;
      float sum = 0.0f;  // the all-reduce sums every rank's value, selected there or not
      for (int r = 0; r < p; ++r) sum += residual_of(r, kSmall)[i];
      want[i] = sum / float(p);
    }
    for (int r = 0; r < p; ++r) {
      for (int64_t i = 0; i < kSmall; ++i) ASSERT_NEAR(o.output[r][i], want[i], 1e-6f) << "P=" << p << " i " << i;
      ASSERT_EQ(o.output[r], o.output[0]);  // bit-identical on every rank
      for (int64_t i = 0; i < kSmall; ++i)
        ASSERT_EQ(o.residual[r][i], in_union[i] ? 0.0f : residual_of(r, kSmall)[i]);  // zeroed on the union
      EXPECT_EQ(o.result[r].union_size, std::count(in_union.begin(), in_union.end(), true));
    }
  }
}

// The union of ascending lists equals sorting their concatenation and dropping repeats, for any
// number of lists (odd ones out of the pairing too), empty lists and lists that overlap.
TEST(AscendingUnion, EqualsTheSortedConcatenationWithoutRepeats) {
  std::mt19937_64 rng(3);
  for (size_t count : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{5}, size_t{8}, size_t{9}}) {
    for (int64_t range : {int64_t{10}, int64_t{1000}}) {
      std::vector<std::vector<int64_t>> lists(count);
      std::vector<int64_t> want;
      for (size_t i = 0; i < count; ++i) {
        const size_t length = i == 1 ? 0 : rng() % 40;  // the second list is empty
        for (size_t j = 0; j < length; ++j) lists[i].push_back(static_cast<int64_t>(rng() % range));
        std::sort(lists[i].begin(), lists[i].end());
        lists[i].erase(std::unique(lists[i].begin(), lists[i].end()), lists[i].end());
        want.insert(want.end(), lists[i].begin(), lists[i].end());
      }
      std::sort(want.begin(), want.end());
      want.erase(std::unique(want.begin(), want.end()), want.end());
      EXPECT_EQ(ascending_union(lists), want) << count << " lists in [0, " << range << ")";
    }
  }
}

TEST(EachExchange, SharedIndicesAllreducesTheValuesAndRefusesOtherIndices) {
  for (int p : {1, 2, 4}) {
    const Outcome o = run_exchange(shared_indices(), p, true);
    const auto want = average_of(p, true, [](int r, int64_t i) { return residual_of(r, kSmall)[i]; });
    for (int r = 0; r < p; ++r) {
      for (int64_t i = 0; i < kSmall; ++i) ASSERT_NEAR(o.output[r][i], want[i], 1e-6f) << "P=" << p << " i " << i;
      EXPECT_EQ(o.traffic[r].collectives, 2);  // control words, values
    }
  }
  // Rank 2 draws other indices; every rank refuses, whether the digests were kept with the
  // selections (as Random-k and Random-block keep them) or hashed from the messages.
  for (bool kept : {true, false}) {
    const auto errors = run_ranks(3, [&](int rank, Transport& transport) {
      CpuDevice device;
      std::vector<float> out(kSmall, 0.0f), residual = residual_of(rank, kSmall);
      const BucketView bucket{DType::kFloat32, kSmall, out.data(), residual.data()};
      const std::vector<int64_t> drawn = indices_of(rank, rank != 2);
      Selection mine = device.gather(bucket, drawn);
      if (kept) mine.index_digest = index_digest(drawn.data(), drawn.size());
      shared_indices().run(transport, device, bucket, mine);
    });
    for (const std::exception_ptr& error : errors) EXPECT_THROW(std::rethrow_exception(error), CorruptMessageError);
  }
}

// An exchange that fails (here every rank refuses: rank 2 drew other indices for the shared
// exchange) delivers nothing, so the selection goes back to the residual: the gradient's mass is
// kept there, and no element was zeroed.
TEST(ReduceBucket, AFailedExchangeGivesTheSelectionBackToTheResidual) {
  const int64_t n = 5000;
  const auto errors = run_ranks(3, [&](int rank, Transport& transport) {
    CpuDevice device;
    std::vector<float> grad = grad_of(rank, n), residual = residual_of(rank, n);
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = residual[i] + grad[i];  // the update, exact in float32
    RandomK method(0.05, rank == 2 ? 9 : 3);
    BucketView bucket{DType::kFloat32, n, grad.data(), residual.data()};
    try {
      reduce_bucket(&method, transport, device, bucket, ReduceOptions{});
    } catch (...) {
      EXPECT_EQ(residual, want) << "rank " << rank;
      throw;
    }
  });
  for (const std::exception_ptr& error : errors) EXPECT_THROW(std::rethrow_exception(error), CorruptMessageError);
}

/// A transport whose all-reduces move the data, then report a failure (as a collective that
/// fails on its wait may leave its buffer written).
class FailingAllreduce final : public Forwarding {
 public:
  using Forwarding::Forwarding;
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override {
    Forwarding::allreduce_sum(device, data, count, dtype);
    throw CommError("the all-reduce failed");
  }
};

// The shared exchange sums its values in a copy of the selection, so that a step whose all-reduce
// fails gives the selection back to the residual as it was made: float16's values divided by P
// before the sum, or float32's summed over the ranks, would have come back in their place.
TEST(ReduceBucket, AFailedAllreduceGivesTheSharedSelectionBackToTheResidual) {
  const int p = 3;
  const int64_t n = 500;
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    const auto errors = run_ranks(p, [&](int rank, Transport& transport) {
      FailingAllreduce failing(transport);
      CpuDevice device;
      const std::vector<float> g = grad_of(rank, n), old = residual_of(rank, n);
      auto run = [&](auto zero) {
        using T = decltype(zero);
        std::vector<T> grad(n), residual(n);
        std::vector<float> want(n), got(n);  // the update, residual + gradient in T
        for (int64_t i = 0; i < n; ++i) {
          grad[i] = Num<T>::from_float(g[i]);
          residual[i] = Num<T>::from_float(old[i]);
          want[i] = Num<T>::to_float(Num<T>::from_float(Num<T>::to_float(residual[i]) + Num<T>::to_float(grad[i])));
        }
        RandomK method(0.05, 3);
        try {
          reduce_bucket(&method, failing, device, BucketView{dtype, n, grad.data(), residual.data()}, ReduceOptions{});
        } catch (...) {
          for (int64_t i = 0; i < n; ++i) got[i] = Num<T>::to_float(residual[i]);
          EXPECT_EQ(got, want) << dtype_name(dtype) << " rank " << rank;
          throw;
        }
      };
      if (dtype == DType::kFloat32) run(float{});
      if (dtype == DType::kFloat16) run(Half{});
    });
    for (const std::exception_ptr& error : errors) EXPECT_THROW(std::rethrow_exception(error), CommError);
  }
}

// The shared exchange's digest tells index lists apart by their members, order and length.
TEST(EachExchange, SharedIndicesDigestTellsListsApart) {
  const std::vector<int64_t> a{1, 2, 3}, b{1, 2, 4}, c{2, 1, 3}, d{1, 2, 3, 0};
  const int64_t da = index_digest(a.data(), a.size());
  EXPECT_NE(da, index_digest(b.data(), b.size()));
  EXPECT_NE(da, index_digest(c.data(), c.size()));
  EXPECT_NE(da, index_digest(d.data(), d.size()));
  EXPECT_NE(index_digest(d.data(), 0), index_digest(d.data(), 1));  // an empty list against {1}
}

TEST(EachExchange, SparseReduceScatterDeliversEachOwnerItsShardOfGatherAndAdd) {
  for (int p : {1, 2, 3, 4, 5}) {  // 60 splits into 1 to 5 equal shards
    const Outcome sharded = run_exchange(sparse_reduce_scatter(), p, false);
    const Outcome whole = run_exchange(gather_and_add(), p, false);
    const int64_t shard = kSmall / p;
    for (int r = 0; r < p; ++r) {
      for (int64_t i = 0; i < kSmall; ++i)
        ASSERT_EQ(sharded.output[r][i], i / shard == r ? whole.output[r][i] : 0.0f) << "P=" << p << " i " << i;
      ASSERT_EQ(sharded.residual[r], whole.residual[r]);
    }
  }
  EXPECT_EQ(&gather_and_add().for_shard(), &sparse_reduce_scatter());
  EXPECT_EQ(&fixed_gather().for_shard(), &sparse_reduce_scatter());
  EXPECT_EQ(&union_allreduce().for_shard(), &union_allreduce());  // runs whole
}

/// A transport that records the kind of every collective: 'R' all-reduce, 'G' all-gather, 'S' send-receive.
class Recording final : public Forwarding {
 public:
  using Forwarding::Forwarding;
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    calls += 'G';
    Forwarding::allgather(device, send, recv, bytes);
  }
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override {
    calls += 'R';
    Forwarding::allreduce_sum(device, data, count, dtype);
  }
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override {
    calls += 'S';
    Forwarding::sendrecv(device, send, send_bytes, dst, recv, recv_bytes, src);
  }
  std::string calls;
};

// MiCRO's band counts carry the control words (one all-gather instead of an all-reduce, 2 ranks)
// only where the exchange reads them: its exclusive gather does, the sparse reduce-scatter that
// replaces it for FSDP's shards does not, so there the counts stay an all-reduce. The first step
// starts with the sampled histogram's all-reduce.
TEST(EachExchange, BandCountsCarryControlWordsOnlyWhereTheExchangeReadsThem) {
  for (bool shard_only : {false, true}) {
    std::vector<std::string> calls(2);
    rethrow_first(run_ranks(2, [&](int rank, Transport& transport) {
      Recording recording(transport);
      CpuDevice device;
      std::vector<float> g = grad_of(rank, 1000);
      MiCRO method(0.05, "gather", false, 0);
      ReduceOptions options;
      options.shard_only = shard_only;
      reduce_bucket(&method, recording, device, BucketView{DType::kFloat32, 1000, g.data(), nullptr}, options);
      calls[rank] = recording.calls;
    }));
    EXPECT_EQ(calls[0], calls[1]);
    // folded: the counts' all-gather, then the messages; apart: the counts' all-reduce, then the
    // sparse reduce-scatter's row of counts and its one round of send-receive
    EXPECT_EQ(calls[0], shard_only ? "RRGS" : "RGG") << (shard_only ? "shard only" : "whole");
  }
}

// Reduce-scatter + all-gather keeps the global top K (K: the largest selection, 30 pairs here) of
// gather-and-add's average, by whole magnitude bins: the kept elements are gather-and-add's result
// there, bit for bit; every dropped element is below every kept one; and what a rank sent that
// was dropped is back in its residual, so the gradient mass is conserved.
TEST(EachExchange, ReduceScatterAllgatherKeepsTheGlobalTopKOfGatherAndAdd) {
  for (int p : {1, 2, 3, 4, 7}) {
    const Outcome o = run_exchange(reduce_scatter_allgather(), p, false);
    const Outcome whole = run_exchange(gather_and_add(), p, false);
    float smallest_kept = std::numeric_limits<float>::infinity(), largest_dropped = 0.0f;
    int64_t kept = 0;
    for (int64_t i = 0; i < kSmall; ++i) {
      if (o.output[0][i] != 0.0f) {
        ASSERT_EQ(o.output[0][i], whole.output[0][i]) << "P=" << p << " i " << i;
        smallest_kept = std::min(smallest_kept, std::fabs(o.output[0][i]));
        ++kept;
      } else {
        largest_dropped = std::max(largest_dropped, std::fabs(whole.output[0][i]));
      }
    }
    EXPECT_GE(kept, std::min<int64_t>(30, std::count_if(whole.output[0].begin(), whole.output[0].end(),
                                                        [](float v) { return v != 0.0f; })));
    EXPECT_LT(kept, 30 * 2) << "P=" << p;  // whole bins, 2^(1/4) apart: a few more than K at most
    EXPECT_LE(largest_dropped, smallest_kept) << "P=" << p;
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(o.output[r], o.output[0]);  // identical on every rank
      EXPECT_EQ(o.result[r].union_size, kept);
      for (int64_t i = 0; i < kSmall; ++i) {
        const bool sent = i % (r + 2) == 0, dropped = sent && o.output[0][i] == 0.0f;
        ASSERT_EQ(o.residual[r][i], sent && !dropped ? 0.0f : residual_of(r, kSmall)[i])
            << "P=" << p << " rank " << r << " i " << i;
      }
    }
  }
  // Every rank selecting the same 20 indices: the union is K, everything is kept.
  for (int p : {2, 5}) {
    const Outcome o = run_exchange(reduce_scatter_allgather(), p, true);
    const Outcome whole = run_exchange(gather_and_add(), p, true);
    for (int r = 0; r < p; ++r) ASSERT_EQ(o.output[r], whole.output[r]);
  }
}

TEST(EachExchange, SparDLAtFullSizeIsTheDenseAverage) {
  for (int p : {1, 2, 3, 4}) {
    for (int teams : {1, 2}) {
      if (p % teams != 0) continue;
      std::vector<std::vector<float>> output(p), residual(p);
      rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
        CpuDevice device;
        output[rank].assign(kSmall, 0.0f);
        residual[rank] = residual_of(rank, kSmall);
        const BucketView bucket{DType::kFloat32, kSmall, output[rank].data(), residual[rank].data()};
        SparDLExchange exchange;
        const int64_t chunk = (kSmall + p / teams - 1) / (p / teams);
        exchange.sizes = SparDLExchange::Sizes{teams, chunk, chunk};  // every pair of every block
        Selection nothing;  // SparDL's selection is the error-feedback update alone
        const ExchangeResult result = exchange.run(transport, device, bucket, nothing);
        EXPECT_EQ(result.merged, teams > 1 ? chunk : -1);
      }));
      for (int64_t i = 0; i < kSmall; ++i) {
        float sum = 0.0f;
        for (int r = 0; r < p; ++r) sum += residual_of(r, kSmall)[i];
        for (int r = 0; r < p; ++r) {
          ASSERT_NEAR(output[r][i], sum / float(p), 1e-6f) << "P=" << p << " teams " << teams << " i " << i;
          ASSERT_EQ(residual[r][i], 0.0f);  // everything was sent
        }
      }
    }
  }
}

TEST(EachExchange, AMethodWithAutoSwitchesItsExchangeByOptionValue) {
  TopK topk(0.1, "gather");
  topk.set_exchange("reduce_scatter");
  EXPECT_STREQ(topk.exchange().name(), "reduce-scatter + all-gather");
  topk.set_exchange("gather");  // Top-k's own gather, not gather-and-add
  EXPECT_STREQ(topk.exchange().name(), "fixed-size gather");
  EXPECT_THROW(topk.set_exchange("union"), ValueError);
  EXPECT_STREQ(topk.exchange().name(), "fixed-size gather");  // a refused value changes nothing
  GaussianK gaussiank(0.1, "spardl", "reduce_scatter");
  gaussiank.set_exchange("gather");
  EXPECT_STREQ(gaussiank.exchange().name(), "gather-and-add");
  SAGE sage(0.1, "per_tensor", {}, false, 0, std::nullopt, std::nullopt);
  sage.set_exchange("reduce_scatter");
  EXPECT_STREQ(sage.exchange().name(), "reduce-scatter + all-gather");
  RandomK randomk(0.1, 0);  // shared indices only: its exchange cannot change
  EXPECT_THROW(randomk.set_exchange("gather"), ValueError);
  EXPECT_STREQ(randomk.exchange().name(), "shared indices");
}

TEST(EachExchange, GlossaryNamesEveryExchangeOnce) {
  std::vector<std::string> names;
  for (ExchangeKind kind : kExchangeKinds) names.push_back(exchange_name(kind));
  EXPECT_EQ(names, (std::vector<std::string>{"gather-and-add", "fixed-size gather", "exclusive gather",
                                             "union + all-reduce", "shared indices", "sparse reduce-scatter",
                                             "reduce-scatter + all-gather", "SparDL"}));
  EXPECT_STREQ(TopK(0.1, "reduce_scatter").exchange().name(), "reduce-scatter + all-gather");
  EXPECT_EQ(&reduce_scatter_allgather().for_shard(), &sparse_reduce_scatter());
  EXPECT_THROW(TopK(0.1, "union"), ValueError);
  EXPECT_STREQ(gather_and_add().name(), "gather-and-add");
  EXPECT_STREQ(TopK(0.1).exchange().name(), "fixed-size gather");
  EXPECT_STREQ(RandomK(0.1, 0).exchange().name(), "shared indices");
  EXPECT_STREQ(MiCRO(0.1, "union", false, 0).exchange().name(), "union + all-reduce");
  EXPECT_STREQ(ExDyna(0.1, "gather", false, 0).exchange().name(), "exclusive gather");
  EXPECT_STREQ(SAGE(0.1, "per_tensor", {}, false, 0, std::nullopt, std::nullopt).exchange().name(), "gather-and-add");
  EXPECT_EQ(&exclusive_gather().for_shard(), &sparse_reduce_scatter());
  EXPECT_STREQ(SparDL(0.1, 1).exchange().name(), "SparDL");
  EXPECT_THROW(MiCRO(0.1, "shared", false, 0), ValueError);
}

TEST(GatherAdd, DensityOneEqualsDenseAverage) {
  for (int p : {1, 2, 3, 4, 8}) {
    std::vector<std::vector<float>> outputs(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      outputs[rank] = grad_of(rank, 1000);
      TopK method(1.0);
      BucketView bucket{DType::kFloat32, 1000, outputs[rank].data(), nullptr};
      reduce_bucket(&method, transport, device, bucket, ReduceOptions{});
    }));
    for (int64_t i = 0; i < 1000; ++i) {
      float want = 0.0f;
      for (int r = 0; r < p; ++r) want += grad_of(r, 1000)[i] / float(p);
      ASSERT_EQ(outputs[0][i], want) << "p=" << p << " i=" << i;
    }
  }
}

TEST(GatherAdd, UnequalCountsAndEmptySelectionsNeverIssueZeroLengthCollectives) {
  // Rank 0 selects nothing, the others different amounts: header-only messages still move.
  const int p = 4;
  std::vector<std::vector<float>> outputs(p);
  std::vector<Traffic> traffic(p);
  rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
    CpuDevice device;
    outputs[rank] = std::vector<float>(100, rank == 0 ? 0.0f : float(rank));
    for (int i = 0; i < rank * 10; ++i) outputs[rank][i] = 50.0f;
    Threshold method(10.0);
    BucketView bucket{DType::kFloat32, 100, outputs[rank].data(), nullptr};
    reduce_bucket(&method, transport, device, bucket, ReduceOptions{});
    traffic[rank] = transport.traffic();
  }));
  for (int i = 0; i < 100; ++i) {
    const int senders = (i < 10) + (i < 20) + (i < 30);
    ASSERT_EQ(outputs[0][i], 50.0f * senders / 4) << i;
  }
  for (int r = 0; r < p; ++r) EXPECT_EQ(traffic[r].collectives, 2);  // control + data
  // No padding on the wire: each rank receives exactly the other ranks' bare messages (10 r pairs
  // from rank r), after their 8-byte control words.
  for (int r = 0; r < p; ++r) {
    int64_t others = 0;
    for (int q = 0; q < p; ++q)
      if (q != r) others += static_cast<int64_t>(MessageLayout(10 * q, 4, DType::kFloat32, /*bare=*/true).total_bytes);
    EXPECT_EQ(traffic[r].bytes_received, (p - 1) * static_cast<int64_t>(control_bytes(100)) + others) << r;
  }
}

/// Forwards everything but allgatherv, which takes the base class's padded path (counted here).
class WithoutAllgatherv final : public Forwarding {
 public:
  using Forwarding::Forwarding;
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    Forwarding::allgather(device, send, recv, bytes);
    count_allgather(bytes);
  }
};

// allgatherv delivers every rank's block back to back, zero-length blocks included, natively
// (ThreadTransport: only the blocks are counted) and through the padded fallback (counted padded).
TEST(Allgatherv, DeliversBlocksBackToBackNativelyAndPadded) {
  for (const bool native : {true, false}) {
    for (int p : {1, 2, 3, 5}) {
      std::vector<size_t> sizes(p);
      for (int r = 0; r < p; ++r) sizes[r] = static_cast<size_t>(r % 3 == 1 ? 0 : 3 * r + 5);
      const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
      const size_t largest = *std::max_element(sizes.begin(), sizes.end());
      rethrow_first(run_ranks(p, [&](int rank, Transport& inner) {
        CpuDevice device;
        WithoutAllgatherv padded(inner);
        Transport& transport = native ? inner : static_cast<Transport&>(padded);
        std::vector<unsigned char> mine(sizes[rank], static_cast<unsigned char>(rank + 1)), all(total, 0);
        transport.allgatherv(device, mine.data(), all.data(), sizes);
        size_t at = 0;
        for (int q = 0; q < p; ++q)
          for (size_t j = 0; j < sizes[q]; ++j) ASSERT_EQ(all[at++], q + 1) << "P=" << p << " rank " << q;
        const int64_t expected =
            native ? static_cast<int64_t>(total - sizes[rank]) : static_cast<int64_t>((p - 1) * largest);
        EXPECT_EQ(transport.traffic().bytes_sent, expected) << "P=" << p << (native ? " native" : " padded");
      }));
    }
  }
}

TEST(Allgatherv, RejectsWrongSizeListsAndDisagreement) {
  const auto errors = run_ranks(2, [&](int rank, Transport& transport) {
    CpuDevice device;
    std::vector<unsigned char> send(16), recv(16);
    EXPECT_THROW(transport.allgatherv(device, send.data(), recv.data(), {4}), ValueError);
    EXPECT_THROW(transport.allgatherv(device, send.data(), recv.data(), {0, 0}), ValueError);
    // Rank 1 claims another size for itself than rank 0 expects.
    transport.allgatherv(device, send.data(), recv.data(), {4, rank == 0 ? size_t{4} : size_t{8}});
  });
  EXPECT_TRUE(errors[0]);  // rank 0 received 8 bytes where it expected 4
  EXPECT_TRUE(errors[1]);  // and rank 1, whose blocks all came as it expected, learns it too
}

// Size lists that differ only in another rank's block: the ranks whose own view of the blocks
// they received holds raise as well, so that no rank goes on with a result the others refused.
TEST(Allgatherv, DisagreeingSizeListsRaiseOnEveryRank) {
  const auto errors = run_ranks(3, [&](int rank, Transport& transport) {
    CpuDevice device;
    std::vector<unsigned char> send(8), recv(16);
    const std::vector<size_t> sizes = rank == 2 ? std::vector<size_t>{4, 8, 4} : std::vector<size_t>{4, 4, 4};
    transport.allgatherv(device, send.data(), recv.data(), sizes);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("every rank must pass the same sizes"), std::string::npos) << e.what();
    }
  }
}

TEST(DenseAllreduce, AveragesLikeDdp) {
  const int p = 3;
  std::vector<std::vector<float>> outputs(p);
  rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
    CpuDevice device;
    outputs[rank] = grad_of(rank, 500);
    BucketView bucket{DType::kFloat32, 500, outputs[rank].data(), nullptr};
    ReduceOptions options;
    options.dense = true;
    const ReduceReport report = reduce_bucket(nullptr, transport, device, bucket, options);
    EXPECT_TRUE(report.dense);
    EXPECT_EQ(report.traffic.bytes_sent, 2 * (p - 1) * 500 * 4 / p);
  }));
  for (int i = 0; i < 500; ++i) {
    float want = 0.0f;
    for (int r = 0; r < p; ++r) want += grad_of(r, 500)[i] / float(p);
    ASSERT_EQ(outputs[0][i], want);
    ASSERT_EQ(outputs[1][i], want);
  }
}

// float16 values whose sum exceeds its largest finite value (65504) while their average does not:
// every exchange averages them as DDP's all-reduce does (the union and shared all-reduces, and
// SparDL's partial sums, divide first), so the output is finite: every element's mass reached it,
// to float16's rounding, or (SparDL with two teams, whose per-rank lists are shorter than the
// block) stayed in the residual. At 3, 5 and 7 ranks 65504 / P rounded to nearest is a quotient
// of which P sum past 65504 (three of 21840 make 65520, which float16 rounds to Inf): the
// division rounds such quotients toward zero (numeric.h, quotient).
TEST(Float16, ValuesWhoseSumOverflowsAverageToFiniteOutputs) {
  const int64_t n = 4;
  const std::vector<std::pair<const char*, std::function<std::unique_ptr<Method>()>>> makers = {
      {"Top-k, gather", [] { return std::make_unique<TopK>(1.0); }},
      {"Random-k, shared indices", [] { return std::make_unique<RandomK>(1.0, 3); }},
      {"MiCRO, union", [] { return std::make_unique<MiCRO>(1.0, "union", true, 3); }},
      {"MiCRO default, union", [] { return std::make_unique<MiCRO>(1.0, "union", false, 3); }},
      {"SparDL, one team", [] { return std::make_unique<SparDL>(1.0, 1); }},
      {"SparDL, two teams", [] { return std::make_unique<SparDL>(1.0, 2); }},
  };
  for (const auto& [p, value] :
       std::vector<std::pair<int, float>>{{2, 40000.0f}, {3, 65504.0f}, {5, 65504.0f}, {6, 65504.0f}, {7, 65504.0f}})
    for (const auto& [name, make] : makers) {
      if (std::string(name) == "SparDL, two teams" && p % 2 != 0) continue;  // teams must divide the ranks
      SCOPED_TRACE(str(name, ", ", p, " ranks, every value ", value));
      std::vector<std::vector<Half>> grad(p, std::vector<Half>(n, Num<Half>::from_float(value)));
      std::vector<std::vector<Half>> residual(p, std::vector<Half>(n, Num<Half>::zero()));
      rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
        CpuDevice device;
        const std::unique_ptr<Method> method = make();
        BucketView bucket{DType::kFloat16, n, grad[rank].data(), residual[rank].data()};
        reduce_bucket(method.get(), transport, device, bucket, ReduceOptions{});
      }));
      for (int r = 0; r < p; ++r) {
        int64_t sent = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float out = Num<Half>::to_float(grad[r][i]), kept = Num<Half>::to_float(residual[r][i]);
          const bool reached = std::isfinite(out) && std::fabs(out - value) <= value / 512 && kept == 0.0f;
          EXPECT_TRUE(reached || (out == 0.0f && kept == value))
              << "rank " << r << " element " << i << ": output " << out << ", residual " << kept;
          sent += reached;
        }
        EXPECT_GE(sent, std::string(name) == "SparDL, two teams" ? 1 : n) << "rank " << r;
      }
    }
}

// The gathers, the sparse reduce-scatter and reduce-scatter + all-gather's owners add every rank's
// value / P into float32 sums and round them once to the 16-bit dtype (add_messages): rank r's
// element i is value + spread * (r - i), and every rank's output, where it owns the element, is
// the float32 sum of the ranks' values / P in rank order rounded once to T, to the bit, with no
// residual kept.
template <typename T>
void expect_gathered_averages_round_once(DType dtype, const std::vector<float>& values, float spread) {
  const std::vector<std::tuple<const char*, std::function<std::unique_ptr<Method>()>, bool>> ways = {
      {"Top-k, fixed-size gather", [] { return std::make_unique<TopK>(1.0); }, false},
      {"Threshold, gather-and-add", [] { return std::make_unique<Threshold>(1.0); }, false},
      {"Top-k, reduce-scatter + all-gather", [] { return std::make_unique<TopK>(1.0, "reduce_scatter"); }, false},
      {"Top-k, sparse reduce-scatter", [] { return std::make_unique<TopK>(1.0); }, true},
  };
  for (int p : {6, 10, 12, 16})
    for (float value : values)
      for (const auto& [name, make, shard_only] : ways) {
        SCOPED_TRACE(str(name, ", ", dtype_name(dtype), ", ", p, " ranks, values ", value, " + ", spread, " (r - i)"));
        const int64_t n = 2 * p;  // two elements in each rank's shard
        std::vector<std::vector<T>> grad(p, std::vector<T>(n));
        for (int r = 0; r < p; ++r)
          for (int64_t i = 0; i < n; ++i) grad[r][i] = Num<T>::from_float(value + spread * static_cast<float>(r - i));
        std::vector<float> sum(n, 0.0f);
        for (int r = 0; r < p; ++r)
          for (int64_t i = 0; i < n; ++i) sum[i] += Num<T>::to_float(grad[r][i]) / static_cast<float>(p);
        std::vector<std::vector<T>> residual(p, std::vector<T>(n, Num<T>::zero()));
        rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
          CpuDevice device;
          const std::unique_ptr<Method> method = make();
          ReduceOptions options;
          options.shard_only = shard_only;
          reduce_bucket(method.get(), transport, device, BucketView{dtype, n, grad[rank].data(), residual[rank].data()},
                        options);
        }));
        for (int r = 0; r < p; ++r)
          for (int64_t i = 0; i < n; ++i) {
            const bool owned = !shard_only || i / 2 == r;
            const float want = owned ? Num<T>::to_float(Num<T>::from_float(sum[i])) : 0.0f;
            EXPECT_EQ(Num<T>::to_float(grad[r][i]), want) << "rank " << r << " element " << i;
            EXPECT_EQ(Num<T>::to_float(residual[r][i]), 0.0f) << "rank " << r << " element " << i;
          }
      }
}

// Added one by one in float16, each sum rounded again: from 10 ranks on, values of 65504 on every
// rank rounded past 65504 (ten of 6550.4 made Inf) where their average is finite, and the Inf
// reached the gradient with the residuals emptied under "raise" and "skip" alike; 30000 on 6 to 16
// ranks came back one or two units (16, 32) off. Now every rank's output is the value itself (its
// float32 sum rounded once).
TEST(Float16, GatheredAveragesRoundOnceAndStayFinite) {
  expect_gathered_averages_round_once<Half>(DType::kFloat16, {30000.0f, 65504.0f, -65504.0f}, 0.0f);
}

// Added one by one in bfloat16 (8 significant bits), each sum rounded again, values near 30000 on 6
// to 16 ranks came back one or two units (128, 256) off the sum rounded once, and near 1e30 one.
TEST(BFloat16, GatheredAveragesRoundOnce) {
  expect_gathered_averages_round_once<BFloat16>(DType::kBFloat16, {30000.0f, -30000.0f, 1e30f}, 300.0f);
}

/// A transport whose float16 all-reduces add the ranks' values one by one in rank order, each
/// partial sum rounded to float16, as Gloo's do (ThreadTransport's sum in float32, rounded once).
class Float16Sums final : public Forwarding {
 public:
  using Forwarding::Forwarding;
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override {
    if (dtype != DType::kFloat16) return Forwarding::allreduce_sum(device, data, count, dtype);
    std::vector<Half> all(count * static_cast<size_t>(size()));
    allgather(device, data, all.data(), count * sizeof(Half));
    auto* sums = static_cast<Half*>(data);
    for (size_t i = 0; i < count; ++i) {
      sums[i] = all[i];
      for (int r = 1; r < size(); ++r)
        sums[i] = Num<Half>::from_float(Num<Half>::to_float(sums[i]) + Num<Half>::to_float(all[r * count + i]));
    }
  }
};

// The union and shared all-reduces divide float16 by P first, but a transport that rounds each
// partial sum to float16 carries ten of 65504 / 10 (6548) past 65504: the sums came back Inf, and
// reached the gradient with the residuals emptied under "raise" and "skip" although every rank's
// values were finite. Every rank reads the same sums, so every rank aborts the step: "raise" names
// the overflow and the fix and leaves the gradient as it was, "skip" hands back zeros, and the
// residuals keep residual + gradient either way.
TEST(Float16, AllreducedSumsPastTheRangeAbortTheStepOnEveryRank) {
  const int p = 10;
  const int64_t n = 4;
  const Half value = Num<Half>::from_float(65504.0f);
  const std::vector<std::pair<const char*, std::function<std::unique_ptr<Method>()>>> makers = {
      {"Random-k, shared indices", [] { return std::make_unique<RandomK>(1.0, 3); }},
      {"MiCRO, union", [] { return std::make_unique<MiCRO>(1.0, "union", true, 3); }},
      {"MiCRO default, union", [] { return std::make_unique<MiCRO>(1.0, "union", false, 3); }},
  };
  for (const auto& [name, make] : makers)
    for (NonFinitePolicy policy : {NonFinitePolicy::kRaise, NonFinitePolicy::kSkip}) {
      const bool raise = policy == NonFinitePolicy::kRaise;
      SCOPED_TRACE(str(name, raise ? ", raise" : ", skip"));
      std::vector<std::vector<Half>> grad(p, std::vector<Half>(n, value));
      std::vector<std::vector<Half>> residual(p, std::vector<Half>(n, Num<Half>::zero()));
      std::vector<int> skipped(p, 0);
      const auto errors = run_ranks(p, [&](int rank, Transport& transport) {
        Float16Sums sums(transport);
        CpuDevice device;
        const std::unique_ptr<Method> method = make();
        ReduceOptions options;
        options.nonfinite = policy;
        skipped[rank] = reduce_bucket(method.get(), sums, device,
                                      BucketView{DType::kFloat16, n, grad[rank].data(), residual[rank].data()}, options)
                            .skipped;
      });
      for (int r = 0; r < p; ++r) {
        if (raise) {
          ASSERT_TRUE(errors[r]) << "rank " << r << " did not raise";
          try {
            std::rethrow_exception(errors[r]);
          } catch (const NonFiniteError& e) {
            EXPECT_NE(std::string(e.what()).find("float16 sum of every rank's residual + gradient / P (all finite) "
                                                 "overflowed"),
                      std::string::npos)
                << e.what();
            EXPECT_NE(std::string(e.what()).find("Use float32 buckets or a lower loss scale"), std::string::npos)
                << e.what();
          }
        } else {
          ASSERT_FALSE(errors[r]) << "rank " << r;
          EXPECT_TRUE(skipped[r]) << "rank " << r;
        }
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_EQ(Num<Half>::to_float(grad[r][i]), raise ? 65504.0f : 0.0f) << "rank " << r << " element " << i;
          EXPECT_EQ(Num<Half>::to_float(residual[r][i]), 65504.0f) << "rank " << r << " element " << i;
        }
      }
    }
}

// A NaN on one rank: every rank raises (default) or every rank skips, and each rank's residual
// keeps all of its finite mass. The news travels in the control words, or (MiCRO, ExDyna up to 4
// ranks) in the band counts that carry them; reference MiCRO keeps them apart.
TEST(NonFinite, EveryRankAppliesTheSamePolicy) {
  const int p = 3;
  const std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<TopK>(0.05); }, [] { return std::make_unique<MiCRO>(0.05, "union", false, 0); },
      [] { return std::make_unique<ExDyna>(0.05, "gather", false, 0); },
      [] { return std::make_unique<MiCRO>(0.05, "union", true, 0); }};
  for (const auto& make : makers)
    for (NonFinitePolicy policy : {NonFinitePolicy::kRaise, NonFinitePolicy::kSkip}) {
      std::vector<std::vector<float>> outputs(p), residuals(p);
      std::vector<ReduceReport> reports(p);
      const auto errors = run_ranks(p, [&](int rank, Transport& transport) {
        CpuDevice device;
        outputs[rank] = grad_of(rank, 1000);
        if (rank == 1) outputs[rank][17] = std::numeric_limits<float>::quiet_NaN();
        residuals[rank] = residual_of(rank, 1000);
        const std::unique_ptr<Method> method = make();
        BucketView bucket{DType::kFloat32, 1000, outputs[rank].data(), residuals[rank].data()};
        ReduceOptions options;
        options.nonfinite = policy;
        options.bucket_name = "bucket 5";
        reports[rank] = reduce_bucket(method.get(), transport, device, bucket, options);
      });
      for (int r = 0; r < p; ++r) {
        SCOPED_TRACE(make()->name());
        if (policy == NonFinitePolicy::kRaise) {
          ASSERT_TRUE(errors[r]) << "rank " << r << " did not raise";
          try {
            std::rethrow_exception(errors[r]);
          } catch (const NonFiniteError& e) {
            EXPECT_NE(std::string(e.what()).find("bucket 5"), std::string::npos);
            EXPECT_NE(std::string(e.what()).find("rank(s) 1"), std::string::npos);
          }
        } else {
          ASSERT_FALSE(errors[r]);
          EXPECT_TRUE(reports[r].skipped);
          EXPECT_EQ(outputs[r], std::vector<float>(1000, 0.0f));
        }
        // Residual = old residual + grad wherever that is finite, else old residual.
        const std::vector<float> g = grad_of(r, 1000), old = residual_of(r, 1000);
        for (int i = 0; i < 1000; ++i) {
          const float want = (r == 1 && i == 17) ? old[i] : old[i] + g[i];
          ASSERT_EQ(residuals[r][i], want) << "rank " << r << " element " << i;
        }
      }
    }
}

// A warm-up step (dense, with a method) applies the policy too: it passed the NaN on whatever the
// policy. Nothing moves: the residual is not part of a warm-up step, the velocity stays as it was.
TEST(NonFinite, AWarmUpStepAppliesThePolicyToo) {
  const int p = 3;
  const int64_t n = 1000;
  for (NonFinitePolicy policy : {NonFinitePolicy::kRaise, NonFinitePolicy::kSkip}) {
    std::vector<std::vector<float>> outputs(p), residuals(p), velocities(p);
    std::vector<ReduceReport> reports(p);
    const auto errors = run_ranks(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      outputs[rank] = grad_of(rank, n);
      if (rank == 1) outputs[rank][17] = std::numeric_limits<float>::infinity();
      residuals[rank] = residual_of(rank, n);
      velocities[rank] = grad_of(rank + 7, n);
      TopK method(0.05);
      BucketView bucket{DType::kFloat32, n, outputs[rank].data(), residuals[rank].data()};
      bucket.velocity = velocities[rank].data();
      ReduceOptions options;
      options.dense = true;
      options.momentum = 0.9f;
      options.nonfinite = policy;
      options.bucket_name = "bucket 2";
      reports[rank] = reduce_bucket(&method, transport, device, bucket, options);
    });
    for (int r = 0; r < p; ++r) {
      if (policy == NonFinitePolicy::kRaise) {
        ASSERT_TRUE(errors[r]) << "rank " << r << " did not raise";
        EXPECT_THROW(std::rethrow_exception(errors[r]), NonFiniteError);
      } else {
        ASSERT_FALSE(errors[r]);
        EXPECT_TRUE(reports[r].skipped && reports[r].dense);
        EXPECT_EQ(outputs[r], std::vector<float>(n, 0.0f));
      }
      EXPECT_EQ(residuals[r], residual_of(r, n)) << "rank " << r;
      EXPECT_EQ(velocities[r], grad_of(r + 7, n)) << "rank " << r;
    }
  }
}

// With keep_taken, a completed sparse step reports what it took from the residual: written back
// (out[index] = value), the residual is residual + gradient, to the bit, as if nothing had been
// sent (nonfinite="propagate" takes back the step of a bucket when another one overflowed). Every
// exchange: the ones whose selection zeroes the residual, reduce-scatter + all-gather (which takes
// back what no owner kept), the union's and SparDL's (which rewrite the residual themselves), and
// FSDP's sparse reduce-scatter. Without keep_taken nothing is kept.
TEST(ReduceBucket, WritingBackWhatAStepTookLeavesResidualPlusGradient) {
  const std::vector<std::pair<const char*, std::function<std::unique_ptr<Method>()>>> methods = {
      {"Top-k, fixed-size gather", [] { return std::make_unique<TopK>(0.05); }},
      {"Threshold, gather-and-add", [] { return std::make_unique<Threshold>(1.0); }},
      {"Top-k, reduce-scatter + all-gather", [] { return std::make_unique<TopK>(0.05, "reduce_scatter"); }},
      {"Random-k, shared indices", [] { return std::make_unique<RandomK>(0.05, 3); }},
      {"MiCRO, union", [] { return std::make_unique<MiCRO>(0.05, "union", false, 0); }},
      {"ExDyna, exclusive gather", [] { return std::make_unique<ExDyna>(0.05, "gather", false, 0); }},
      {"SparDL, one team", [] { return std::make_unique<SparDL>(0.05, 1); }},
      {"SparDL, two teams", [] { return std::make_unique<SparDL>(0.05, 2); }},
  };
  constexpr int kRanks = 4;
  constexpr int64_t n = 4000;
  for (const auto& [name, make] : methods) {
    for (const bool shard_only : {false, true}) {
      for (const bool keep : {true, false}) {
        std::vector<std::vector<float>> residuals(kRanks);
        std::vector<ReduceReport> reports(kRanks);
        int64_t taken = 0;  // pairs taken, over the ranks (ExDyna's first step may select on one rank only)
        rethrow_first(run_ranks(kRanks, [&](int rank, Transport& transport) {
          CpuDevice device;
          std::vector<float> g = grad_of(rank, n);
          residuals[rank] = residual_of(rank, n);
          auto method = make();
          ReduceOptions options;
          options.keep_taken = keep;
          options.shard_only = shard_only;
          reports[rank] = reduce_bucket(method.get(), transport, device,
                                        BucketView{DType::kFloat32, n, g.data(), residuals[rank].data()}, options);
          if (reports[rank].taken != nullptr)
            device.assign(reports[rank].taken->view(DType::kFloat32, n), residuals[rank].data());
        }));
        for (int r = 0; r < kRanks; ++r) {
          SCOPED_TRACE(std::string(name) + (shard_only ? ", shard only" : "") + ", rank " + std::to_string(r));
          ASSERT_FALSE(reports[r].skipped);
          if (!keep) {
            EXPECT_EQ(reports[r].taken, nullptr);
            continue;
          }
          ASSERT_NE(reports[r].taken, nullptr);
          taken += reports[r].taken->count;
          const std::vector<float> res = residual_of(r, n), g = grad_of(r, n);
          std::vector<float> want(n);
          for (int64_t i = 0; i < n; ++i) want[i] = res[i] + g[i];
          EXPECT_EQ(residuals[r], want);
        }
        if (keep) EXPECT_GT(taken, 0) << name;
      }
    }
  }
}

// A step skipped for a non-finite value leaves every method's state as it was (method.h,
// observe()): the density control of the estimating methods learned from the skipped step's
// selection before, and the next step started from there. Nor does a step after it that asks no
// threshold (a zero vector: its gradient cancels the residual) commit what the skipped one learned.
TEST(NonFinite, ASkippedStepLeavesTheMethodStateAsItWas) {
  const int p = 2;
  const int64_t n = 1000;
  const std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<GaussianK>(0.05, "spardl"); },
      [] { return std::make_unique<GaussianK>(0.05, "sidco"); },
      [] { return std::make_unique<DGC>(0.05, 3); },
      [] { return std::make_unique<RedSync>(0.05); },
      [] { return std::make_unique<SIDCo>(0.05, "exp", -1, 0.25, std::nullopt); },
      [] { return std::make_unique<SAGE>(0.05, "flat", std::vector<int64_t>{}, false, 3, std::nullopt, std::nullopt); },
      [] { return std::make_unique<MiCRO>(0.05, "union", false, 0); },
      [] { return std::make_unique<ExDyna>(0.05, "union", false, 0); }};
  auto same = [](const MethodState& a, const MethodState& b) {
    if (a.size() != b.size()) return false;
    for (const auto& [key, v] : a) {
      const auto it = b.find(key);
      if (it == b.end() || !(v == it->second || (std::isnan(v) && std::isnan(it->second)))) return false;
    }
    return true;
  };
  auto control_of = [](const MethodState& s) {  // the density control's entries
    MethodState out;
    for (const auto& [key, v] : s)
      if (key.rfind("control.", 0) == 0) out[key] = v;
    return out;
  };
  for (const auto& make : makers) {
    SCOPED_TRACE(make()->name());
    std::vector<MethodState> before(p), after(p), after_zero(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      const std::unique_ptr<Method> method = make();
      std::vector<float> residual(n, 0.0f);
      ReduceOptions options;
      options.nonfinite = NonFinitePolicy::kSkip;
      for (int t = 0; t < 3; ++t) {  // two steps, then one with a NaN on rank 1
        std::vector<float> g = grad_of(rank + 10 * t, n);
        for (float& x : g) x *= t == 1 ? 30.0f : 1.0f;  // a change of scale: the control learns
        if (t == 2) before[rank] = method->state();
        if (t == 2 && rank == 1) g[17] = std::numeric_limits<float>::quiet_NaN();
        const ReduceReport report = reduce_bucket(method.get(), transport, device,
                                                  BucketView{DType::kFloat32, n, g.data(), residual.data()}, options);
        EXPECT_EQ(report.skipped, t == 2);
      }
      after[rank] = method->state();
      std::vector<float> cancel(residual);
      for (float& x : cancel) x = -x;
      reduce_bucket(method.get(), transport, device, BucketView{DType::kFloat32, n, cancel.data(), residual.data()},
                    options);
      after_zero[rank] = method->state();
    }));
    for (int r = 0; r < p; ++r) {
      EXPECT_FALSE(before[r].empty()) << "rank " << r;
      EXPECT_TRUE(same(before[r], after[r])) << "rank " << r;
      EXPECT_TRUE(same(control_of(before[r]), control_of(after_zero[r]))) << "rank " << r << ", after a zero step";
    }
  }
}

TEST(Faults, AMissingRankMakesTheOthersFailWithinTheTimeout) {
  const auto errors = run_ranks(
      3,
      [&](int rank, Transport& transport) {
        if (rank == 2) return;  // this rank never joins the collective
        CpuDevice device;
        std::vector<float> g = grad_of(rank, 100);
        TopK method(0.1);
        BucketView bucket{DType::kFloat32, 100, g.data(), nullptr};
        reduce_bucket(&method, transport, device, bucket, ReduceOptions{});
      },
      std::chrono::milliseconds(300));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r]);
    EXPECT_THROW(std::rethrow_exception(errors[r]), CommError);
  }
}

TEST(Faults, MismatchedCollectivesAreDetected) {
  const auto errors = run_ranks(2, [&](int rank, Transport& transport) {
    CpuDevice device;
    std::vector<char> send(rank == 0 ? 8 : 16), recv(32);
    transport.allgather(device, send.data(), recv.data(), send.size());
  });
  EXPECT_TRUE(errors[0]);
  EXPECT_TRUE(errors[1]);
}

// Ranks that issue different collectives over as many bytes (an all-gather and an all-reduce of
// 8 bytes, all-reduces of 2 float32 and 1 float64, an all-gather and an all-gatherv of one
// block) fail on every rank, naming both collectives. Each rank read the others' buffers as its
// own kind and returned: a rank that took another path passed here and hung on a real backend.
TEST(Faults, DifferentCollectivesOfTheSameSizeAreDetected) {
  const std::vector<std::function<void(Transport&, int, void*)>> issues{
      [](Transport& t, int rank, void* buffer) {
        CpuDevice device;
        std::vector<char> recv(16);
        if (rank == 0) t.allgather(device, buffer, recv.data(), 8);
        if (rank == 1) t.allreduce_sum(device, buffer, 2, DType::kFloat32);
      },
      [](Transport& t, int rank, void* buffer) {
        CpuDevice device;
        t.allreduce_sum(device, buffer, rank == 0 ? 2 : 1, rank == 0 ? DType::kFloat32 : DType::kFloat64);
      },
      [](Transport& t, int rank, void* buffer) {
        CpuDevice device;
        std::vector<char> recv(16);
        if (rank == 0) t.allgather(device, buffer, recv.data(), 8);
        if (rank == 1) t.allgatherv(device, buffer, recv.data(), {8, 8});
      },
  };
  for (size_t i = 0; i < issues.size(); ++i) {
    const auto errors = run_ranks(2, [&](int rank, Transport& transport) {
      std::vector<double> buffer(1, 1.0);
      issues[i](transport, rank, buffer.data());
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(errors[r]) << "case " << i << " rank " << r;
      try {
        std::rethrow_exception(errors[r]);
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("every rank must issue the same collective"), std::string::npos)
            << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "case " << i << " rank " << r << ": not a CommError: " << e.what();
      }
    }
  }
}

// A sparse step fuses momentum correction into the error-feedback update: a velocity without a
// residual is refused on every rank before any collective (a dense step takes it: momentum SGD).
TEST(Methods, RefuseAVelocityWithoutAResidualOnSparseSteps) {
  for (const bool dense : {false, true}) {
    const auto errors = run_ranks(2, [&](int rank, Transport& transport) {
      CpuDevice device;
      std::vector<float> grad = grad_of(rank, 1000), velocity(1000, 1.0f);
      TopK method(0.01);
      ReduceOptions options;
      options.dense = dense;
      options.momentum = 0.5f;
      reduce_bucket(&method, transport, device,
                    BucketView{DType::kFloat32, 1000, grad.data(), nullptr, velocity.data()}, options);
      if (dense) EXPECT_EQ(velocity[0], 0.5f + grad_of(rank, 1000)[0]);
    });
    for (const std::exception_ptr& error : errors) {
      if (dense) {
        EXPECT_FALSE(error);
        continue;
      }
      ASSERT_TRUE(error);
      try {
        std::rethrow_exception(error);
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("momentum correction needs the error-feedback residual"),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(Methods, RejectBadArguments) {
  for (double d : {0.0, -0.1, 1.5, std::nan("")}) EXPECT_THROW(TopK{d}, ValueError) << d;
  for (double t : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) EXPECT_THROW(Threshold{t}, ValueError);
  EXPECT_EQ(target_count(0.001, 10), 1);  // ruling 4: at least one element
  EXPECT_EQ(target_count(0.5, 11), 5);
  EXPECT_EQ(target_count(1.0, 11), 11);
  EXPECT_EQ(target_count(0.5, 0), 0);
}

}  // namespace

namespace {

// Top-k sends exactly k pairs on every rank: one fixed-size all-gather, no control words.
TEST(GatherAdd, ExactKUsesOneCollective) {
  for (int p : {1, 2, 3}) {
    std::vector<Traffic> traffic(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      std::vector<float> g = grad_of(rank, 1000);
      TopK method(0.05);
      reduce_bucket(&method, transport, device, BucketView{DType::kFloat32, 1000, g.data(), nullptr}, ReduceOptions{});
      traffic[rank] = transport.traffic();
    }));
    for (int r = 0; r < p; ++r) EXPECT_EQ(traffic[r].collectives, 1) << "P=" << p;
  }
}

}  // namespace

namespace {

/// The CPU device with every buffer rounded up, as PyTorch's CUDA allocator hook rounds its
/// buffers to 8 bytes (csrc/torch/cuda_support.h): bytes() then exceeds what was asked for, and
/// the core must copy what it asked for, not bytes() (the band counts' all-gather copied past its
/// host buffer, caught by AddressSanitizer).
class RoundingDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCPU; }
  Buffer allocate(size_t bytes) override {
    const size_t rounded = pad8(bytes) + 8;
    auto held = std::make_shared<Buffer>(cpu_.allocate(rounded));
    return Buffer(held->data(), rounded, [held](void*) { held->reset(); });
  }
  void copy_to_host(void* d, const void* s, size_t b) override { cpu_.copy_to_host(d, s, b); }
  void copy_from_host(void* d, const void* s, size_t b) override { cpu_.copy_from_host(d, s, b); }
  void copy(void* d, const void* s, size_t b) override { cpu_.copy(d, s, b); }
  void fill_zero(void* d, size_t b) override { cpu_.fill_zero(d, b); }
  void synchronize() override {}
  SelectStats select_pairs(const BucketView& b, const SelectRule& r, int w, const PairSink& s) override {
    return cpu_.select_pairs(b, r, w, s);
  }
  SelectStats topk_pairs(const BucketView& b, int64_t k, bool u, bool z, int w, const PairSink& s) override {
    return cpu_.topk_pairs(b, k, u, z, w, s);
  }
  Moments moments(const BucketView& b, bool u) override { return cpu_.moments(b, u); }
  std::vector<int64_t> count(const BucketView& b, Range r, const std::vector<double>& t, bool s) override {
    return cpu_.count(b, r, t, s);
  }
  Exceedance exceedance(const BucketView& b, double t, bool s, double c, BlockSample p) override {
    return cpu_.exceedance(b, t, s, c, p);
  }
  double log_sum(const BucketView& b, double c, double e, BlockSample p) override { return cpu_.log_sum(b, c, e, p); }
  Candidates collect(const BucketView& b, Range r, double t, bool s) override { return cpu_.collect(b, r, t, s); }
  Scan scan(const BucketView& b, bool u, Range r, double l, int64_t c, bool s, double z) override {
    return cpu_.scan(b, u, r, l, c, s, z);
  }
  double sample_abs_sum(const BucketView& b, const std::vector<int64_t>& p) override {
    return cpu_.sample_abs_sum(b, p);
  }
  void gather_values(const BucketView& b, const MessageView& m, void* v) override { cpu_.gather_values(b, m, v); }
  void zero_at(const BucketView& b, const MessageView& m) override { cpu_.zero_at(b, m); }
  void assign(const MessageView& m, void* o) override { cpu_.assign(m, o); }
  void scatter_add(const MessageView& m, void* o, float d) override { cpu_.scatter_add(m, o, d); }
  void scatter_add_float32(const MessageView& m, float* o, float d) override { cpu_.scatter_add_float32(m, o, d); }
  void divide(DType t, void* d, int64_t n, float v) override { cpu_.divide(t, d, n, v); }
  void round_to(DType t, const float* i, void* o, int64_t n) override { cpu_.round_to(t, i, o, n); }
  void momentum(const BucketView& b) override { cpu_.momentum(b); }

 private:
  CpuDevice cpu_;
};

// Every exchange on a device whose buffers are larger than asked for gives, to the bit, what it
// gives on the CPU device (at 1 and 3 ranks, whose band counts' all-gathers are 1036 x P bytes,
// no multiple of 8). Run under AddressSanitizer (scripts/sanitize.sh), it also checks that no
// copy reaches past a host buffer sized by the request.
std::unique_ptr<Method> make(const std::string& name) {
  if (name == "micro") return std::make_unique<MiCRO>(0.02, "union", false, 0);
  if (name == "exdyna") return std::make_unique<ExDyna>(0.02, "gather", false, 0);
  if (name == "spardl") return std::make_unique<SparDL>(0.02, 1);
  if (name == "gaussiank") return std::make_unique<GaussianK>(0.02, "spardl");
  return std::make_unique<TopK>(0.02);
}

TEST(Devices, BuffersLargerThanAskedForChangeNothing) {
  const int64_t n = 5000;
  for (int p : {1, 3}) {
    for (const std::string name : {"topk", "micro", "exdyna", "spardl", "gaussiank"}) {
      std::vector<std::vector<float>> outputs[2], residuals[2];
      for (int rounding = 0; rounding < 2; ++rounding) {
        outputs[rounding].resize(p);
        residuals[rounding].resize(p);
        rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
          CpuDevice cpu;
          RoundingDevice rounded;
          Device& device = rounding ? static_cast<Device&>(rounded) : static_cast<Device&>(cpu);
          std::unique_ptr<Method> method = make(name);
          residuals[rounding][rank] = residual_of(rank, n);
          for (int step = 0; step < 3; ++step) {
            outputs[rounding][rank] = grad_of(rank + step, n);
            BucketView bucket{DType::kFloat32, n, outputs[rounding][rank].data(), residuals[rounding][rank].data()};
            reduce_bucket(method.get(), transport, device, bucket, ReduceOptions{});
          }
        }));
      }
      EXPECT_EQ(outputs[1], outputs[0]) << name << " at " << p << " ranks";
      EXPECT_EQ(residuals[1], residuals[0]) << name << " at " << p << " ranks";
    }
  }
}

}  // namespace

namespace {

/// A transport that corrupts what this rank receives from its next peer in one chosen data
/// collective (allgathers and sendrecvs are counted; all-reduces pass untouched).
class Corrupting final : public Forwarding {
 public:
  /// Overwrites `width` bytes (4 or 8) at `offset` with `value`.
  Corrupting(Transport& inner, int target_call, size_t offset, uint64_t value, size_t width = 4)
      : Forwarding(inner), target_(target_call), offset_(offset), value_(value), width_(width) {}
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    Forwarding::allgather(device, send, recv, bytes);
    if (calls_++ == target_) corrupt(static_cast<unsigned char*>(recv) + bytes * ((rank() + 1) % size()), bytes);
  }
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override {
    Forwarding::sendrecv(device, send, send_bytes, dst, recv, recv_bytes, src);
    if (calls_++ == target_) corrupt(static_cast<unsigned char*>(recv), recv_bytes);
  }

 private:
  void corrupt(unsigned char* message, size_t bytes) {
    ASSERT_GE(bytes, offset_ + width_);
    std::memcpy(message + offset_, &value_, width_);  // little-endian: the low bytes first
  }
  int target_;
  size_t offset_;
  uint64_t value_;
  size_t width_;
  int calls_ = 0;
};

/// Runs one bucket of `make()` on `ranks` ranks where rank 0's transport corrupts call `call` as
/// `Corrupting` does; returns rank 0's error (the others fail as soon as rank 0 has).
std::exception_ptr corrupted_run(const std::function<std::unique_ptr<Method>()>& make, int call, size_t offset,
                                 uint64_t value, size_t width = 4, bool shard_only = false, int ranks = 2) {
  const auto errors = run_ranks(
      ranks,
      [&](int rank, Transport& transport) {
        Corrupting corrupting(transport, rank == 0 ? call : -1, offset, value, width);
        CpuDevice device;
        std::vector<float> g = grad_of(rank, 1000);
        std::unique_ptr<Method> method = make();
        ReduceOptions options;
        options.shard_only = shard_only;
        reduce_bucket(method.get(), corrupting, device, BucketView{DType::kFloat32, 1000, g.data(), nullptr}, options);
      },
      std::chrono::seconds(30), OnError::kPeersFail);  // rank 1's error is not looked at
  return errors[0];
}

/// Expects `error` to be a CorruptMessageError naming rank 1 (the corrupted peer).
void expect_corrupt_from_rank_1(const std::exception_ptr& error, const std::string& what) {
  ASSERT_TRUE(error) << what << ": rank 0 accepted it";
  try {
    std::rethrow_exception(error);
  } catch (const CorruptMessageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": expected CorruptMessageError, got " << e.what();
  }
}

struct CorruptCase {
  const char* name;
  std::function<std::unique_ptr<Method>()> make;
  int call;  // which allgather/sendrecv carries the data (0 is the control word where there is one)
  bool shard_only = false;
  bool bare = false;  // the messages travel without their header
};

const auto topk_reduce_scatter = [] { return std::make_unique<TopK>(0.05, "reduce_scatter"); };

// A corrupt message (bad magic, a count that disagrees with its size, an index outside the bucket
// or out of order) is rejected with CorruptMessageError on the rank that received it; every other
// rank finishes or fails within the timeout: nothing writes out of bounds, nothing hangs. Bare
// messages (no header: their counts travelled first) start with their indices.
TEST(Faults, CorruptMessagesAreRejectedInEveryExchange) {
  const std::vector<CorruptCase> cases = {
      {"fixed-size gather", [] { return std::make_unique<TopK>(0.05); }, 0},
      {"gather-and-add", [] { return std::make_unique<Threshold>(1.0); }, 1, false, true},
      {"union", [] { return std::make_unique<MiCRO>(0.05, "union", true, 0); }, 1, false, true},
      {"exclusive gather", [] { return std::make_unique<ExDyna>(0.05, "gather", true, 0); }, 1, false, true},
      {"SparDL reduce-scatter", [] { return std::make_unique<SparDL>(0.05, 1); }, 1},
      {"SparDL all-gather", [] { return std::make_unique<SparDL>(0.05, 1); }, 2},
      // control words, part counts, then the parts; a histogram all-reduce; kept counts, kept pairs
      {"reduce-scatter + all-gather: a part", topk_reduce_scatter, 2, false, true},
      {"reduce-scatter + all-gather: kept pairs", topk_reduce_scatter, 4, false, true},
      // one row of counts per rank, then the parts
      {"sparse reduce-scatter", [] { return std::make_unique<Threshold>(1.0); }, 1, true, true},
  };
  struct Mutation {
    const char* name;
    size_t offset;
    uint32_t value;
  };
  const std::vector<Mutation> headed = {
      {"magic", 0, 0xDEADBEEFu}, {"count", 16, 0x7FFFFFu}, {"first index", 32, 0xFFFFFFF0u}};
  const std::vector<Mutation> bare = {
      {"first index", 0, 0xFFFFFFF0u}, {"fifth index out of order", 16, 0}, {"fifth index", 16, 0x7FFFFFu}};
  for (const CorruptCase& c : cases) {
    for (const Mutation& m : c.bare ? bare : headed) {
      expect_corrupt_from_rank_1(corrupted_run(c.make, c.call, m.offset, m.value, 4, c.shard_only),
                                 std::string(c.name) + ", " + m.name);
    }
  }
}

// A corrupt final list of SparDL (an index outside its block, found where the lists are added to
// the output) fails the step with this rank's residual whole: residual + gradient, nothing sent.
// The lists before it had already written what this rank kept into the residual, losing what it
// had sent on.
TEST(Faults, ACorruptFinalListOfSparDLLeavesTheResidualWhole) {
  std::vector<float> residual;
  std::exception_ptr error;
  run_ranks(
      2,
      [&](int rank, Transport& transport) {
        Corrupting corrupting(transport, rank == 0 ? 2 : -1, 32, 0xFFFFFFF0u);  // call 2: the final lists
        CpuDevice device;
        std::vector<float> g = grad_of(rank, 1000), r(1000, 0.0f);
        SparDL method(0.05, 1);
        try {
          reduce_bucket(&method, corrupting, device, BucketView{DType::kFloat32, 1000, g.data(), r.data()}, {});
        } catch (...) {
          if (rank == 0) error = std::current_exception();
        }
        if (rank == 0) residual = r;
      },
      std::chrono::seconds(30), OnError::kPeersFail);
  expect_corrupt_from_rank_1(error, "SparDL's final list");
  EXPECT_EQ(residual, grad_of(0, 1000));
}

// Control words and announced sizes are checked against what they must be before anything is
// allocated or read: a huge size is not allocated (it used to be, and failed with bad_alloc or
// length_error, which did not stop the engine), a size that is not a multiple of 8 would have
// misaligned every later message, and a huge non-finite count overflowed the sum of counts.
TEST(Faults, ControlWordsAndAnnouncedSizesAreChecked) {
  const auto gather = [] { return std::make_unique<Threshold>(1.0); };
  const auto micro_union = [] { return std::make_unique<MiCRO>(0.05, "union", true, 0); };
  const auto spardl = [] { return std::make_unique<SparDL>(0.05, 1); };
  // Two teams of two: the final lists' sizes travel (call 3, from rank 1) before the lists.
  const auto spardl_teams = [] { return std::make_unique<SparDL>(0.05, 2); };
  constexpr uint64_t kHuge = uint64_t{1} << 62, kLargest = 0xFFFFFFFFu;  // kLargest: the most 4 bytes hold
  struct Case {
    const char* name;
    std::function<std::unique_ptr<Method>()> make;
    int call;
    size_t offset;
    uint64_t value;
    size_t width = 4;
    bool shard_only = false;
    int ranks = 2;
  };
  const auto threshold = gather;
  // A control word of a bucket of 1000 elements: the count at 0 and the non-finite count at 4, 4
  // bytes each; part and kept counts: 4 bytes. The sparse reduce-scatter's row: the non-finite
  // count at 0, then the pairs for each owner's shard (500 elements each), 4 bytes each. SparDL's
  // list sizes: 8 bytes.
  const std::vector<Case> cases = {
      // the fixed-size gather's messages carry the non-finite count in their header, at 24
      {"fixed-size gather: largest non-finite count", [] { return std::make_unique<TopK>(0.05); }, 0, 24, kLargest},
      {"gather: count above the bucket's elements", gather, 0, 0, 1001},
      {"gather: largest count", gather, 0, 0, kLargest},
      {"gather: largest non-finite count", gather, 0, 4, kLargest},
      {"union: largest count", micro_union, 0, 0, kLargest},
      {"SparDL: largest non-finite count", spardl, 0, 4, kLargest},
      {"SparDL: a control word with pairs", spardl, 0, 0, 3},
      {"SparDL: huge Bruck list size", spardl_teams, 3, 0, kHuge, 8, false, 4},
      {"SparDL: Bruck list size not a multiple of 8", spardl_teams, 3, 0, 44, 8, false, 4},
      {"SparDL: Bruck list size below the header", spardl_teams, 3, 0, 8, 8, false, 4},
      {"reduce-scatter + all-gather: largest part count", topk_reduce_scatter, 1, 0, kLargest},
      {"reduce-scatter + all-gather: part count above the sender's selection", topk_reduce_scatter, 1, 0, 51},
      {"reduce-scatter + all-gather: kept count above the owner's shard", topk_reduce_scatter, 3, 0, 501},
      {"reduce-scatter + all-gather: largest kept count", topk_reduce_scatter, 3, 0, kLargest},
      {"sparse reduce-scatter: largest non-finite count", threshold, 0, 0, kLargest, 4, true},
      {"sparse reduce-scatter: pairs above an owner's shard", threshold, 0, 4, 501, 4, true},
      {"sparse reduce-scatter: largest pairs for an owner", threshold, 0, 8, kLargest, 4, true},
  };
  for (const Case& c : cases) {
    expect_corrupt_from_rank_1(corrupted_run(c.make, c.call, c.offset, c.value, c.width, c.shard_only, c.ranks),
                               c.name);
  }
}

// Past 2^32 elements every count on the wire is 8 bytes wide: control words carry counts above
// 2^32 whole (16 bytes per rank), and a forged count that reads negative or above the bucket is
// refused. No bucket memory is touched: exchange_control reads the words alone.
TEST(Faults, EightByteCountsPastTwoToThe32Elements) {
  const BucketView huge{DType::kFloat32, int64_t{1} << 33, nullptr, nullptr};
  const int p = 3;
  std::vector<std::vector<ControlWord>> words(p);
  std::vector<Traffic> traffic(p);
  rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
    const int64_t count = (int64_t{1} << 32) + rank;  // too large for 4 bytes
    CpuDevice device;
    words[rank] = exchange_control(transport, device, ControlWord{count, rank, 0}, huge);
    traffic[rank] = transport.traffic();
  }));
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(traffic[r].bytes_sent, (p - 1) * 16) << r;
    for (int q = 0; q < p; ++q) {
      EXPECT_EQ(words[r][q].count, (int64_t{1} << 32) + q);
      EXPECT_EQ(words[r][q].nonfinite, q);
    }
  }
  for (uint64_t forged : {~uint64_t{0}, (uint64_t{1} << 33) + 1}) {
    const auto errors = run_ranks(
        2,
        [&](int rank, Transport& transport) {
          Corrupting corrupting(transport, rank == 0 ? 0 : -1, 0, forged, 8);
          CpuDevice device;
          exchange_control(corrupting, device, ControlWord{7, 0, 0}, huge);
        },
        std::chrono::seconds(30), OnError::kPeersFail);
    expect_corrupt_from_rank_1(errors[0], "a forged 8-byte count " + std::to_string(forged));
  }
}

/// A transport whose `target_call`-th allgather fails to allocate.
class FailingAllocation final : public Forwarding {
 public:
  FailingAllocation(Transport& inner, int target_call) : Forwarding(inner), target_(target_call) {}
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    if (calls_++ == target_) throw std::bad_alloc();
    Forwarding::allgather(device, send, recv, bytes);
  }

 private:
  int target_;
  int calls_ = 0;
};

// An allocation that fails inside an exchange leaves the rank out of step with its peers: it is
// reported as a CorruptMessageError (which stops the engine), not a bare std::bad_alloc.
TEST(Faults, AnAllocationFailureInAnExchangeIsACorruptMessageError) {
  const auto errors = run_ranks(
      2,
      [&](int rank, Transport& transport) {
        FailingAllocation failing(transport, rank == 0 ? 1 : -1);
        CpuDevice device;
        std::vector<float> g = grad_of(rank, 1000);
        Threshold method(1.0);
        ReduceOptions options;
        options.bucket_name = "bucket 3";
        reduce_bucket(&method, failing, device, BucketView{DType::kFloat32, 1000, g.data(), nullptr}, options);
      },
      std::chrono::seconds(30), OnError::kPeersFail);  // rank 1 stops once rank 0 has failed
  ASSERT_TRUE(errors[0]);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const CorruptMessageError& e) {
    EXPECT_NE(std::string(e.what()).find("bucket 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("allocation failed"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected CorruptMessageError, got " << e.what();
  }
  EXPECT_TRUE(errors[1]) << "rank 1 must time out waiting for rank 0";
}

}  // namespace
