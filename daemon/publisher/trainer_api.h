// TrainerApi (proto/refit/v1/local.proto) of the publisher daemon, served on `local_socket`.
//
// Trainer processes ("clients", e.g. one per tensor-parallel rank) register the tensors they
// expose as regions of shared memory they own (memfds via /proc/<pid>/fd/<n>, POSIX shm objects),
// or as CUDA IPC regions of their own GPU allocations (no extra copy of the weights on the
// trainer's GPU). Each region is validated before RegisterTensors returns:
//   shm: dtype, shape, name, range inside the object, size = dtype size x elements, and the
//     object must be shared memory of the calling trainer (OpenShmObject): shm_name, a path
//     /proc/<caller pid>/fd/<n> (the trainer's own fd; another process's is refused) or
//     /dev/shm/<name>, opened O_RDONLY | O_NONBLOCK (O_NOFOLLOW for names), a regular file on
//     tmpfs/hugetlbfs (no file on disk), owned by the caller's uid, and, except memfds (always
//     mode 0777, reachable only through their owner's fds), not world-writable. The caller's
//     pid/uid come from PeerCredOf (SO_PEERCRED of the unix socket; TrainerApi is served on the
//     local socket only); without credentials (in-process DoRegister with no peer) the pid/uid
//     checks are skipped.
//     A region is never mapped where the trainer could shrink it under the mapping (SIGBUS in
//     the daemon): a memfd that allows sealing is sealed F_SEAL_SHRINK | F_SEAL_GROW at
//     registration (the trainer can no longer resize it: TrainerClient and refit.trainer create
//     it MFD_ALLOW_SEALING at its final size and seal it themselves) and mapped read-only
//     (MAP_SHARED); any other object (a /dev/shm object, a memfd without MFD_ALLOW_SEALING) is
//     not mapped but read with pread at each Publish, so a shrunk object is a
//     FAILED_PRECONDITION naming client, tensor and object, and the daemon keeps serving.
//   cuda_ipc: 64-byte handle, 16-byte GPU UUID, size = the tensor's bytes, offset + size inside
//     the allocation (allocation_bytes when given, and the driver's size of the opened
//     allocation). The GPU is opened through the service's DeviceProvider (by UUID) and each
//     distinct handle is opened once per registration, shared by the client's tensors in it
//     and closed when the client unregisters, registers again, or the service goes away.
//     Without a usable GPU (none, built without CUDA, no provider): FAILED_PRECONDITION naming
//     the client, the tensor and the GPU UUID.
//
// Publish(client, version): a version is committed once every registered client has published
// it; all clients' tensors are then queued as one version on the PublishQueue. The trainer may
// overwrite its memory once its Publish returns:
//   - The client that completes the round (the only client, or the last one to publish) with a
//     call WITHOUT a deadline lends its mapped shared-memory tensors (sealed memfds) to the
//     publish instead of copying them: its Publish returns once the publisher's pass has read
//     them and the version is committed (InputsRelease; before persistence), so the one pass
//     reads the trainer's memory directly. A call with a deadline is copied like any other:
//     gRPC ends a call on the client's side when its deadline passes, whatever the server still
//     does, so only a call that cannot expire can promise that the trainer waits for the pass.
//     A lent job whose call was cancelled before the job started is not run (Cancelled); once
//     started, the call waits for the pass (one read of the model). A publish that fails
//     returns its error. If the round turns out not to complete (a client registered
//     meanwhile), the lent tensors are copied before the call returns.
//   - Every other client, and tensors read with pread or in CUDA memory, are copied into
//     daemon-owned memory (the snapshot) and the call returns at once (committed = false for a
//     client that did not complete the round). Shared-memory tensors go to host buffers; CUDA
//     tensors (TrainerApiOptions::cuda_snapshot) to host buffers (CPU codec: one D2H copy), to
//     device memory on the same GPU (GPU baseline device: one D2D copy, which then becomes the
//     GPU baseline, see PublisherCore) or to pinned host memory (GPU baseline pinned).
// LocalPublishResponse.committed = true: the version is queued (and, for a lending client, its
// tensors read and committed); snapshot_micros is the time the call held the trainer's memory.
// All clients must publish the same number: the first client of a round fixes it (its request,
// or PublishQueue::ChooseVersion), later ones must match or omit it.
//
// Sliced tensors (TensorLocation.slice: a sharded trainer's local blocks, tensor_slice.h): any
// clients register blocks of one tensor name; RegisterTensors refuses a block whose dtype or
// whole shape differs from another client's block of that tensor, or that overlaps one
// (InvalidArgument naming the tensor and both clients), and a name registered whole by one
// client and sliced by another (AlreadyExists). Each client's Publish snapshots (or lends) its
// blocks like whole tensors; the commit of the round checks that every sliced tensor's blocks
// tile it (FailedPrecondition naming the tensor, what is uncovered and the blocks: the round is
// dropped and nothing is queued), then joins each into one whole tensor (the blocks copied into
// place, then freed), which is published as any whole tensor: encoding, the wire, subscribers and
// consumers see only whole tensors, and a new block layout (a resized job) is still a delta.
// CUDA blocks are joined on the host: they need cuda_snapshot kHost (FailedPrecondition at
// RegisterTensors otherwise).
// On a shard publisher (TrainerApiOptions::parts) a tensor's blocks need only tile the whole rows
// [a, b) along dim 0 that they span: they are joined into a buffer of those rows and published as
// a part (TensorSpec.part), or as the whole tensor when [a, b) is every row; blocks that do not
// tile whole rows fail the commit (FailedPrecondition, nothing queued); a tensor whose blocks here
// hold no elements is not published by this publisher (shard_part.h, trainer_api_join.cc).
//
// Thread-safe.
#ifndef REFIT_DAEMON_PUBLISHER_TRAINER_API_H_
#define REFIT_DAEMON_PUBLISHER_TRAINER_API_H_

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cuda/device.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/peer_cred.h"
#include "daemon/publisher/device_cache.h"
#include "daemon/publisher/join_buffers.h"
#include "daemon/publisher/mapped_tensor.h"
#include "daemon/publisher/publisher_control.h"
#include "daemon/publisher/shard_part.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

// Where Publish snapshots CUDA tensors.
enum class CudaSnapshot {
  kHost,    // pageable host buffers (the CPU codec encodes them)
  kDevice,  // device memory of the tensor's GPU (GPU encoding, gpu_baseline device)
  kPinned,  // pinned host memory (GPU encoding, gpu_baseline pinned)
};

struct TrainerApiOptions {
  // Threads copying shared-memory snapshots (0 = one per hardware thread).
  int copy_threads = 0;
  // Opens GPUs by UUID for CUDA IPC regions; empty: CUDA regions are refused.
  DeviceProvider devices;
  CudaSnapshot cuda_snapshot = CudaSnapshot::kHost;
  // A shard publisher's (publisher.shard count > 0): a sliced tensor's blocks may tile whole rows
  // [a, b) of it instead of all of it; they are joined into a buffer of those rows only and
  // published as a part (TensorSpec.part; shard_part.h). False: the blocks must tile the tensor.
  bool parts = false;
};

class TrainerApiService final : public v1::TrainerApi::Service {
 public:
  // `queue` must outlive the service. Snapshots are copied with `copy_threads` threads (0 = one
  // per hardware thread). No CUDA regions.
  explicit TrainerApiService(PublishQueue* queue, int copy_threads = 0);
  // The devices the provider hands out must outlive the service and every version it queues.
  TrainerApiService(PublishQueue* queue, TrainerApiOptions options);
  ~TrainerApiService() override;

  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               const v1::RegisterTensorsRequest* request,
                               v1::RegisterTensorsResponse* response) override;
  grpc::Status Unregister(grpc::ServerContext* context, const v1::UnregisterRequest* request,
                          v1::UnregisterResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::LocalPublishRequest* request,
                       v1::LocalPublishResponse* response) override;

  // The same without gRPC. `peer`: the calling trainer's credentials (gRPC: PeerCredOf), for
  // the checks of its shm regions; nullopt skips the pid/uid checks (see the top comment).
  absl::StatusOr<v1::RegisterTensorsResponse> DoRegister(
      const v1::RegisterTensorsRequest& request,
      const std::optional<PeerCred>& peer = std::nullopt);
  absl::Status DoUnregister(const std::string& client);
  // Control Status: the clients, the sliced tensors and the round being assembled.
  v1::TrainerApiStatus TrainerStatus() const;
  // `deadline` / `cancelled` (may be null): the call's (gRPC: its deadline, InfiniteFuture when
  // the client set none, and its cancellation). Only a call with an infinite deadline lends its
  // memory (see the top comment); `cancelled` then abandons its job if it has not started.
  absl::StatusOr<v1::LocalPublishResponse> DoPublish(
      const v1::LocalPublishRequest& request, absl::Time deadline = absl::InfiniteFuture(),
      const std::function<bool()>& cancelled = nullptr);

 private:
  struct Client {
    uint64_t generation = 0;  // changes on every (re-)registration
    std::vector<std::shared_ptr<const MappedTensor>> tensors;
  };
  // Where a client's block of a sliced tensor is copied in a round: the round's buffer of rows
  // `rows` of the tensor (all of its rows unless options_.parts: then the rows its registered
  // blocks spanned when the buffer was made, shard_part.h).
  struct JoinTarget {
    std::shared_ptr<uint8_t> buffer;
    RowRange rows;
  };
  // One client's part of a round: its snapshot, the registered tensors it was taken from and,
  // for its blocks, the round's join buffer each was copied into (same order; no buffer for
  // whole tensors, whose snapshot is in `tensors`).
  struct Share {
    std::vector<OwnedTensor> tensors;
    std::vector<std::shared_ptr<const MappedTensor>> sources;
    std::vector<JoinTarget> joins;
  };
  // The join buffers of the version being published, by tensor name: every client's blocks of a
  // tensor are copied straight into the same one.
  struct PendingJoin {
    uint64_t version = 0;
    std::map<std::string, JoinTarget> buffers;
  };
  // One client's block of a sliced tensor in a round being committed.
  struct Piece {
    std::string client;
    const TensorBlock* block;
    DType dtype;
    const JoinTarget* target;
  };
  // The version being assembled: the clients that published it so far and their snapshots.
  struct Round {
    uint64_t version = 0;
    std::string first_client;
    std::map<std::string, Share> snapshots;
    bool allow_degenerate = false;  // some client's LocalPublishRequest.allow_degenerate
  };
  // A sliced tensor's registered blocks (client -> block), all of one dtype and whole shape.
  struct SlicedTensor {
    DType dtype = DType::kBF16;
    std::map<std::string, TensorBlock> blocks;
  };

  v1::RegisterTensorsResponse CountsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `client` may register `t` beside the other clients' tensors (see the top comment).
  absl::Status CheckAgainstOthersLocked(const std::string& client, const MappedTensor& t) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `client`'s registration of `t` from owners_ / sliced_.
  void ForgetLocked(const std::string& client, const MappedTensor& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until no Publish of `client` is copying (so a new registration of it never races a
  // copy of its previous blocks into a join buffer).
  void AwaitNotPublishingLocked(const std::string& client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndPublishingLocked(const std::string& client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round's join buffers of `tensors`' blocks at `version` (none for whole tensors), made
  // when the version's first block is taken, and made anew when a block lies outside the rows of
  // the buffer made before it (a shard publisher's blocks changed meanwhile).
  std::vector<JoinTarget> JoinBuffersLocked(
      uint64_t version, const std::vector<std::shared_ptr<const MappedTensor>>& tensors)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rows of `tensor` its join buffer holds: all of them, or with options_.parts the rows its
  // registered blocks span.
  RowRange JoinRowsLocked(const std::string& tensor) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pool keeps one round's worth of free join buffers: the bytes of the sliced tensors (of
  // their parts with options_.parts).
  void SizeJoinPoolLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round's tensors: whole ones as taken, sliced ones joined (every tiling checked first).
  absl::StatusOr<std::vector<OwnedTensor>> JoinRound(Round& round) const;
  // One sliced tensor of a round, its tiling checked: the whole tensor, its part (options_.parts,
  // when its blocks tile whole rows that are not all of its rows), or nothing (options_.parts,
  // every block empty).
  absl::StatusOr<std::optional<OwnedTensor>> JoinTensor(const std::string& name,
                                                        const std::vector<Piece>& pieces,
                                                        uint64_t version) const;
  // Queues the round when every registered client has published it; true when it did. A round
  // holding lent tensors is queued with their lender's `release`.
  absl::StatusOr<bool> MaybeCommitLocked(std::shared_ptr<InputsRelease> release = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DoPublish's steps: the version of this client's share (and whether it completes the
  // round); its tensors, lent (`lend`: mapped shm) or copied.
  absl::StatusOr<uint64_t> ChooseRoundVersion(const v1::LocalPublishRequest& request,
                                              const std::string& who, bool* completes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The client's share joins the round (re-registered meanwhile: ABORTED; another version in
  // the round: FAILED_PRECONDITION) and the round is committed when it is complete: true.
  // `release` is set when the share lent its tensors; a share that does not commit gives back
  // what it borrowed (its lent tensors copied, `release` reset).
  absl::StatusOr<bool> AddShareLocked(const std::string& name, const std::string& who,
                                      uint64_t generation, uint64_t version, Share share,
                                      bool allow_degenerate,
                                      std::shared_ptr<InputsRelease>& release)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DoRegister's first step, outside the lock: every location validated and mapped (a
  // duplicate name, a CUDA block this publisher cannot join: errors naming the tensor).
  absl::StatusOr<std::vector<std::shared_ptr<const MappedTensor>>> MapTensors(
      const v1::RegisterTensorsRequest& request, const std::string& who,
      const std::optional<PeerCred>& peer) const;
  // Blocks are copied into their `joins` buffer (same order as `tensors`); their entry in the
  // result only names them.
  absl::StatusOr<std::vector<OwnedTensor>> TakeTensors(
      const std::vector<std::shared_ptr<const MappedTensor>>& tensors,
      const std::vector<JoinTarget>& joins, const std::string& who, uint64_t version,
      bool lend) const;
  // Copies one block into its place in its join buffer.
  absl::Status CopyBlock(const MappedTensor& t, const std::string& what,
                         const JoinTarget& target) const;

  // The snapshot of one CUDA tensor (options_.cuda_snapshot). `what` prefixes errors.
  absl::Status SnapshotCuda(const MappedTensor& t, const std::string& what, OwnedTensor* out) const;

  PublishQueue* const queue_;
  const TrainerApiOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  mutable absl::Mutex mu_;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
  // Whole tensor name -> client.
  std::map<std::string, std::string> owners_ ABSL_GUARDED_BY(mu_);
  // Sliced tensor name -> its blocks.
  std::map<std::string, SlicedTensor> sliced_ ABSL_GUARDED_BY(mu_);
  std::optional<PendingJoin> join_ ABSL_GUARDED_BY(mu_);
  // Publish calls of each client between their version's choice and their share's entry into
  // the round (AwaitNotPublishingLocked).
  std::map<std::string, int> publishing_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<JoinBufferPool> join_pool_ = std::make_shared<JoinBufferPool>();
  std::optional<Round> round_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_TRAINER_API_H_
