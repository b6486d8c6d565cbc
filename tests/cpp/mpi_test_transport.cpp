// MpiTransport under mpirun (2 to 4 ranks): the collectives, and every exchange through
// reduce_bucket against a reference every rank computes from all ranks' (reproducible) data.
#include <gtest/gtest.h>
#include <mpi.h>

#include <climits>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/mpi_transport.h"
#include "gradsparse/reduce_bucket.h"
#include "reference.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

MpiTransport* transport = nullptr;

TEST(MpiTransport, Collectives) {
  CpuDevice device;
  const int p = transport->size(), r = transport->rank();
  std::vector<int32_t> mine{r, 10 * r}, all(2 * p);
  transport->allgather(device, mine.data(), all.data(), sizeof(int32_t) * 2);
  for (int q = 0; q < p; ++q) EXPECT_EQ(all[2 * q + 1], 10 * q);

  // Variable blocks (rank q sends q bytes, rank 0 none), back to back, only those bytes counted.
  std::vector<size_t> sizes(p);
  for (int q = 0; q < p; ++q) sizes[q] = static_cast<size_t>(q);
  std::vector<unsigned char> block(r, static_cast<unsigned char>(r)), blocks(p * (p - 1) / 2);
  const int64_t before = transport->traffic().bytes_received;
  transport->allgatherv(device, block.data(), blocks.data(), sizes);
  for (int q = 0, at = 0; q < p; ++q)
    for (int j = 0; j < q; ++j) EXPECT_EQ(blocks[at++], q);
  EXPECT_EQ(transport->traffic().bytes_received - before, p * (p - 1) / 2 - r);

  std::vector<double> d{1.0 + r, 0.5};
  transport->allreduce_sum(device, d.data(), 2, DType::kFloat64);
  EXPECT_EQ(d[0], p + p * (p - 1) / 2.0);
  EXPECT_EQ(d[1], 0.5 * p);
  std::vector<Half> h{Num<Half>::from_float(1.5f)};
  transport->allreduce_sum(device, h.data(), 1, DType::kFloat16);
  EXPECT_EQ(Num<Half>::to_float(h[0]), 1.5f * p);

  // A ring: send to the right, receive from the left.
  std::vector<int64_t> out{r}, in{-1};
  transport->sendrecv(device, out.data(), 8, (r + 1) % p, in.data(), 8, (r + p - 1) % p);
  EXPECT_EQ(in[0], (r + p - 1) % p);
}

// A message over the largest count of one MPI call (INT_MAX bytes; here lowered to 5) goes in
// pieces, whatever the size of the message the rank receives: rank q sends 6 * q bytes (none,
// one piece and a byte, ...) around the ring. The sizes were refused only on the ranks that had
// them, leaving their peers waiting for the message.
TEST(MpiTransport, SendrecvMovesMessagesOverTheCountInPieces) {
  CpuDevice device;
  const int p = transport->size(), r = transport->rank();
  const int left = (r + p - 1) % p;
  const auto message = [](int q) {
    std::vector<unsigned char> bytes(static_cast<size_t>(6 * q));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(31 * q + i);
    return bytes;
  };
  const std::vector<unsigned char> out = message(r), expected = message(left);
  std::vector<unsigned char> in(expected.size(), 0);
  const int64_t sent = transport->traffic().bytes_sent, received = transport->traffic().bytes_received;
  transport->set_max_count(5);
  try {
    transport->sendrecv(device, out.data(), out.size(), (r + 1) % p, in.data(), in.size(), left);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  transport->set_max_count(INT_MAX);
  EXPECT_EQ(in, expected);
  EXPECT_EQ(transport->traffic().bytes_sent - sent, static_cast<int64_t>(out.size()));
  EXPECT_EQ(transport->traffic().bytes_received - received, static_cast<int64_t>(in.size()));
}

// A message shorter than its receive (each rank sends 4 bytes to the right and expects 8 from the
// left; in pieces of 5: 9 bytes against 10, the last piece short) fails on every rank that got
// one, naming the sizes. MPI accepts a short receive, and the rest of the buffer passed as
// received. The ranks stay in step: the next sendrecv works.
TEST(MpiTransport, SendrecvRefusesAShortMessage) {
  CpuDevice device;
  const int p = transport->size(), r = transport->rank();
  for (const size_t max_count : {size_t{INT_MAX}, size_t{5}}) {
    const size_t sent = max_count == 5 ? 9 : 4, expected = sent + (max_count == 5 ? 1 : 4);
    std::vector<unsigned char> out(sent, static_cast<unsigned char>(r)), in(expected, 0);
    transport->set_max_count(max_count);
    try {
      transport->sendrecv(device, out.data(), sent, (r + 1) % p, in.data(), expected, (r + p - 1) % p);
      ADD_FAILURE() << "rank " << r << " accepted " << sent << " bytes for " << expected;
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(str("rank ", r, " expected ", expected, " bytes from rank ", (r + p - 1) % p,
                                               " but got ", sent, "; every pair must agree on message sizes")),
                std::string::npos)
          << e.what();
    }
    transport->set_max_count(INT_MAX);
  }
  std::vector<int64_t> out{r}, in{-1};
  transport->sendrecv(device, out.data(), 8, (r + 1) % p, in.data(), 8, (r + p - 1) % p);
  EXPECT_EQ(in[0], (r + p - 1) % p);
}

// Blocks whose total passes the largest count of one MPI call (INT_MAX bytes; here lowered to 5)
// go in rounds, whatever each block's size: rank q sends 4 q + 6 bytes (pieces and a part),
// rank 0 none where `empty`. Such sizes were refused on every rank: gather-and-add stopped at
// about 1% density with 25M-element buckets on 1024 ranks.
TEST(MpiTransport, AllgathervMovesBlocksOverTheCountInRounds) {
  CpuDevice device;
  const int p = transport->size(), r = transport->rank();
  for (bool empty : {false, true}) {
    std::vector<size_t> sizes(p);
    for (int q = 0; q < p; ++q) sizes[q] = empty && q == 0 ? 0 : static_cast<size_t>(4 * q + 6);
    const auto byte = [](int q, size_t i) { return static_cast<unsigned char>(17 * q + i); };
    std::vector<unsigned char> mine(sizes[r]), all;
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = byte(r, i);
    std::vector<unsigned char> expected;
    for (int q = 0; q < p; ++q)
      for (size_t i = 0; i < sizes[q]; ++i) expected.push_back(byte(q, i));
    all.assign(expected.size(), 0);
    transport->set_max_count(5);
    try {
      transport->allgatherv(device, mine.data(), all.data(), sizes);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    transport->set_max_count(INT_MAX);
    EXPECT_EQ(all, expected) << "empty=" << empty;
  }
}

std::vector<float> grad_of(int rank, int step, int64_t n) { return ref::random_vector<float>(n, 1000 * step + rank); }

// Every exchange: the update equals the average of what the re-run of each rank's selection
// sends, and gradient mass is conserved.
TEST(MpiTransport, ExchangesConserveMassAndAgree) {
  const int p = transport->size(), r = transport->rank();
  const int64_t n = 50000;
  std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<TopK>(0.01); },
      [] { return std::make_unique<MiCRO>(0.01, "union", false, 1); },
      [] { return std::make_unique<ExDyna>(0.01, "gather", true, 1); },
      [] { return std::make_unique<RandomK>(0.01, 1); },
      [] { return std::make_unique<RandomBlock>(0.01, 1); },
      [] { return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 1, std::nullopt, std::nullopt); },
  };
  CpuDevice device;
  for (auto& make : makers) {
    auto method = make();
    std::vector<float> residual(n, 0.0f);
    for (int step = 0; step < 4; ++step) {
      std::vector<float> out = grad_of(r, step, n);
      std::vector<double> before(n);
      for (int64_t i = 0; i < n; ++i) before[i] = double(out[i]) + residual[i];
      reduce_bucket(method.get(), *transport, device, BucketView{DType::kFloat32, n, out.data(), residual.data()},
                    ReduceOptions{});
      // Sum over ranks of (grad + old residual) and of the new residual: all-reduce in float64.
      std::vector<double> after(n);
      for (int64_t i = 0; i < n; ++i) after[i] = residual[i];
      transport->allreduce_sum(device, before.data(), n, DType::kFloat64);
      transport->allreduce_sum(device, after.data(), n, DType::kFloat64);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(after[i] + p * double(out[i]), before[i], 1e-4 * (1.0 + std::fabs(before[i])))
            << method->name() << " step " << step << " element " << i;
      // Every rank holds the same update.
      std::vector<float> all(static_cast<size_t>(n) * p);
      transport->allgather(device, out.data(), all.data(), n * sizeof(float));
      for (int q = 1; q < p; ++q)
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(all[q * n + i], all[i]) << method->name();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = MpiTransport::world();
  transport = world.get();
  if (transport->rank() != 0) ::testing::GTEST_FLAG(brief) = true;
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  world.reset();
  return failed;
}
