// ShmStore: a TensorStore in POSIX shared memory, for subscribers without a GPU (config store.kind
// shm). One memory object per store of num_slots * slot_bytes bytes, mapped MAP_SHARED:
//
//   [ slot 0: tensor a | pad | tensor b | pad ... ][ slot 1: same placement ] ...
//
// Slot s starts at SlotOffset(s) = s * slot_bytes; tensor i of slot s at
// SlotOffset(s) + layout().tensor(i).offset. Every offset is a multiple of the layout's alignment
// (256 by default, cudaMalloc's, so a consumer can cudaHostRegister/cudaMemcpy the mapping and the
// CUDA store shares the same Layout); mmap bases are page aligned.
//
// The object is a memfd (memfd_create, MFD_CLOEXEC | MFD_ALLOW_SEALING), sized, mapped read-write
// by the daemon and then sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
// F_SEAL_SEAL (Linux >= 5.1): the daemon's own mapping stays writable, but a consumer that holds
// the fd or reopens /proc/<pid>/fd/<n> O_RDWR can neither truncate it (SIGBUS in the daemon), nor
// write() it, nor map it writable (mmap PROT_WRITE | MAP_SHARED and mprotect fail with EPERM), so
// no consumer can corrupt the version the others read. Where memfd_create is unavailable the store
// falls back to shm_open("<shm_prefix><pid>-<counter>") (0600, unlinked immediately after
// ftruncate so it never outlives the daemon), which cannot be sealed; an unsealable store (the
// fallback, or a kernel without F_SEAL_FUTURE_WRITE) is refused (FAILED_PRECONDITION) unless
// allow_unsealed (config store.allow_unsealed), then kept with a warning in the log. Either way
// the only handle is fd(); a consumer process reaches it
//   (a) by SCM_RIGHTS over the ConsumerApi unix socket (the robust way: no /proc access needed), or
//   (b) by opening ProcPath() = "/proc/<daemon pid>/fd/<fd>" read-only (what ShmRegion.path in
//       local.proto carries: needs the same uid/ptrace access, i.e. a shared PID namespace in a
//       k8s pod — shareProcessNamespace: true — otherwise use (a)),
// then mmap(PROT_READ, MAP_SHARED) of the whole object or of the leased slot (slot offsets are
// multiples of slot_bytes, which is not page aligned in general: map from the page below and add
// the remainder, or map the whole object once).
//
// A layout never changes within a store: a manifest change (tensor added, removed, resized, dtype
// changed) is a new store generation. The daemon creates a new ShmStore with the new layout,
// stages the new version there (unchanged tensors' bases come from a lease on the old store, by
// name: Layout::Find), commits it, switches ConsumerApi to the new store (layout_changed = true in
// the VersionEvent), and destroys the old store once its last lease is released or expired
// (consumers that still map the old fd keep their mapping valid regardless: the pages live until
// the last munmap/close).
#ifndef REFIT_DAEMON_STORE_SHM_STORE_H_
#define REFIT_DAEMON_STORE_SHM_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/store_factory.h"

namespace refit::store {

struct ShmStoreOptions : StoreOptions {
  // Prefix of the shm_open fallback's object name (config store.shm_prefix): starts with "/",
  // no other "/".
  std::string shm_prefix = "/refitd-";
  // Testing: skip memfd_create and use the shm_open fallback.
  bool force_shm_open = false;
  // Keep a store that cannot be sealed (config store.allow_unsealed), with a warning.
  bool allow_unsealed = false;
  // Pre-fault every page of every slot at creation (config store.prefault): the first staging
  // into a slot then pays no first-touch page faults (measured: versions 2-3 after a keyframe
  // were 2-4x slower). Costs at creation: the whole object (num_slots * slot_bytes) becomes
  // resident at once, where it would otherwise become resident as versions are staged, and the
  // time of the page faults (MADV_POPULATE_WRITE, Linux >= 5.14, else one write per page):
  // about 0.6 s per GiB on the shared 2-core dev machine under load ~7 (subscriber_bench,
  // docs/ARCHITECTURE.md), in exchange for ~8x cheaper first writes of each slot.
  bool prefault = true;
};

class ShmStore final : public SlottedStore {
 public:
  static absl::StatusOr<std::unique_ptr<ShmStore>> Create(Layout layout,
                                                          const ShmStoreOptions& options = {});
  ~ShmStore() override;
  ShmStore(const ShmStore&) = delete;
  ShmStore& operator=(const ShmStore&) = delete;

  // The memory object (owned by the store; closed by the destructor).
  int fd() const { return fd_; }
  // "/proc/<pid>/fd/<fd>": a path another process of the same user may open to map the store.
  std::string ProcPath() const;
  // Bytes of the object: num_slots() * layout().slot_bytes().
  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t SlotOffset(int slot) const {
    return static_cast<uint64_t>(slot) * layout().slot_bytes();
  }
  // Offset of tensor `index` of `slot` within the object.
  uint64_t TensorOffset(int slot, size_t index) const {
    return SlotOffset(slot) + layout().tensor(index).offset;
  }
  // kFile: ProcPath() from SlotOffset(slot).
  SlotRegion Region(int slot) const override;
  // "memfd" or "shm_open".
  const char* backing() const { return backing_; }
  // Whether consumers cannot write or resize the object (a sealed memfd).
  bool sealed() const { return sealed_; }
  // How the slots were pre-faulted: "madvise" (MADV_POPULATE_WRITE), "touch" (one write per
  // page) or "" (ShmStoreOptions::prefault off).
  const char* prefault() const { return prefault_; }

 private:
  ShmStore(Layout layout, std::vector<uint8_t*> bases, const StoreOptions& options, int fd,
           uint8_t* map, uint64_t total_bytes, const char* backing, bool sealed,
           const char* prefault);

  const int fd_;
  uint8_t* const map_;
  const uint64_t total_bytes_;
  const char* const backing_;
  const bool sealed_;
  const char* const prefault_;
};

// A factory of ShmStores for a subscriber core (store_factory.h). `host` gives the host-specific
// options (shm_prefix, sealing, prefault); its generic StoreOptions part is replaced by the call's.
StoreFactory HostStoreFactory(ShmStoreOptions host = {});

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_SHM_STORE_H_
