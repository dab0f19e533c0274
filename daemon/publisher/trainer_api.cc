#include "daemon/publisher/trainer_api.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

// Client-supplied text (names, paths) escaped for logs and messages (logging.h Printable).
std::string Quoted(const std::string& s) { return absl::StrCat("\"", Printable(s), "\""); }

absl::Status Prefixed(const std::string& what, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

absl::StatusCode OpenErrorCode(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInvalidArgument;
  }
}

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

// tmpfs (/dev/shm, memfds) and hugetlbfs (MFD_HUGETLB memfds): the only file systems a region may
// live on (shared memory, not files on disk).
constexpr int64_t kTmpfsMagic = 0x01021994;
constexpr int64_t kHugetlbfsMagic = 0x958458f6;

absl::Status OpenError(const std::string& what, const std::string& object, int err) {
  return absl::Status(OpenErrorCode(err),
                      absl::StrCat(what, ": cannot open ", object, ": ",
                                   err == ENOENT ? "it does not exist" : std::strerror(err)));
}

// The pid of "/proc/<pid>/fd/<n>" ("self": this process), or nullopt for any other path.
std::optional<int> ProcFdPid(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, "/proc/")) return std::nullopt;
  const size_t slash = path.find('/');
  if (slash == absl::string_view::npos) return std::nullopt;
  const absl::string_view pid_text = path.substr(0, slash);
  absl::string_view rest = path.substr(slash);
  uint32_t fd = 0;
  if (!absl::ConsumePrefix(&rest, "/fd/") || !absl::SimpleAtoi(rest, &fd) ||
      rest.find_first_not_of("0123456789") != absl::string_view::npos) {
    return std::nullopt;
  }
  if (pid_text == "self") return static_cast<int>(getpid());
  int pid = 0;
  if (pid_text.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(pid_text, &pid) || pid <= 0) {
    return std::nullopt;
  }
  return pid;
}

// "/dev/shm/<name>" with a plain name (no further '/', not "." or "..").
bool IsDevShmPath(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, "/dev/shm/")) return false;
  return !path.empty() && path != "." && path != ".." &&
         path.find('/') == absl::string_view::npos;
}

// Opens the object of a ShmRegion read-only: ShmRegion.shm_name, or a path that is the calling
// process's own fd (/proc/<peer pid>/fd/<n>) or a /dev/shm object. Never blocks (O_NONBLOCK) and
// never follows a symlink in /dev/shm (O_NOFOLLOW).
absl::StatusOr<int> OpenObjectFd(const v1::ShmRegion& region, const std::string& what,
                                 const std::optional<PeerCred>& peer, std::string* object) {
  if (region.object_case() == v1::ShmRegion::kShmName) {
    const std::string& name = region.shm_name();
    *object = absl::StrCat("shm object ", Quoted(name));
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shm.shm_name is empty"));
    }
    if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
        name == "/." || name == "/..") {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": shm.shm_name ", Quoted(name), " is not a POSIX shm name (\"/name\")"));
    }
    const int fd = shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) return OpenError(what, *object, errno);
    return fd;
  }
  if (region.object_case() != v1::ShmRegion::kPath) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shm region names no object: set shm_name or path"));
  }
  const std::string& path = region.path();
  *object = absl::StrCat("file ", Quoted(path));
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shm.path ", Quoted(path), " is not absolute"));
  }
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
  if (std::optional<int> pid = ProcFdPid(path); pid.has_value()) {
    if (peer.has_value() && *pid != peer->pid) {
      return absl::PermissionDeniedError(absl::StrCat(
          what, ": shm.path ", Quoted(path), " is an fd of process ", *pid,
          ", not of the calling trainer (pid ", peer->pid, "): register your own memfd as "
          "/proc/<your pid>/fd/<n>"));
    }
  } else if (IsDevShmPath(path)) {
    flags |= O_NOFOLLOW;
  } else {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": shm.path ", Quoted(path), " is neither the trainer's own memfd "
        "(/proc/<its pid>/fd/<n>) nor a /dev/shm/<name> object"));
  }
  const int fd = open(path.c_str(), flags);
  if (fd < 0) return OpenError(what, *object, errno);
  return fd;
}

}  // namespace

absl::StatusOr<ShmObject> OpenShmObject(const v1::ShmRegion& region, const std::string& what,
                                        const std::optional<PeerCred>& peer) {
  ShmObject out;
  ASSIGN_OR_RETURN(out.fd, OpenObjectFd(region, what, peer, &out.name));
  FdCloser closer{out.fd};
  if (fstat(out.fd, &out.st) != 0) {
    return absl::InternalError(
        absl::StrCat(what, ": cannot stat ", out.name, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(out.st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", out.name, " is not a regular file or shared memory object"));
  }
  struct statfs fs;
  if (fstatfs(out.fd, &fs) != 0 ||
      (static_cast<int64_t>(fs.f_type) != kTmpfsMagic &&
       static_cast<int64_t>(fs.f_type) != kHugetlbfsMagic)) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": ", out.name, " is not shared memory (tmpfs / memfd): a region must be a "
        "memfd or a POSIX shm object of the trainer"));
  }
  if (peer.has_value() && out.st.st_uid != peer->uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": ", out.name, " is owned by uid ", out.st.st_uid,
        ", not by the calling trainer (uid ", peer->uid, ")"));
  }
  const bool is_proc_fd = region.object_case() == v1::ShmRegion::kPath &&
                          ProcFdPid(region.path()).has_value();
  // A memfd's mode is always 0777 (reachable only through its owner's fds); a named object
  // that anyone may write could be swapped under the trainer.
  if (!is_proc_fd && (out.st.st_mode & S_IWOTH) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": ", out.name, " is world-writable (mode ",
        absl::StrFormat("%04o", out.st.st_mode & 07777), ")"));
  }
  closer.fd = -1;
  return out;
}

bool SealAgainstShrinking(int fd) {
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) return false;  // not sealable at all
  if ((seals & F_SEAL_SHRINK) != 0) return true;
  if ((seals & F_SEAL_SEAL) != 0) return false;
  // Adding seals needs a writable description: reopen ours read-write just for that.
  const int rw = open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
  if (rw < 0) return false;
  const bool sealed = fcntl(rw, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0;
  close(rw);
  return sealed;
}

// ---- OpenedIpc, CudaRegionOpener ----------------------------------------------------------------

OpenedIpc::~OpenedIpc() {
  if (base_ == nullptr) return;
  absl::Status st = device_->CloseIpc(base_);
  if (!st.ok()) {
    Logger("trainer-api")->warn("closing a CUDA IPC mapping on {}: {}", device_->Describe(),
                                st.ToString());
  }
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> OpenedIpc::Open(cuda::Device* device,
                                                                 const cuda::IpcHandle& handle) {
  ASSIGN_OR_RETURN(void* base, device->OpenIpc(handle));
  std::shared_ptr<OpenedIpc> opened(new OpenedIpc());
  opened->device_ = device;
  opened->base_ = static_cast<uint8_t*>(base);  // closed by the destructor from here on
  absl::StatusOr<std::pair<void*, size_t>> range = device->AddressRange(base);
  if (!range.ok()) {
    return absl::Status(range.status().code(),
                        absl::StrCat("the size of the opened allocation is unknown: ",
                                     range.status().message()));
  }
  // The handle names an allocation (cudaMalloc) from its base: the mapping starts there.
  if (range->first != base) {
    return absl::InvalidArgumentError(
        "the opened handle does not map to the start of an allocation");
  }
  opened->size_ = range->second;
  return std::shared_ptr<const OpenedIpc>(std::move(opened));
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> CudaRegionOpener::Open(
    const v1::CudaIpcRegion& region, const std::string& what) {
  if (region.ipc_handle().size() != cuda::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cuda_ipc.ipc_handle has ", region.ipc_handle().size(), " bytes; a CUDA IPC "
        "handle (cudaIpcMemHandle_t) has ", cuda::kIpcHandleBytes));
  }
  if (region.device_uuid().size() != cuda::kUuidBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cuda_ipc.device_uuid has ", region.device_uuid().size(),
        " bytes; a GPU UUID (cudaDeviceProp.uuid) has ", cuda::kUuidBytes));
  }
  ASSIGN_OR_RETURN(const cuda::Uuid uuid, cuda::UuidFromBytes(region.device_uuid()));
  cuda::IpcHandle handle;
  std::memcpy(handle.data(), region.ipc_handle().data(), handle.size());
  const std::string gpu = cuda::FormatUuid(uuid);
  auto key = std::make_pair(uuid, handle);
  if (auto it = opened_.find(key); it != opened_.end()) return it->second;
  if (devices_ == nullptr || !*devices_) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": CUDA IPC region on ", gpu, ", but this publisher has no GPU support "
        "(register the tensor in shared memory instead)"));
  }
  absl::StatusOr<cuda::Device*> device = (*devices_)(uuid);
  if (!device.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": CUDA IPC region on ", gpu, ", which this publisher cannot use: ",
        device.status().message()));
  }
  absl::StatusOr<std::shared_ptr<const OpenedIpc>> opened = OpenedIpc::Open(*device, handle);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat(what, ": cannot open the CUDA IPC handle on ", gpu, " (",
                                     (*device)->Describe(), "): ", opened.status().message()));
  }
  opened_.emplace(key, *opened);
  return *opened;
}

// ---- MappedTensor -------------------------------------------------------------------------------

MappedTensor::~MappedTensor() {
  if (map_ != nullptr) munmap(map_, map_len_);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::Map(
    const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda,
    const std::optional<PeerCred>& peer) {
  const v1::TensorSpec& spec = location.spec();
  absl::Status valid = sync::ValidateTensorSpec(spec);
  if (!valid.ok()) return Prefixed(what, valid);
  absl::StatusOr<DType> dtype = sync::FromProtoDType(spec.dtype());
  if (!dtype.ok()) return Prefixed(what, dtype.status());
  absl::StatusOr<uint64_t> elements = sync::ElementCount(spec);
  if (!elements.ok()) return Prefixed(what, elements.status());
  absl::StatusOr<uint64_t> size = sync::TensorByteSize(spec);
  if (!size.ok()) return Prefixed(what, size.status());

  switch (location.region_case()) {
    case v1::TensorLocation::kCudaIpc: {
      const v1::CudaIpcRegion& region = location.cuda_ipc();
      if (region.size_bytes() != *size) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": cuda_ipc.size_bytes is ", region.size_bytes(), " but the tensor needs ",
            *size, " bytes (", DTypeName(*dtype), ", ", *elements, " elements)"));
      }
      const uint64_t offset = region.offset();
      if (region.allocation_bytes() != 0 &&
          (offset > region.allocation_bytes() || *size > region.allocation_bytes() - offset)) {
        return absl::OutOfRangeError(absl::StrCat(
            what, ": CUDA region [", offset, ", ", offset, " + ", *size,
            ") is outside its allocation of ", region.allocation_bytes(),
            " bytes (cuda_ipc.allocation_bytes)"));
      }
      CudaRegionOpener none(nullptr);
      ASSIGN_OR_RETURN(std::shared_ptr<const OpenedIpc> ipc,
                       (cuda != nullptr ? cuda : &none)->Open(region, what));
      if (offset > ipc->size() || *size > ipc->size() - offset) {
        return absl::OutOfRangeError(absl::StrCat(
            what, ": CUDA region [", offset, ", ", offset, " + ", *size,
            ") is outside the allocation of ", ipc->size(), " bytes its handle opens on ",
            ipc->device()->Describe()));
      }
      if (region.allocation_bytes() != 0 && region.allocation_bytes() > ipc->size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": cuda_ipc.allocation_bytes is ", region.allocation_bytes(),
            " but the allocation its handle opens has ", ipc->size(), " bytes"));
      }
      std::unique_ptr<MappedTensor> t(new MappedTensor());
      t->spec_ = spec;
      t->dtype_ = *dtype;
      t->size_ = static_cast<size_t>(*size);
      t->data_ = ipc->base() + offset;
      t->ipc_ = std::move(ipc);
      return t;
    }
    case v1::TensorLocation::REGION_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no region: set shm (shm_name or path, offset, size_bytes)"));
    case v1::TensorLocation::kShm:
      break;
  }
  return MapShm(location.shm(), spec, *dtype, *elements, *size, what, peer);
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::MapShm(
    const v1::ShmRegion& region, const v1::TensorSpec& spec, DType dtype, uint64_t elements,
    uint64_t size, const std::string& what, const std::optional<PeerCred>& peer) {
  if (region.size_bytes() != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shm.size_bytes is ", region.size_bytes(), " but the tensor needs ", size,
        " bytes (", DTypeName(dtype), ", ", elements, " elements)"));
  }
  ASSIGN_OR_RETURN(ShmObject object, OpenShmObject(region, what, peer));
  FdCloser closer{object.fd};
  const uint64_t object_size = static_cast<uint64_t>(object.st.st_size);
  if (region.offset() > object_size || size > object_size - region.offset()) {
    return absl::OutOfRangeError(absl::StrCat(
        what, ": region [", region.offset(), ", ", region.offset(), " + ", size,
        ") is outside ", object.name, " of ", object_size, " bytes"));
  }

  std::unique_ptr<MappedTensor> t(new MappedTensor());
  t->spec_ = spec;
  t->dtype_ = dtype;
  t->size_ = static_cast<size_t>(size);
  t->what_ = absl::StrCat(what, " (", object.name, ")");
  if (size == 0) return t;
  if (!SealAgainstShrinking(object.fd)) {
    // Cannot be sealed (a /dev/shm object, a memfd without MFD_ALLOW_SEALING): never mapped, as
    // the trainer could shrink it under the mapping; Publish reads it with pread instead.
    t->fd_ = object.fd;
    closer.fd = -1;
    t->offset_ = region.offset();
    return t;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = region.offset() / page * page;
  const uint64_t delta = region.offset() - aligned;
  const size_t len = static_cast<size_t>(delta + size);
  void* map = mmap(nullptr, len, PROT_READ, MAP_SHARED, object.fd, static_cast<off_t>(aligned));
  if (map == MAP_FAILED) {
    const int err = errno;
    return absl::Status(err == ENOMEM ? absl::StatusCode::kResourceExhausted
                                      : absl::StatusCode::kInvalidArgument,
                        absl::StrCat(what, ": cannot map ", len, " bytes of ", object.name,
                                     " at offset ", aligned, ": ", std::strerror(err)));
  }
  t->map_ = map;
  t->map_len_ = len;
  t->data_ = static_cast<const uint8_t*>(map) + delta;
  return t;
}

absl::Status MappedTensor::CopyTo(uint8_t* dst, size_t offset, size_t len) const {
  if (offset > size_ || len > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat(what_, ": copy of [", offset, ", +", len,
                                              ") outside the tensor's ", size_, " bytes"));
  }
  if (fd_ < 0) {
    if (len != 0) std::memcpy(dst, data_ + offset, len);
    return absl::OkStatus();
  }
  size_t done = 0;
  while (done < len) {
    const ssize_t n = pread(fd_, dst + done, len - done,
                            static_cast<off_t>(offset_ + offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(absl::StrCat(what_, ": reading the region: ",
                                              std::strerror(errno)));
    }
    if (n == 0) {
      struct stat st;
      const int64_t now = fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      return absl::FailedPreconditionError(absl::StrCat(
          what_, ": the object shrank to ", now, " bytes under its registered region [",
          offset_, ", ", offset_ + size_, "); register the tensors again"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// ---- TrainerApiService --------------------------------------------------------------------------

TrainerApiService::TrainerApiService(PublishQueue* queue, int copy_threads)
    : TrainerApiService(queue, [copy_threads] {
        TrainerApiOptions o;
        o.copy_threads = copy_threads;
        return o;
      }()) {}

TrainerApiService::TrainerApiService(PublishQueue* queue, TrainerApiOptions options)
    : queue_(queue), options_(std::move(options)), log_(Logger("trainer-api")) {}

TrainerApiService::~TrainerApiService() = default;

v1::RegisterTensorsResponse TrainerApiService::CountsLocked() const {
  v1::RegisterTensorsResponse r;
  r.set_clients(static_cast<uint32_t>(clients_.size()));
  uint32_t tensors = 0;
  uint64_t bytes = 0;
  for (const auto& [name, client] : clients_) {
    tensors += static_cast<uint32_t>(client.tensors.size());
    for (const auto& t : client.tensors) bytes += t->size();
  }
  r.set_tensors(tensors);
  r.set_bytes(bytes);
  return r;
}

absl::StatusOr<v1::RegisterTensorsResponse> TrainerApiService::DoRegister(
    const v1::RegisterTensorsRequest& request, const std::optional<PeerCred>& peer) {
  const std::string& name = request.client();
  if (name.empty()) {
    return absl::InvalidArgumentError("RegisterTensors: client is empty (name the process, e.g. "
                                      "\"rank0\")");
  }
  const std::string who = absl::StrCat("client ", Quoted(name));
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": no tensors to register"));
  }
  // Validate and map outside the lock (opening objects may be slow).
  std::vector<std::shared_ptr<const MappedTensor>> mapped;
  mapped.reserve(request.tensors().size());
  std::map<std::string, int> seen;
  CudaRegionOpener cuda(&options_.devices);
  for (int i = 0; i < request.tensors().size(); ++i) {
    const v1::TensorLocation& location = request.tensors(i);
    const std::string what =
        absl::StrCat(who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i),
                                                     location.spec().name()));
    auto [it, inserted] = seen.emplace(location.spec().name(), i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": duplicate name (also tensor ",
                                                     it->second, ")"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<MappedTensor> t,
                     MappedTensor::Map(location, what, &cuda, peer));
    mapped.push_back(std::move(t));
  }

  absl::MutexLock lock(&mu_);
  for (const auto& t : mapped) {
    auto owner = owners_.find(t->spec().name());
    if (owner != owners_.end() && owner->second != name) {
      return absl::AlreadyExistsError(absl::StrCat(who, ": tensor '", t->spec().name(),
                                                   "' is already registered by client ",
                                                   Quoted(owner->second)));
    }
  }
  auto existing = clients_.find(name);
  const bool replaced = existing != clients_.end();
  if (replaced) {
    for (const auto& t : existing->second.tensors) owners_.erase(t->spec().name());
  }
  Client& client = clients_[name];
  client.generation = next_generation_++;
  client.tensors = std::move(mapped);
  for (const auto& t : client.tensors) owners_[t->spec().name()] = name;
  // A snapshot of the replaced tensors no longer counts: the client publishes again.
  if (round_.has_value() && round_->snapshots.erase(name) > 0) {
    log_->warn("{} re-registered while version {} was being assembled: its snapshot is dropped, "
               "it must publish again",
               who, round_->version);
  }
  v1::RegisterTensorsResponse counts = CountsLocked();
  uint64_t bytes = 0;
  size_t on_gpu = 0;
  for (const auto& t : client.tensors) {
    bytes += t->size();
    if (t->gpu() != nullptr) ++on_gpu;
  }
  log_->info("{} {} {} tensors ({}, {} in CUDA memory); now {} clients, {} tensors", who,
             replaced ? "re-registered" : "registered", client.tensors.size(), FormatBytes(bytes),
             on_gpu, counts.clients(), counts.tensors());
  return counts;
}

absl::Status TrainerApiService::DoUnregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(name);
  if (it == clients_.end()) {
    return absl::NotFoundError(absl::StrCat("Unregister: client ", Quoted(name),
                                            " is not registered"));
  }
  for (const auto& t : it->second.tensors) owners_.erase(t->spec().name());
  clients_.erase(it);
  log_->info("client {} unregistered; now {} clients", Quoted(name), clients_.size());
  if (round_.has_value()) {
    round_->snapshots.erase(name);
    if (round_->snapshots.empty()) {
      round_.reset();
    } else {
      // The remaining clients may all have published already.
      absl::StatusOr<bool> committed = MaybeCommitLocked();
      if (!committed.ok()) {
        log_->error("version could not be queued after client {} unregistered: {}", Quoted(name),
                    committed.status().ToString());
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> TrainerApiService::MaybeCommitLocked(
    std::shared_ptr<InputsRelease> release) {
  if (!round_.has_value()) return false;
  for (const auto& [name, client] : clients_) {
    if (!round_->snapshots.contains(name)) return false;
  }
  Round round = std::move(*round_);
  round_.reset();
  std::vector<OwnedTensor> tensors;
  std::vector<std::string> names;
  for (auto& [name, snapshot] : round.snapshots) {
    names.push_back(name);
    for (OwnedTensor& t : snapshot) tensors.push_back(std::move(t));
  }
  const std::string source = absl::StrCat("trainer-api clients ", absl::StrJoin(names, ", "));
  // Refused now, so the completing client hears it (the core checks again when publishing).
  std::vector<GuardTensor> guard;
  guard.reserve(tensors.size());
  for (const OwnedTensor& t : tensors) {
    guard.push_back({t.name, t.size()});
  }
  RETURN_IF_ERROR(queue_->CheckPublishGuard(
      guard, round.allow_degenerate, absl::StrCat("version ", round.version, " from ", source)));
  absl::Status queued =
      queue_->EnqueueTensors(round.version, std::move(tensors), source, round.allow_degenerate,
                             std::move(release));
  if (!queued.ok()) {
    return absl::Status(queued.code(), absl::StrCat("version ", round.version, " from ", source,
                                                    " was not queued: ", queued.message()));
  }
  log_->info("version {} committed by {} (queued for encoding)", round.version, source);
  return true;
}

absl::StatusOr<uint64_t> TrainerApiService::ChooseRoundVersion(
    const v1::LocalPublishRequest& request, const std::string& who, bool* completes) {
  // This client completes the round when every other registered client is in it already.
  size_t others_in = 0;
  if (round_.has_value()) {
    for (const auto& [name, snapshot] : round_->snapshots) {
      if (name != request.client() && clients_.contains(name)) ++others_in;
    }
  }
  *completes = others_in + 1 == clients_.size();
  if (round_.has_value()) {
    if (request.has_version() && request.version() != round_->version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Publish: ", who, " publishes version ", request.version(), " but client ",
          Quoted(round_->first_client), " published version ", round_->version,
          "; every client must publish the same version"));
    }
    return round_->version;
  }
  std::optional<uint64_t> requested;
  if (request.has_version()) requested = request.version();
  absl::StatusOr<uint64_t> chosen = queue_->ChooseVersion(requested);
  if (!chosen.ok()) return Prefixed(absl::StrCat("Publish: ", who), chosen.status());
  return *chosen;
}

namespace {

// A lent tensor becomes a copy (its round did not complete in the lender's call).
void CopyLent(std::vector<OwnedTensor>& tensors) {
  for (OwnedTensor& t : tensors) {
    if (t.keep == nullptr) continue;
    t.bytes.assign(t.borrowed.begin(), t.borrowed.end());
    t.borrowed = {};
    t.keep.reset();
  }
}

}  // namespace

absl::StatusOr<std::vector<OwnedTensor>> TrainerApiService::TakeTensors(
    const std::vector<std::shared_ptr<const MappedTensor>>& tensors, const std::string& who,
    uint64_t version, bool lend) const {
  std::vector<OwnedTensor> snapshot;
  snapshot.reserve(tensors.size());
  struct Chunk {
    size_t tensor;
    size_t offset;
    size_t bytes;
  };
  constexpr size_t kChunkBytes = 8u << 20;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const MappedTensor& t = *tensors[i];
    OwnedTensor o;
    o.name = t.spec().name();
    o.dtype = t.dtype();
    o.shape.assign(t.spec().shape().begin(), t.spec().shape().end());
    if (t.gpu() != nullptr) {
      // CUDA tensors: one copy each on the tensor's device.
      const std::string what = absl::StrCat(
          "Publish: ", who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), o.name));
      RETURN_IF_ERROR(SnapshotCuda(t, what, &o));
    } else if (lend && t.mapped()) {
      // Sealed against shrinking and mapped: read in place by the publish.
      o.borrowed = t.bytes();
      o.keep = tensors[i];
    } else {
      o.bytes.resize(t.size());
      for (size_t off = 0; off < o.bytes.size(); off += kChunkBytes) {
        chunks.push_back({i, off, std::min(kChunkBytes, o.bytes.size() - off)});
      }
    }
    snapshot.push_back(std::move(o));
  }
  // Mapped regions are memcpy'd, the others pread (a shrunk object is an error, not SIGBUS).
  // Large models are copied in chunks over the copy threads.
  std::vector<absl::Status> copied(chunks.size());
  ParallelFor(chunks.size(), options_.copy_threads, 1, [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      copied[c] = tensors[chunk.tensor]->CopyTo(snapshot[chunk.tensor].bytes.data() + chunk.offset,
                                                chunk.offset, chunk.bytes);
    }
  });
  for (const absl::Status& st : copied) {
    if (!st.ok()) return Prefixed(absl::StrCat("Publish of version ", version), st);
  }
  return snapshot;
}

absl::StatusOr<v1::LocalPublishResponse> TrainerApiService::DoPublish(
    const v1::LocalPublishRequest& request, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  const std::string& name = request.client();
  const std::string who = absl::StrCat("client ", Quoted(name));
  std::vector<std::shared_ptr<const MappedTensor>> tensors;
  uint64_t generation = 0;
  uint64_t version = 0;
  bool completes = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(name);
    if (it == clients_.end()) {
      return absl::NotFoundError(absl::StrCat("Publish: ", who,
                                              " is not registered (call RegisterTensors first)"));
    }
    tensors = it->second.tensors;
    generation = it->second.generation;
    ASSIGN_OR_RETURN(version, ChooseRoundVersion(request, who, &completes));
  }

  // The snapshot (or the loan), outside the lock: other clients take theirs at the same time.
  const absl::Time start = absl::Now();
  // Lent only to a call without a deadline: a client whose deadline expires returns while the
  // pass may still read (gRPC ends the call on the client's side, whatever the server does),
  // and its trainer would then write under the pass. A call with a deadline gets a copy.
  const bool lend = completes && deadline == absl::InfiniteFuture();
  ASSIGN_OR_RETURN(std::vector<OwnedTensor> snapshot, TakeTensors(tensors, who, version, lend));
  const bool lent = std::any_of(snapshot.begin(), snapshot.end(),
                                [](const OwnedTensor& t) { return t.keep != nullptr; });
  std::shared_ptr<InputsRelease> release =
      lent ? std::make_shared<InputsRelease>() : nullptr;

  v1::LocalPublishResponse response;
  response.set_version(version);
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(name);
    if (it == clients_.end() || it->second.generation != generation) {
      return absl::AbortedError(absl::StrCat("Publish: ", who,
                                             " re-registered or unregistered during the snapshot; "
                                             "publish again"));
    }
    if (!round_.has_value()) {
      round_.emplace(Round{});  // Round{}: clang cannot default-construct it in emplace() here
      round_->version = version;
      round_->first_client = name;
    } else if (round_->version != version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Publish: ", who, " publishes version ", version, " but client ",
          Quoted(round_->first_client), " published version ", round_->version,
          " at the same time; every client must publish the same version"));
    }
    round_->snapshots[name] = std::move(snapshot);
    round_->allow_degenerate = round_->allow_degenerate || request.allow_degenerate();
    ASSIGN_OR_RETURN(const bool committed, MaybeCommitLocked(release));
    response.set_committed(committed);
    if (!committed) {
      // A round holds lent memory only inside the call that commits it.
      if (lent) CopyLent(round_->snapshots[name]);
      release.reset();
      log_->debug("{} published its share of version {} ({}/{} clients)", who, version,
                  round_->snapshots.size(), clients_.size());
    }
  }
  if (release != nullptr) {
    absl::Status read = release->Wait(deadline, cancelled);
    if (!read.ok()) {
      return absl::Status(read.code(), absl::StrCat("Publish of version ", version, " by ", who,
                                                    ": ", read.message()));
    }
  }
  const int64_t micros = absl::ToInt64Microseconds(absl::Now() - start);
  response.set_snapshot_micros(micros < 0 ? 0 : static_cast<uint64_t>(micros));
  return response;
}

absl::Status TrainerApiService::SnapshotCuda(const MappedTensor& t, const std::string& what,
                                             OwnedTensor* out) const {
  cuda::Device* const device = t.gpu()->device();
  const size_t bytes = t.size();
  auto failed = [&](const char* step, const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat(what, ": ", step, " on ", device->Describe(), ": ",
                                                st.message()));
  };
  if (options_.cuda_snapshot == CudaSnapshot::kHost) {
    out->bytes.resize(bytes);
    if (bytes == 0) return absl::OkStatus();
    absl::Status st = device->CopyToHost(out->bytes.data(), t.device_data(), bytes);
    if (!st.ok()) return failed("copying the tensor to the host", st);
    return absl::OkStatus();
  }
  const bool pinned = options_.cuda_snapshot == CudaSnapshot::kPinned;
  auto snapshot = std::make_shared<DeviceBytes>();
  snapshot->device = device;
  absl::StatusOr<cuda::Allocation> memory = device->Allocate(
      bytes, pinned ? cuda::Allocation::Kind::kPinnedHost : cuda::Allocation::Kind::kDevice);
  if (!memory.ok()) return failed("allocating the snapshot", memory.status());
  snapshot->memory = std::move(*memory);
  if (bytes != 0) {
    absl::Status st = pinned ? device->CopyToHost(snapshot->memory.data(), t.device_data(), bytes)
                             : device->CopyOnDevice(snapshot->memory.data(), t.device_data(),
                                                    bytes);
    if (!st.ok()) return failed("copying the tensor", st);
  }
  out->device_bytes = std::move(snapshot);
  return absl::OkStatus();
}

grpc::Status TrainerApiService::RegisterTensors(grpc::ServerContext* context,
                                                const v1::RegisterTensorsRequest* request,
                                                v1::RegisterTensorsResponse* response) {
  absl::StatusOr<v1::RegisterTensorsResponse> r = DoRegister(*request, PeerCredOf(*context));
  if (!r.ok()) {
    log_->warn("RegisterTensors: {}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status TrainerApiService::Unregister(grpc::ServerContext*,
                                           const v1::UnregisterRequest* request,
                                           v1::UnregisterResponse*) {
  return ToGrpcStatus(DoUnregister(request->client()));
}

grpc::Status TrainerApiService::Publish(grpc::ServerContext* context,
                                        const v1::LocalPublishRequest* request,
                                        v1::LocalPublishResponse* response) {
  // No deadline set by the client: time_point::max (gpr_inf_future).
  const absl::Time deadline = context->deadline() == std::chrono::system_clock::time_point::max()
                                  ? absl::InfiniteFuture()
                                  : absl::FromChrono(context->deadline());
  absl::StatusOr<v1::LocalPublishResponse> r =
      DoPublish(*request, deadline, [context] { return context->IsCancelled(); });
  if (!r.ok()) {
    log_->warn("{}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

}  // namespace refit::publisher
