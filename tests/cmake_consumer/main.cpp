// Two ranks on threads (ThreadTransport) each reduce one small bucket with Top-k through the
// installed headers and library: the result must be the average of the ranks' selections, and each
// residual what its rank did not send; the program sees MPI (GRADSPARSE_WITH_MPI) exactly where the
// library was built with it, and gradsparse/version.h names the version of the CMake package that
// find_package found. Returns 1 on a wrong result or an error.
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/mpi_transport.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/transport.h"
#include "gradsparse/version.h"
#if defined(GRADSPARSE_WITH_CUDA)
#include "gradsparse/cuda_device.h"
#endif

using namespace gradsparse;

int main() {
  // Top-k at density 0.25 of 8 elements keeps each rank's 2 largest magnitudes: rank 0's at 1 and 5,
  // rank 1's at 0 and 5. Every value is exact in float, so the results are compared exactly.
  const std::vector<std::vector<float>> grads = {{0.25f, -3.0f, 0.5f, 0.0f, 0.75f, 2.0f, -0.5f, 0.0f},
                                                 {4.0f, 0.5f, 0.0f, -0.25f, 0.75f, 1.0f, 0.0f, 0.5f}};
  const std::vector<float> average = {2.0f, -1.5f, 0.0f, 0.0f, 0.0f, 1.5f, 0.0f, 0.0f};
  const std::vector<std::vector<float>> unsent = {{0.25f, 0.0f, 0.5f, 0.0f, 0.75f, 0.0f, -0.5f, 0.0f},
                                                  {0.0f, 0.5f, 0.0f, -0.25f, 0.75f, 0.0f, 0.0f, 0.5f}};
  const int world = static_cast<int>(grads.size());
  std::vector<std::vector<float>> buckets = grads;
  std::vector<std::vector<float>> residuals(world, std::vector<float>(average.size(), 0.0f));
  std::vector<std::exception_ptr> errors(world);
  auto group = ThreadGroup::create(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      try {
        std::unique_ptr<Transport> transport = group->transport(r);
        TopK method(0.25);
        CpuDevice device;
        BucketView bucket{DType::kFloat32, static_cast<int64_t>(average.size()), buckets[r].data(),
                          residuals[r].data()};
        reduce_bucket(&method, *transport, device, bucket, ReduceOptions{});
      } catch (...) {
        errors[r] = std::current_exception();
        group->abort("rank " + std::to_string(r) + " failed");
      }
    });
  }
  for (std::thread& rank : ranks) rank.join();
  int status = 0;
  for (int r = 0; r < world; ++r) {
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      status = 1;
      continue;
    }
    for (size_t i = 0; i < average.size(); ++i) {
      if (buckets[r][i] != average[i] || residuals[r][i] != unsent[r][i]) {
        std::fprintf(stderr, "rank %d, element %zu: result %g (expected %g), residual %g (expected %g)\n", r, i,
                     buckets[r][i], average[i], residuals[r][i], unsent[r][i]);
        status = 1;
      }
    }
  }
#if defined(GRADSPARSE_WITH_MPI)
  const bool with_mpi = true;
#else
  const bool with_mpi = false;
#endif
  if (mpi_available() != with_mpi) {
    std::fprintf(stderr, "the library's mpi_available() is %d, but GRADSPARSE_WITH_MPI is %s\n", mpi_available(),
                 with_mpi ? "defined" : "not defined");
    status = 1;
  }
  if (std::strcmp(GRADSPARSE_VERSION_STRING, GRADSPARSE_PACKAGE_VERSION) != 0) {
    std::fprintf(stderr, "gradsparse/version.h says %s, but find_package(gradsparse) found version %s\n",
                 GRADSPARSE_VERSION_STRING, GRADSPARSE_PACKAGE_VERSION);
    status = 1;
  }
#if defined(GRADSPARSE_WITH_CUDA)
  cuda_check(cudaSuccess, "cudaSuccess");  // gradsparse::core_cuda links (no GPU needed)
#endif
  if (status == 0)
    std::printf("gradsparse::core %s from the install prefix: Top-k over 2 thread ranks is right, MPI %s\n",
                GRADSPARSE_VERSION_STRING, with_mpi ? "on" : "off");
  return status;
}
