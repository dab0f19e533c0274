// `refitd publisher`: the publisher daemon assembled from its parts. Start() builds everything
// from a validated config (config::LoadPublisherConfig + CheckConfigFiles already passed):
//   PublisherCore (history budget, threads, persisted baseline), DataPlaneService, the Control
//   service (Status, Publish from safetensors, Export, WaitVersion, Verify, Resync), the
//   TrainerApi on local_socket (shared-memory tensors of trainer processes), gRPC health, the
//   servers on listen / control_listen / local_socket, and finally the ready file.
// codec.device cuda opens the configured GPU (cuda_device / cuda_device_uuid; Start fails with
// FailedPrecondition naming publisher.codec.device and the cause when it cannot) and encodes on
// it; auto does so when a GPU opens and encodes on the CPU otherwise. Trainers may register CUDA
// tensors whatever the codec device (their GPUs are opened by UUID on first use).
#ifndef REFIT_DAEMON_PUBLISHER_PUBLISHER_DAEMON_H_
#define REFIT_DAEMON_PUBLISHER_PUBLISHER_DAEMON_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cuda/device.h"
#include "refit/v1/config.pb.h"

namespace refit::publisher {

class PublisherDaemon {
 public:
  // Starts serving. Errors: InvalidArgument / FailedPrecondition for unusable settings (e.g. no
  // usable GPU for codec.device cuda), Unavailable when an address cannot be bound, DataLoss /
  // FailedPrecondition for a corrupt persisted baseline; each one line naming the config field.
  // `open_device` opens GPUs (codec.device cuda/auto, trainer CUDA tensors); null: no GPU
  // support in this process (codec.device cuda is refused, auto encodes on the CPU).
  static absl::StatusOr<std::unique_ptr<PublisherDaemon>> Start(
      const v1::PublisherConfig& config, cuda::DeviceOpener open_device = nullptr);
  virtual ~PublisherDaemon() = default;

  // Stops accepting, ends sessions, shuts the servers down (bounded wait). Idempotent; the
  // destructor calls it.
  virtual void Shutdown() = 0;

  // Bound addresses (port 0 resolved): data plane, control ("" when served on listen), local
  // socket ("" when none).
  virtual std::string listen_address() const = 0;
  virtual std::string control_address() const = 0;
  virtual std::string local_address() const = 0;

  // Checks the TLS files of every listener now (SIGHUP; they are also checked every
  // tls.reload_interval_ms): new valid material serves new connections, a bad file keeps the
  // old material. The first refusal, if any (logged, and in Status.tls).
  virtual absl::Status ReloadTls() = 0;
  // Returns once the daemon's state could be read (its Status, which takes the core's, the data
  // plane's and the stores' locks): a wedged daemon blocks here. The systemd watchdog pings
  // only after it returns OK.
  virtual absl::Status CheckProgress() = 0;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_PUBLISHER_DAEMON_H_
