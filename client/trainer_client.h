// TrainerClient: a C++ client of the publisher's TrainerApi (proto/refit/v1/local.proto) for
// trainer processes, tests and the demo.
//
// It keeps all of its tensors in one memfd (256-byte aligned offsets, mapped MAP_SHARED here),
// registers them with the publisher as ShmRegions naming "/proc/<pid>/fd/<fd>" (the publisher
// maps that path; it needs the same uid, or ptrace access, to this process), and exposes each
// tensor's bytes as a writable span. A trainer writes its weights there, then Publish() makes
// the publisher snapshot them as (its share of) a version; after Publish returns the spans may be
// modified again.
//
//   REFIT_ASSIGN_OR_RETURN(auto trainer, TrainerClient::Create("unix:/run/refitd/publisher.sock",
//                                                        "rank0", specs));
//   std::memcpy(trainer->tensor(0).data(), weights, trainer->tensor(0).size());
//   REFIT_RETURN_IF_ERROR(trainer->Register().status());
//   REFIT_ASSIGN_OR_RETURN(v1::LocalPublishResponse r, trainer->Publish());
//
// Not thread-safe: one thread drives a client (the spans may be written from any thread between
// calls).
#ifndef REFIT_CLIENT_TRAINER_CLIENT_H_
#define REFIT_CLIENT_TRAINER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "refit/v1/common.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "refit/v1/local.pb.h"

namespace refit::client {

struct TrainerClientOptions {
  // Deadline of RegisterTensors and Unregister.
  absl::Duration rpc_timeout = absl::Minutes(10);
  // Deadline of Publish. Infinite (the default): the call has no deadline, so the publisher may
  // lend this client's memory to its pass instead of copying it (local.proto Publish), and
  // Publish returns only with the publisher's answer (once the pass has read the memory) or when
  // the connection fails. A finite timeout: every Publish is copied by the publisher.
  absl::Duration publish_timeout = absl::InfiniteDuration();
  // Alignment of each tensor's offset in the memfd (a power of two).
  uint64_t alignment = 256;
};

class TrainerClient {
 public:
  // Creates the memfd for `tensors` (specs with name, dtype and shape; names unique), maps it and
  // opens a channel to the publisher's local socket: "unix:/path", "unix:///path", or a bare
  // absolute path. Tensor bytes start zeroed. Errors: InvalidArgument for a bad spec or address
  // (naming the tensor / address), the errno's code for memfd / mmap failures.
  static absl::StatusOr<std::unique_ptr<TrainerClient>> Create(
      const std::string& local_socket, const std::string& client_name,
      const std::vector<v1::TensorSpec>& tensors, const TrainerClientOptions& options = {});
  ~TrainerClient();
  TrainerClient(const TrainerClient&) = delete;
  TrainerClient& operator=(const TrainerClient&) = delete;

  // Makes tensor i (spec = the block's name, dtype and shape) a block of a larger tensor: its
  // whole shape and the block's first index in each dimension (TensorLocation.slice; a sharded
  // trainer's local piece, e.g. FSDP2's Shard(0) rows). The publisher checks it against the
  // other clients' blocks at Register and joins the blocks into the whole tensor at the commit
  // of each version. Takes effect at the next Register.
  void SetSlice(size_t i, const std::vector<uint64_t>& global_shape,
                const std::vector<uint64_t>& offsets);
  // RegisterTensors with every tensor (replaces this client's earlier registration).
  absl::StatusOr<v1::RegisterTensorsResponse> Register();
  // Publish: the publisher snapshots the current bytes. `version` absent: newest + 1.
  // `allow_degenerate`: LocalPublishRequest.allow_degenerate (publish even a version that
  // removes most of the current one; refused otherwise by the publisher's publish_guard).
  absl::StatusOr<v1::LocalPublishResponse> Publish(std::optional<uint64_t> version = std::nullopt,
                                                   bool allow_degenerate = false);
  // Unregister this client's tensors.
  absl::Status Unregister();

  const std::string& name() const { return name_; }
  size_t num_tensors() const { return specs_.size(); }
  const v1::TensorSpec& spec(size_t i) const { return specs_[i]; }
  // Writable bytes of tensor i (size = elements x dtype size).
  std::span<uint8_t> tensor(size_t i) { return {base_ + offsets_[i], sizes_[i]}; }
  std::span<const uint8_t> tensor(size_t i) const { return {base_ + offsets_[i], sizes_[i]}; }
  // Index of a tensor by name; NotFound naming it.
  absl::StatusOr<size_t> Find(const std::string& name) const;
  // The memfd, its /proc path and total size.
  int fd() const { return fd_; }
  std::string ProcPath() const;
  uint64_t total_bytes() const { return total_bytes_; }
  // The TrainerApi regions as registered (spec + ShmRegion per tensor).
  v1::RegisterTensorsRequest RegisterRequest() const;

 private:
  TrainerClient() = default;

  std::string name_;
  TrainerClientOptions options_;
  std::vector<v1::TensorSpec> specs_;
  std::vector<std::optional<v1::TensorSlice>> slices_;  // by tensor; SetSlice's, else whole
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> sizes_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t total_bytes_ = 0;
  uint64_t map_bytes_ = 0;
  std::unique_ptr<v1::TrainerApi::Stub> stub_;
};

}  // namespace refit::client

#endif  // REFIT_CLIENT_TRAINER_CLIENT_H_
