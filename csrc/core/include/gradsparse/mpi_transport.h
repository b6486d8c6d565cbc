// MpiTransport: the core's Transport over MPI (built when MPI is found: GRADSPARSE_WITH_MPI), for
// programs launched with mpirun, from C++ or from Python (`transport="mpi"`). Buffers on a CUDA
// device are staged through host memory, so any MPI works; a CUDA-aware MPI is not required.
#pragma once

#include <climits>
#include <cstddef>
#include <memory>
#include <vector>

#include "gradsparse/transport.h"

namespace gradsparse {

/// True when this build has MPI support.
bool mpi_available();

/// Ends every process of the MPI job (MPI_Abort on MPI_COMM_WORLD with `code`) when MPI is
/// initialised and not finalised; otherwise (or without MPI support) does nothing. For a process
/// that is dying of an error: at its exit MPI_Finalize would wait for every other rank, while
/// they wait in a collective for this one.
void mpi_abort(int code);

class MpiTransport final : public Transport {
 public:
  /// A transport over a private duplicate of MPI_COMM_WORLD. Initialises MPI when nobody has
  /// (asking for MPI_THREAD_MULTIPLE: each state's engine thread calls MPI); finalises it at exit
  /// only if it initialised it. MPI initialised by the program at MPI_THREAD_SERIALIZED (one
  /// thread at a time) admits one transport at a time, and none while `other_mpi_threads` (the
  /// threads of this process besides gradsparse's engines that call MPI: torch.distributed's MPI
  /// process group runs one) is above zero; below it, none. The refusals name the thread level
  /// and how to ask for MPI_THREAD_MULTIPLE. Throws ValueError with a clear message when the build
  /// has no MPI.
  static std::unique_ptr<MpiTransport> world(int other_mpi_threads = 0);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override;
  void allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) override;
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override;
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override;

  /// The largest count one MPI call is given: INT_MAX, as MPI's counts are ints. sendrecv moves a
  /// larger message in pieces of at most this many bytes; the collectives refuse larger counts,
  /// alike on every rank. Tests lower it to move small messages in pieces.
  void set_max_count(size_t count);

 private:
  MpiTransport() = default;
  struct Comm;
  std::unique_ptr<Comm> comm_;
  int rank_ = 0;
  int size_ = 1;
  size_t max_count_ = INT_MAX;
};

}  // namespace gradsparse
