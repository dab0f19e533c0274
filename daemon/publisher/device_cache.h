// The GPUs the publisher daemon uses, opened once each and kept for its life: the codec device
// (codec.device cuda / auto) and every GPU a trainer registers CUDA tensors on (TrainerApi, by
// UUID). Devices must outlive every allocation made through them, so the daemon destroys the
// cache after the core, the queue and the TrainerApi.
//
// Links refit_device_api only: the caller supplies the opener (the daemon: cuda::OpenDevice of
// refit_cuda; emulator tests: refit_cuda_emu's).
#ifndef REFIT_DAEMON_PUBLISHER_DEVICE_CACHE_H_
#define REFIT_DAEMON_PUBLISHER_DEVICE_CACHE_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cuda/device.h"

namespace refit::publisher {

// Opens the GPU with this UUID (or returns the one already open). Errors name the cause.
using DeviceProvider = std::function<absl::StatusOr<cuda::Device*>(const cuda::Uuid& uuid)>;

// Thread-safe.
class DeviceCache {
 public:
  using Opener =
      std::function<absl::StatusOr<std::unique_ptr<cuda::Device>>(const cuda::DeviceSelector&)>;
  explicit DeviceCache(Opener opener);
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  // Opens the selected device (or returns the open one with the same UUID).
  absl::StatusOr<cuda::Device*> Open(const cuda::DeviceSelector& selector);
  // The device with `uuid`, opened on first use. A failure is not remembered (the next call
  // tries again).
  absl::StatusOr<cuda::Device*> Get(const cuda::Uuid& uuid);
  // Get as a DeviceProvider (the cache must outlive it).
  DeviceProvider Provider();

 private:
  cuda::Device* FindLocked(const cuda::Uuid& uuid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<cuda::Device*> AddLocked(absl::StatusOr<std::unique_ptr<cuda::Device>> opened)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Opener opener_;
  mutable absl::Mutex mu_;  // held while opening: a GPU is opened once
  std::vector<std::unique_ptr<cuda::Device>> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_DEVICE_CACHE_H_
