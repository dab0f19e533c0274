// TrainerApi (proto/refit/v1/local.proto) of the publisher daemon, served on `local_socket`.
//
// Trainer processes ("clients", e.g. one per tensor-parallel rank) register the tensors they
// expose as regions of POSIX shared memory objects or files (memfds via /proc/<pid>/fd/<n>). Each
// region is validated (dtype, shape, name, object exists, range inside it, size = dtype size x
// elements) and mapped read-only (MAP_SHARED) before RegisterTensors returns. CUDA IPC regions
// are refused with UNIMPLEMENTED until the GPU path (issue 4).
//
// Publish(client, version) copies the client's tensors into owned buffers (the snapshot) and
// returns; the trainer may overwrite its memory right after. A version is committed once every
// registered client has published it: all clients' snapshots are then queued as one version on
// the PublishQueue (LocalPublishResponse.committed = true: queued for encoding; the trainer does
// not wait for the encode). All clients must publish the same number: the first client of a
// round fixes it (its request, or PublishQueue::ChooseVersion), later ones must match or omit it.
//
// Thread-safe.
#ifndef REFIT_DAEMON_PUBLISHER_TRAINER_API_H_
#define REFIT_DAEMON_PUBLISHER_TRAINER_API_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/dtype.h"
#include "daemon/publisher/publisher_control.h"
#include "refit/v1/local.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

// One registered tensor: its spec and its region mapped read-only.
class MappedTensor {
 public:
  ~MappedTensor();
  MappedTensor(const MappedTensor&) = delete;
  MappedTensor& operator=(const MappedTensor&) = delete;

  // Validates `location` and maps its region. `what` prefixes errors ("client \"rank0\": tensor
  // 2 'w'"). Codes: InvalidArgument (spec, missing region, size mismatch, relative path),
  // NotFound (shm object / file missing), PermissionDenied, OutOfRange (region outside the
  // object), Unimplemented (CUDA IPC).
  static absl::StatusOr<std::unique_ptr<MappedTensor>> Map(const v1::TensorLocation& location,
                                                           const std::string& what);

  const v1::TensorSpec& spec() const { return spec_; }
  DType dtype() const { return dtype_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }

 private:
  MappedTensor() = default;
  v1::TensorSpec spec_;
  DType dtype_ = DType::kBF16;
  void* map_ = nullptr;
  size_t map_len_ = 0;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class TrainerApiService final : public v1::TrainerApi::Service {
 public:
  // `queue` must outlive the service. Snapshots are copied with `copy_threads` threads (0 = one
  // per hardware thread).
  explicit TrainerApiService(PublishQueue* queue, int copy_threads = 0);
  ~TrainerApiService() override;

  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               const v1::RegisterTensorsRequest* request,
                               v1::RegisterTensorsResponse* response) override;
  grpc::Status Unregister(grpc::ServerContext* context, const v1::UnregisterRequest* request,
                          v1::UnregisterResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::LocalPublishRequest* request,
                       v1::LocalPublishResponse* response) override;

  // The same without gRPC.
  absl::StatusOr<v1::RegisterTensorsResponse> DoRegister(const v1::RegisterTensorsRequest& request);
  absl::Status DoUnregister(const std::string& client);
  absl::StatusOr<v1::LocalPublishResponse> DoPublish(const v1::LocalPublishRequest& request);

 private:
  struct Client {
    uint64_t generation = 0;  // changes on every (re-)registration
    std::vector<std::shared_ptr<const MappedTensor>> tensors;
  };
  // The version being assembled: the clients that published it so far and their snapshots.
  struct Round {
    uint64_t version = 0;
    std::string first_client;
    std::map<std::string, std::vector<OwnedTensor>> snapshots;
  };

  v1::RegisterTensorsResponse CountsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the round when every registered client has published it; true when it did.
  absl::StatusOr<bool> MaybeCommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  PublishQueue* const queue_;
  const int copy_threads_;
  std::shared_ptr<spdlog::logger> log_;
  mutable absl::Mutex mu_;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
  // Tensor name -> client.
  std::map<std::string, std::string> owners_ ABSL_GUARDED_BY(mu_);
  std::optional<Round> round_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_TRAINER_API_H_
