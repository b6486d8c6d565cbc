// MpiTransport (mpi_transport.h). Compiled in every build; without MPI its entry point reports
// how to get it.
#include "gradsparse/mpi_transport.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <string>

#include "gradsparse/kernels.h"

#if defined(GRADSPARSE_WITH_MPI)
#include <mpi.h>
#endif

namespace gradsparse {

#if !defined(GRADSPARSE_WITH_MPI)

bool mpi_available() { return false; }
void mpi_abort(int) {}

struct MpiTransport::Comm {};

std::unique_ptr<MpiTransport> MpiTransport::world(int) {
  throw ValueError(
      "transport=\"mpi\" needs gradsparse built with MPI: install an MPI (for example apt-get install "
      "libopenmpi-dev openmpi-bin) and rebuild gradsparse with it (the Python package: pip install "
      "--no-build-isolation .; the C++ core: cmake -DGRADSPARSE_MPI=ON); or use the default transport, the "
      "torch.distributed process group");
}

MpiTransport::~MpiTransport() = default;
void MpiTransport::allgather(const Device&, const void*, void*, size_t) {}
void MpiTransport::allgatherv(Device&, const void*, void*, const std::vector<size_t>&) {}
void MpiTransport::allreduce_sum(const Device&, void*, size_t, DType) {}
void MpiTransport::sendrecv(const Device&, const void*, size_t, int, void*, size_t, int) {}
void MpiTransport::set_max_count(size_t) {}

#else

bool mpi_available() { return true; }

void mpi_abort(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

namespace {

/// The most bytes allgatherv stages per round where its blocks pass MPI's int count.
constexpr size_t kMostStagedBytes = size_t{1} << 28;

void check(int status, const char* what) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  throw CommError(str("MPI call failed: ", what, ": ", std::string(text, static_cast<size_t>(length))));
}

/// Finalises MPI at exit when gradsparse initialised it.
struct Finalizer {
  bool ours = false;
  int thread_level = MPI_THREAD_SINGLE;  ///< what MPI provided
  std::atomic<int> live{0};              ///< MpiTransports alive (each driven by its own thread)
  ~Finalizer() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (ours && !finalized) MPI_Finalize();
  }
};
Finalizer finalizer;

/// An MPI thread level by the name of its constant.
std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return str("thread level ", level);
}

/// How a program that initialises MPI itself asks for the level that admits every caller.
constexpr const char* kAskForMultiple =
    "initialise MPI at MPI_THREAD_MULTIPLE (mpi4py: set mpi4py.rc.thread_level = \"multiple\" before "
    "`from mpi4py import MPI`; C or C++: MPI_Init_thread with MPI_THREAD_MULTIPLE, not MPI_Init)";

/// Sums 16-bit floats (MPI has no such type): widened to float, rounded once per addition.
template <typename T>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Num<T>::from_float(Num<T>::to_float(a[i]) + Num<T>::to_float(b[i]));
}

/// Host copies of device buffers (no-ops on the CPU).
struct Staged {
  const Device& device;
  void* data;
  size_t bytes;
  std::vector<unsigned char> host;
  Staged(const Device& d, void* p, size_t n, bool load) : device(d), data(p), bytes(n) {
    if (device.kind() == DeviceKind::kCPU) return;
    host.resize(n);
    if (load && n > 0) const_cast<Device&>(device).copy_to_host(host.data(), p, n);
  }
  void* get() { return device.kind() == DeviceKind::kCPU ? data : host.data(); }
  void store() {
    if (device.kind() != DeviceKind::kCPU && bytes > 0)
      const_cast<Device&>(device).copy_from_host(data, host.data(), bytes);
  }
};

}  // namespace

struct MpiTransport::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Datatype u16 = MPI_DATATYPE_NULL;
  MPI_Op sum_half = MPI_OP_NULL;
  MPI_Op sum_bfloat16 = MPI_OP_NULL;
};

std::unique_ptr<MpiTransport> MpiTransport::world(int other_mpi_threads) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &finalizer.thread_level), "MPI_Init_thread");
    finalizer.ours = true;
  } else {
    MPI_Query_thread(&finalizer.thread_level);
  }
  // The engine calls MPI from its own thread: one engine needs MPI_THREAD_SERIALIZED, several
  // (several states in one process), or one beside other threads that call MPI, MPI_THREAD_MULTIPLE.
  const std::string level = thread_level_name(finalizer.thread_level);
  GS_CHECK(finalizer.thread_level >= MPI_THREAD_SERIALIZED, CommError,
           "transport=\"mpi\": ", finalizer.ours ? "this MPI provides at most " : "the program initialised MPI at ",
           level, ", but gradsparse's engine thread calls MPI, which needs MPI_THREAD_SERIALIZED or higher; ",
           finalizer.ours ? "use an MPI built with thread support" : kAskForMultiple,
           ", or use transport=\"process_group\" (the default)");
  GS_CHECK(finalizer.thread_level >= MPI_THREAD_MULTIPLE || other_mpi_threads == 0, ValueError,
           "transport=\"mpi\": MPI was initialised at ", level,
           " (one thread at a time may call MPI), and another thread of this process calls MPI beside "
           "gradsparse's engine thread (torch.distributed's MPI process group, backend \"mpi\", runs one); use "
           "transport=\"process_group\" (the exchanges then go through that group), or ",
           kAskForMultiple, " before torch.distributed.init_process_group");
  GS_CHECK(finalizer.thread_level >= MPI_THREAD_MULTIPLE || finalizer.live.load() == 0, ValueError,
           "transport=\"mpi\": MPI was initialised at ", level,
           " (one thread at a time may call MPI), and another transport=\"mpi\" state is alive in this process; "
           "close() it first, ",
           kAskForMultiple, ", or use the default transport");
  std::unique_ptr<MpiTransport> t(new MpiTransport());
  t->comm_ = std::make_unique<Comm>();
  ++finalizer.live;  // from here on its destructor counts it off, also where a call below throws
  check(MPI_Comm_dup(MPI_COMM_WORLD, &t->comm_->comm), "MPI_Comm_dup");
  MPI_Comm_rank(t->comm_->comm, &t->rank_);
  MPI_Comm_size(t->comm_->comm, &t->size_);
  check(MPI_Type_contiguous(2, MPI_BYTE, &t->comm_->u16), "MPI_Type_contiguous");
  check(MPI_Type_commit(&t->comm_->u16), "MPI_Type_commit");
  check(MPI_Op_create(&sum_16bit<Half>, 1, &t->comm_->sum_half), "MPI_Op_create");
  check(MPI_Op_create(&sum_16bit<BFloat16>, 1, &t->comm_->sum_bfloat16), "MPI_Op_create");
  return t;
}

MpiTransport::~MpiTransport() {
  if (!comm_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {  // what world() made, where it got that far
    if (comm_->sum_half != MPI_OP_NULL) MPI_Op_free(&comm_->sum_half);
    if (comm_->sum_bfloat16 != MPI_OP_NULL) MPI_Op_free(&comm_->sum_bfloat16);
    if (comm_->u16 != MPI_DATATYPE_NULL) MPI_Type_free(&comm_->u16);
    if (comm_->comm != MPI_COMM_NULL) MPI_Comm_free(&comm_->comm);
  }
  // Counted off only now: below MPI_THREAD_MULTIPLE a transport made on another thread may call
  // MPI as soon as it reads 0, and these calls must be over by then.
  --finalizer.live;
}

void MpiTransport::set_max_count(size_t count) {
  GS_CHECK(count > 0 && count <= static_cast<size_t>(INT_MAX), ValueError,
           "MpiTransport.set_max_count: the count must be in [1, INT_MAX], got ", count);
  max_count_ = count;
}

/// MPI counts are ints: larger counts are a clear error, not an overflow. Only for counts every
/// rank has alike (a refusal on one rank alone would leave its peers waiting in the collective).
static int mpi_count(size_t count, size_t max_count, const char* what) {
  GS_CHECK(count <= max_count, ValueError, "MpiTransport.", what, ": ", count, " elements exceed MPI's int count (",
           max_count, "); use smaller buckets (DDP's bucket_cap_mb)");
  return static_cast<int>(count);
}

void MpiTransport::allgather(const Device& device, const void* send, void* recv, size_t bytes) {
  GS_CHECK(bytes > 0, ValueError, "MpiTransport.allgather: zero-length collective");
  const int n = mpi_count(bytes, max_count_, "allgather");
  Staged in(device, const_cast<void*>(send), bytes, true);
  Staged out(device, recv, bytes * size_, false);
  check(MPI_Allgather(in.get(), n, MPI_BYTE, out.get(), n, MPI_BYTE, comm_->comm), "MPI_Allgather");
  out.store();
  count_allgather(bytes);
}

void MpiTransport::allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) {
  check_allgatherv(sizes, "MpiTransport");
  const std::vector<size_t> at = block_offsets(sizes);
  const size_t p = sizes.size(), largest = *std::max_element(sizes.begin(), sizes.end());
  Staged in(device, const_cast<void*>(send), sizes[static_cast<size_t>(rank_)], true);
  Staged out(device, recv, at.back(), false);
  auto* const sending = static_cast<unsigned char*>(in.get());
  auto* const receiving = static_cast<unsigned char*>(out.get());
  // MPI's counts and displacements are ints. Where the blocks fit max_count_ bytes in all, one
  // call moves them straight into the output. Beyond it (gather-and-add at thousands of ranks),
  // round j moves bytes [j piece, (j + 1) piece) of every block through a buffer of P pieces, at
  // most max_count_ and kMostStagedBytes bytes; every rank computes the same rounds from the same
  // sizes. Refusing such sizes stopped the step on every rank.
  const bool direct = at.back() <= max_count_;
  const size_t piece = direct ? largest : std::max<size_t>(1, std::min(max_count_, kMostStagedBytes) / p);
  const size_t rounds = direct ? 1 : (largest + piece - 1) / piece;  // not direct: some block holds bytes
  std::vector<unsigned char> staged(direct ? 0 : piece * p);
  std::vector<int> counts(p), offsets(p);
  for (size_t round = 0; round < rounds; ++round) {
    const size_t from = round * piece;
    for (size_t r = 0; r < p; ++r) {
      counts[r] = static_cast<int>(sizes[r] > from ? std::min(piece, sizes[r] - from) : 0);
      offsets[r] = static_cast<int>(direct ? at[r] : r * piece);
    }
    check(MPI_Allgatherv(sending + (counts[rank_] > 0 ? from : 0), counts[rank_], MPI_BYTE,
                         direct ? receiving : staged.data(), counts.data(), offsets.data(), MPI_BYTE, comm_->comm),
          "MPI_Allgatherv");
    for (size_t r = 0; r < p && !direct; ++r)
      if (counts[r] > 0) std::memcpy(receiving + at[r] + from, staged.data() + r * piece, counts[r]);
  }
  out.store();
  count_allgatherv(sizes);
}

void MpiTransport::allreduce_sum(const Device& device, void* data, size_t count, DType dtype) {
  const size_t bytes = count * dtype_size(dtype);
  GS_CHECK(bytes > 0, ValueError, "MpiTransport.allreduce_sum: zero-length collective");
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op op = MPI_SUM;
  switch (dtype) {
    case DType::kFloat32:
      break;
    case DType::kFloat64:
      type = MPI_DOUBLE;
      break;
    case DType::kInt64:
      type = MPI_INT64_T;
      break;
    case DType::kFloat16:
      type = comm_->u16;
      op = comm_->sum_half;
      break;
    case DType::kBFloat16:
      type = comm_->u16;
      op = comm_->sum_bfloat16;
      break;
  }
  Staged buffer(device, data, bytes, true);
  check(MPI_Allreduce(MPI_IN_PLACE, buffer.get(), mpi_count(count, max_count_, "allreduce_sum"), type, op, comm_->comm),
        "MPI_Allreduce");
  buffer.store();
  count_allreduce(bytes);
}

void MpiTransport::sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv,
                            size_t recv_bytes, int src) {
  Staged out(device, const_cast<void*>(send), send_bytes, true);
  Staged in(device, recv, recv_bytes, false);
  // A message over MPI's int count goes in pieces of at most max_count_ bytes, piece k of each
  // direction in call k, so both ends of every message make as many calls for it (the peer that
  // receives this rank's send counts its pieces from the same size). Messages up to max_count_
  // bytes take one MPI_Sendrecv, as always. Refusing a large message instead failed only the
  // rank that had it and left its peer waiting for it.
  const auto pieces = [&](size_t bytes) { return (bytes + max_count_ - 1) / max_count_; };
  const size_t calls = std::max({pieces(send_bytes), pieces(recv_bytes), size_t{1}});
  auto* const sending = static_cast<unsigned char*>(out.get());
  auto* const receiving = static_cast<unsigned char*>(in.get());
  // MPI accepts a shorter message than the receive posted, leaving the rest of `recv` as it was:
  // every piece's length is checked, and a short one raised after the last call, so that this
  // rank's own pieces all reach `dst` first.
  size_t received = 0;
  bool short_piece = false;
  for (size_t call = 0; call < calls; ++call) {
    const size_t at = call * max_count_;
    const size_t s = send_bytes > at ? std::min(max_count_, send_bytes - at) : 0;
    const size_t r = recv_bytes > at ? std::min(max_count_, recv_bytes - at) : 0;
    MPI_Status status;
    check(MPI_Sendrecv(s > 0 ? sending + at : sending, static_cast<int>(s), MPI_BYTE, s > 0 ? dst : MPI_PROC_NULL, 0,
                       r > 0 ? receiving + at : receiving, static_cast<int>(r), MPI_BYTE, r > 0 ? src : MPI_PROC_NULL,
                       0, comm_->comm, &status),
          "MPI_Sendrecv");
    int got = 0;
    check(MPI_Get_count(&status, MPI_BYTE, &got), "MPI_Get_count");
    received += static_cast<size_t>(got);
    short_piece = short_piece || static_cast<size_t>(got) != r;
  }
  GS_CHECK(!short_piece, CommError, "MpiTransport.sendrecv: rank ", rank_, " expected ", recv_bytes,
           " bytes from rank ", src, " but got ", received, "; every pair must agree on message sizes");
  in.store();
  count_sendrecv(send_bytes, recv_bytes);
}

#endif

}  // namespace gradsparse
