#include "daemon/publisher/device_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace refit::publisher {

DeviceCache::DeviceCache(Opener opener) : opener_(std::move(opener)) {}

cuda::Device* DeviceCache::FindLocked(const cuda::Uuid& uuid) const {
  for (const auto& d : devices_) {
    if (d->info().uuid == uuid) return d.get();
  }
  return nullptr;
}

absl::StatusOr<cuda::Device*> DeviceCache::AddLocked(
    absl::StatusOr<std::unique_ptr<cuda::Device>> opened) {
  if (!opened.ok()) return opened.status();
  if (*opened == nullptr) return absl::InternalError("the device opener returned no device");
  // Opened by ordinal while already open under its UUID: keep the first.
  if (cuda::Device* known = FindLocked((*opened)->info().uuid)) return known;
  devices_.push_back(std::move(*opened));
  return devices_.back().get();
}

absl::StatusOr<cuda::Device*> DeviceCache::Open(const cuda::DeviceSelector& selector) {
  absl::MutexLock lock(&mu_);
  if (selector.uuid.has_value()) {
    if (cuda::Device* known = FindLocked(*selector.uuid)) {
      if (!selector.ordinal.has_value() || known->info().ordinal == *selector.ordinal) {
        return known;
      }
    }
  }
  return AddLocked(opener_(selector));
}

absl::StatusOr<cuda::Device*> DeviceCache::Get(const cuda::Uuid& uuid) {
  absl::MutexLock lock(&mu_);
  if (cuda::Device* known = FindLocked(uuid)) return known;
  return AddLocked(opener_(cuda::DeviceSelector::ByUuid(uuid)));
}

DeviceProvider DeviceCache::Provider() {
  return [this](const cuda::Uuid& uuid) { return Get(uuid); };
}

}  // namespace refit::publisher
