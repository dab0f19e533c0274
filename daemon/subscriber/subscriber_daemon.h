// `refitd subscriber`: the subscriber daemon assembled from its parts. Start() builds everything
// from a validated config (config::LoadSubscriberConfig + CheckConfigFiles already passed):
//   SubscriberCore (ShmStore or CudaStore slots, lease TTLs, staging threads/limit), Upstream
//   (sessions with the publisher or bootstrap peers), the Control service (Status, Export,
//   WaitVersion, Verify, Resync; Publish is FAILED_PRECONDITION), the ConsumerApi on local_socket
//   (layout, version announcements, leases), with serve_peers a DataPlaneService fed with every
//   applied version, gRPC health, the servers, and finally the ready file.
// store.kind cuda opens the configured GPU (CudaStore generations); start fails with the
// device's error when there is none usable.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_DAEMON_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_DAEMON_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cuda/device.h"
#include "refit/v1/config.pb.h"

namespace refit::subscriber {

class SubscriberDaemon {
 public:
  // `open_device` opens the GPU of store.kind cuda; null: no GPU support in this process (a
  // cuda store is refused).
  static absl::StatusOr<std::unique_ptr<SubscriberDaemon>> Start(
      const v1::SubscriberConfig& config, const cuda::DeviceOpener& open_device = nullptr);
  virtual ~SubscriberDaemon() = default;

  // Stops the upstream session, ends peer sessions, shuts the servers down. Idempotent; the
  // destructor calls it.
  virtual void Shutdown() = 0;

  // Bound addresses ("" when not configured).
  virtual std::string listen_address() const = 0;
  virtual std::string control_address() const = 0;
  virtual std::string local_address() const = 0;

  // Checks the TLS files of the upstream and the listeners now (SIGHUP; they are also checked
  // every tls.reload_interval_ms): new valid material serves new connections, a bad file keeps
  // the old material. The first refusal, if any (logged, and in Status.tls).
  virtual absl::Status ReloadTls() = 0;
  // Returns once the daemon's state could be read (its Status, which takes the core's, the data
  // plane's and the stores' locks): a wedged daemon blocks here. The systemd watchdog pings
  // only after it returns OK.
  virtual absl::Status CheckProgress() = 0;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_DAEMON_H_
