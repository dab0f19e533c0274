// Store factories: how a subscriber core gets each store generation without knowing which kind
// of memory holds it. The daemon (or a test) picks the kind from the config and hands the core a
// factory; the core calls it with the layout and the generic options (slots, clock, leases,
// threads) and sees only the SlottedStore it returns.
#ifndef REFIT_DAEMON_STORE_STORE_FACTORY_H_
#define REFIT_DAEMON_STORE_STORE_FACTORY_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/tensor_store.h"

namespace refit::store {

using StoreFactory = std::function<absl::StatusOr<std::shared_ptr<SlottedStore>>(
    const Layout& layout, const StoreOptions& options)>;

// The concrete stores provide theirs: HostStoreFactory (shm_store.h), DeviceStoreFactory
// (cuda_store.h).

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_STORE_FACTORY_H_
