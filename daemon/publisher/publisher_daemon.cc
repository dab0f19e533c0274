#include "daemon/publisher/publisher_daemon.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cuda/device.h"
#include "daemon/auth/authorized_services.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/test_hooks.h"
#include "daemon/common/units.h"
#include "daemon/config/config.h"
#include "daemon/config/credentials.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/publisher/device_cache.h"
#include "daemon/publisher/publisher_control.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/runtime/daemon_runtime.h"
#include "daemon/runtime/daemon_servers.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/versions.h"
#include "refit/version.h"

namespace refit::publisher {
namespace {

// How long Shutdown lets in-flight calls finish before cancelling them.
constexpr auto kShutdownGrace = std::chrono::seconds(2);

class PublisherDaemonImpl final : public PublisherDaemon {
 public:
  ~PublisherDaemonImpl() override { Shutdown(); }

  void Shutdown() override {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
    log_->info("shutting down");
    metrics_.Stop();  // no scrape reads the services below while they stop
    if (data_plane_) data_plane_->Shutdown();
    if (queue_) queue_->BeginStop();  // wakes WaitVersion calls
    const auto deadline = std::chrono::system_clock::now() + kShutdownGrace;
    servers_.Shutdown(deadline);
    servers_.Wait();
    if (queue_) queue_->Stop();
    log_->info("stopped");
  }

  std::string listen_address() const override { return servers_.listen.bound_address; }
  std::string control_address() const override { return servers_.control.bound_address; }
  std::string local_address() const override { return servers_.local.bound_address; }

  absl::Status ReloadTls() override { return tls_->Reload(); }
  absl::Status CheckProgress() override {
    (void)control_service_->GetStatus();  // blocks while a lock it takes is held
    return absl::OkStatus();
  }

  std::shared_ptr<spdlog::logger> log_ = Logger("publisher");
  // The listeners' TLS material (rotation); outlives the servers that read it.
  std::unique_ptr<config::TlsReloader> tls_ = std::make_unique<config::TlsReloader>();
  // The metrics endpoint and what the data plane and queue report to; outlives them.
  metrics::DaemonMetrics metrics_;
  // Declared first, destroyed last: the core's GPU baseline and queued snapshots are
  // allocations of these devices.
  std::unique_ptr<DeviceCache> devices_;
  std::unique_ptr<PublisherCore> core_;
  std::unique_ptr<DataPlaneService> data_plane_;
  std::unique_ptr<PublishQueue> queue_;
  std::unique_ptr<PublisherControl> control_service_;
  std::unique_ptr<TrainerApiService> trainer_api_;
  // What the servers register: the services behind their authorization (daemon/auth).
  std::unique_ptr<auth::AuthorizedControl> authorized_control_;
  std::unique_ptr<auth::AuthorizedTrainerApi> authorized_trainer_api_;
  DaemonServers servers_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

// The GPU of codec.device: cuda (must open: the error names the field and the cause) or auto
// (the GPU when one opens, else null = the CPU codec); null for cpu.
absl::StatusOr<cuda::Device*> OpenCodecDevice(const v1::CodecConfig& codec, DeviceCache* devices,
                                              spdlog::logger& log) {
  if (codec.device() != v1::DEVICE_CUDA && codec.device() != v1::DEVICE_AUTO) return nullptr;
  const char* const mode = codec.device() == v1::DEVICE_CUDA ? "cuda" : "auto";
  cuda::DeviceSelector selector;
  std::string field = "publisher.codec.device";
  if (codec.has_cuda_device()) {
    selector.ordinal = static_cast<int>(codec.cuda_device());
    field = absl::StrCat("publisher.codec.device: ", mode, " with codec.cuda_device ",
                         codec.cuda_device());
  } else if (codec.has_cuda_device_uuid()) {
    absl::StatusOr<cuda::Uuid> uuid = cuda::ParseUuid(codec.cuda_device_uuid());
    if (!uuid.ok()) {
      return AnnotateAs(absl::StatusCode::kInvalidArgument, uuid.status(),
                        "publisher.codec.cuda_device_uuid");
    }
    selector.uuid = *uuid;
    field = absl::StrCat("publisher.codec.device: ", mode, " with codec.cuda_device_uuid ",
                         codec.cuda_device_uuid());
  } else {
    field = absl::StrCat("publisher.codec.device: ", mode);
  }
  absl::StatusOr<cuda::Device*> device = devices->Open(selector);
  if (!device.ok()) {
    if (codec.device() == v1::DEVICE_AUTO) {
      log.info("{}: no usable GPU ({}); encoding on the CPU", field,
               std::string(device.status().message()));
      return nullptr;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": cannot use the GPU: ", device.status().message(),
        " (use codec.device cpu, or auto to fall back to the CPU)"));
  }
  log.info("{}: encoding on {}", field, (*device)->Describe());
  return *device;
}

// Test hook stall_persist (test_hooks.h): while its file exists, the persister stalls before
// every write (a slow or stuck disk): PublisherOptions::persist_hook.
std::function<void(uint64_t)> StallPersistHook(spdlog::logger& log) {
  const TestHooks hooks = TestHooks::FromEnvironment();
  if (!hooks.enabled()) return nullptr;
  const std::string file = hooks.File(TestHook::kStallPersist);
  log.warn("test hook: persistence stalls while \"{}\" exists", file);
  return [hooks](uint64_t version) {
    if (hooks.Stalled(TestHook::kStallPersist)) {
      Logger("persist")->warn("test hook: persisting version {} stalled", version);
      hooks.WaitWhileStalled(TestHook::kStallPersist, absl::Milliseconds(20));
    }
  };
}

// What Open found in persist_dir, loudly when something was wrong.
void LogBaseline(const PublisherCore& core, spdlog::logger& log) {
  for (const std::string& f : core.removed_temp_files()) {
    log.warn("removed the stale temporary file \"{}\" of an interrupted write", f);
  }
  const v1::BaselineStatus b = core.baseline_status();
  switch (b.state()) {
    case v1::BASELINE_STATE_LOADED:
      log.info("version {} reloaded from \"{}\" (version {}) and its patch log ({} versions) ({})",
               core.newest_version(), b.path(), b.baseline_version(), b.log_versions(),
               sync::DescribeLineage(core.lineage()));
      break;
    case v1::BASELINE_STATE_MOVED_ASIDE:
      log.error("persisted baseline \"{}\" REFUSED and moved aside to \"{}\": {}; starting "
                "without it as new {} (subscribers get keyframes)",
                b.path(), b.moved_to(), b.load_error(), sync::DescribeLineage(core.lineage()));
      break;
    case v1::BASELINE_STATE_EMPTY:
      log.info("no persisted baseline in \"{}\": new {}", b.path(),
               sync::DescribeLineage(core.lineage()));
      break;
    default:
      log.info("no baseline persistence: {}", sync::DescribeLineage(core.lineage()));
      break;
  }
  if (!b.last_persist_error().empty()) {
    log.error("persist_dir: {} (versions published before a restart may be renumbered)",
              b.last_persist_error());
  }
}

// The servers (daemon_servers.h): the data plane on listen, Control behind its authorization (on
// listen or control_listen), the TrainerApi behind its peer check on local_socket.
absl::Status StartServers(const v1::PublisherConfig& config, PublisherDaemonImpl& d) {
  d.authorized_control_ = std::make_unique<auth::AuthorizedControl>(
      d.control_service_.get(),
      auth::ControlAuthorizer(config.control_access(), "publisher.control_access"));
  const v1::PublisherTransport& transport = config.transport();
  DaemonServersSpec spec;
  spec.role = "publisher";
  spec.tls = d.tls_.get();
  spec.listen = config.listen();
  spec.listen_tls = config.tls();
  spec.data_plane = {d.data_plane_.get()};
  spec.listen_max_receive_bytes = static_cast<int64_t>(transport.frame_bytes()) + (1 << 20);
  spec.keepalive_time = absl::Milliseconds(transport.keepalive_time_ms());
  spec.keepalive_timeout = absl::Milliseconds(transport.keepalive_timeout_ms());
  spec.control = d.authorized_control_.get();
  spec.control_listen = config.control_listen();
  spec.control_tls = config.control_tls();
  spec.control_socket_mode = config::FileModeOr(config.control_access().socket_mode(), 0660);
  if (d.trainer_api_ != nullptr) {
    d.authorized_trainer_api_ = std::make_unique<auth::AuthorizedTrainerApi>(
        d.trainer_api_.get(),
        auth::LocalAuthorizer(config.local_access(), "publisher.local_access", "TrainerApi"));
    spec.local = d.authorized_trainer_api_.get();
    spec.local_socket = config.local_socket();
    spec.local_socket_mode = config::FileModeOr(config.local_access().socket_mode(), 0660);
    // RegisterTensors of a model with very many tensors exceeds gRPC's 4 MiB default.
    spec.local_max_receive_bytes = 64 << 20;
  }
  REFIT_ASSIGN_OR_RETURN(d.servers_, StartDaemonServers(spec));
  return absl::OkStatus();
}

// The core's options from the config (the persist hook and the device set by the caller).
PublisherOptions CoreOptionsOf(const v1::PublisherConfig& config) {
  PublisherOptions options;
  options.history_budget_bytes = config.history().memory_budget_bytes();
  // PatchHistory keeps the newest version always (it needs >= 1).
  options.history_max_versions = std::max<uint32_t>(1, config.history().max_versions());
  options.block_log2 = static_cast<int>(config.codec().block_log2());
  options.patch_format = config.codec().patch_format() == v1::PATCH_FORMAT_V2 ? 2 : 1;
  options.patch_format_auto = config.codec().patch_format() == v1::PATCH_FORMAT_AUTO;
  options.persist_fsync = config.baseline().fsync();
  options.encode_threads = static_cast<int>(config.codec().threads());
  options.digest_threads = static_cast<int>(config.codec().threads());
  options.persist_dir = config.baseline().persist_dir();
  options.compact_log_versions = config.baseline().compact_log_versions();
  options.compact_log_bytes = config.baseline().compact_log_bytes();
  options.persist_max_queued_versions = config.baseline().max_queued_versions();
  options.persist_max_queued_bytes = config.baseline().max_queued_bytes();
  options.publish_guard.max_removed_tensor_fraction =
      config.publish_guard().max_removed_tensor_fraction();
  options.publish_guard.max_removed_byte_fraction =
      config.publish_guard().max_removed_byte_fraction();
  options.gpu_baseline = config.codec().gpu_baseline() == v1::GPU_BASELINE_PINNED
                             ? cuda::Allocation::Kind::kPinnedHost
                             : cuda::Allocation::Kind::kDevice;
  options.cut.parts = config.cut().parts();
  options.cut.rows.assign(config.cut().rows().begin(), config.cut().rows().end());
  options.cut.columns.assign(config.cut().columns().begin(), config.cut().columns().end());
  // v1 digests only once a subscriber verifies v1 (this build's verify v2): the pass does not
  // read the changed tensors a second time for digests nobody checks.
  options.lazy_v1_digests = true;
  return options;
}

// publisher.shard as the wire's ShardIdentity (Welcome.shard, Status.shards); empty unsharded.
v1::ShardIdentity ShardIdentityOf(const v1::ShardConfig& shard) {
  v1::ShardIdentity id;
  if (shard.count() == 0) return id;
  id.set_set(shard.set());
  id.set_index(shard.index());
  id.set_count(shard.count());
  return id;
}

DataPlaneOptions DataPlaneOptionsOf(const v1::PublisherConfig& config, const std::string& name) {
  const v1::PublisherTransport& transport = config.transport();
  DataPlaneOptions dp;
  dp.shard = ShardIdentityOf(config.shard());
  dp.name = name;
  dp.frame_bytes = transport.frame_bytes();
  dp.max_streams_per_subscriber = transport.max_streams_per_subscriber();
  dp.max_subscribers = transport.max_subscribers();
  dp.stripe_join_timeout = absl::Milliseconds(transport.stripe_join_timeout_ms());
  dp.stream_window_bytes = transport.stream_window_bytes();
  dp.single_stream_below_bytes = transport.single_stream_below_bytes();
  dp.streamed_transfers = transport.streamed_transfers();
  return dp;
}

// The TrainerApi's options: CUDA tensors of trainers are opened on their GPUs through the cache
// whatever the codec device, and snapshot to the host for the CPU codec, else where the GPU
// baseline lives.
TrainerApiOptions TrainerApiOptionsOf(const v1::PublisherConfig& config,
                                      const PublisherOptions& options, PublisherDaemonImpl& d) {
  TrainerApiOptions api;
  api.parts = config.shard().count() > 0;  // a shard publisher publishes its rows of a tensor
  api.copy_threads = options.encode_threads;
  api.devices = d.devices_->Provider();
  // Cuts (publisher.cut) read host bytes (PublisherCore cuts before encoding): with cuts, CUDA
  // tensors are snapshot to the host, and GPU encoding uploads their parts.
  api.cuda_snapshot = options.device == nullptr || options.cut.parts > 0 ? CudaSnapshot::kHost
                      : options.gpu_baseline == cuda::Allocation::Kind::kPinnedHost
                          ? CudaSnapshot::kPinned
                          : CudaSnapshot::kDevice;
  return api;
}

// The publish queue (with its test hook) and the Control service around the core.
void MakeQueueAndControl(const v1::PublisherConfig& config, const std::string& name,
                         const PublisherOptions& options, absl::Time started,
                         PublisherDaemonImpl& d) {
  PublishQueueOptions queue_options;
  queue_options.max_pending = config.publish_queue().max_pending();
  queue_options.metrics = d.metrics_.refit();
  if (const TestHooks hooks = TestHooks::FromEnvironment(); hooks.enabled()) {
    queue_options.stall_file = hooks.File(TestHook::kStallPublish);
    d.log_->warn("test hook: publishes stall while \"{}\" exists", queue_options.stall_file);
  }
  d.queue_ = std::make_unique<PublishQueue>(d.core_.get(), d.data_plane_.get(), queue_options);
  // The TrainerApi service (served by StartServers) exists before Control, which reports it.
  if (!config.local_socket().empty()) {
    d.trainer_api_ = std::make_unique<TrainerApiService>(d.queue_.get(),
                                                         TrainerApiOptionsOf(config, options, d));
  }
  std::function<v1::TrainerApiStatus()> trainer_status;
  if (d.trainer_api_ != nullptr) {
    trainer_status = [api = d.trainer_api_.get()] { return api->TrainerStatus(); };
  }
  d.control_service_ = std::make_unique<PublisherControl>(
      d.core_.get(), d.data_plane_.get(), d.queue_.get(),
      ControlOptions{.name = name,
                     .history_budget_bytes = options.history_budget_bytes,
                     .digest_threads = options.digest_threads,
                     .started = started,
                     .tls_status = [tls = d.tls_.get()] { return tls->Status(); },
                     .trainer_status = std::move(trainer_status),
                     .publish_dirs = {config.files().publish_dirs().begin(),
                                      config.files().publish_dirs().end()},
                     .export_dir = config.files().export_dir(),
                     .export_mode = config::FileModeOr(config.files().export_mode(), 0600),
                     .persist_dir = options.persist_dir,
                     .shard = ShardIdentityOf(config.shard()),
                     .metrics_address = d.metrics_.address()});
  d.metrics_.Serve([control = d.control_service_.get()] { return control->GetStatus(); });
}

// The "serving" log line and the ready file, once every server is bound.
absl::Status AnnounceServing(const v1::PublisherConfig& config, const std::string& name,
                             const PublisherOptions& options, const PublisherDaemonImpl& d) {
  const bool separate_control = !config.control_listen().empty();
  const bool pinned = options.gpu_baseline == cuda::Allocation::Kind::kPinnedHost;
  d.log_->info(
      "publisher \"{}\" {} serving: data plane on {}, control on {}, trainer api on {} "
      "(history budget {}, codec {}, persist dir \"{}\"){}",
      name, kRefitVersion, d.servers_.listen.bound_address,
      separate_control ? d.servers_.control.bound_address : d.servers_.listen.bound_address,
      config.local_socket().empty() ? std::string("(none)") : d.servers_.local.bound_address,
      FormatBytes(options.history_budget_bytes),
      options.device == nullptr
          ? absl::StrCat("on the CPU (",
                         config.codec().threads() == 0
                             ? std::string("a thread per hardware thread")
                             : absl::StrCat(config.codec().threads(), " threads"),
                         ")")
          : absl::StrCat("on ", options.device->Describe(), ", GPU baseline in ",
                         pinned ? "pinned host memory" : "device memory"),
      options.persist_dir,
      d.metrics_.address().empty()
          ? std::string()
          : absl::StrCat(", metrics on http://", d.metrics_.address(), "/metrics"));
  if (config.ready_file().empty()) return absl::OkStatus();
  return WriteServersReadyFile(config.ready_file(), "publisher.ready_file", d.servers_,
                               d.metrics_.address());
}

}  // namespace

absl::StatusOr<std::unique_ptr<PublisherDaemon>> PublisherDaemon::Start(
    const v1::PublisherConfig& config, cuda::DeviceOpener open_device) {
  const absl::Time started = absl::Now();
  // The GPU first: a refusal then stops Start before anything runs.
  if (open_device == nullptr) {
    open_device = [](const cuda::DeviceSelector& selector)
        -> absl::StatusOr<std::unique_ptr<cuda::Device>> {
      return absl::UnavailableError(absl::StrCat(
          "no CUDA device for ", selector.ToString(), ": this process has no GPU support"));
    };
  }
  auto devices = std::make_unique<DeviceCache>(std::move(open_device));
  REFIT_ASSIGN_OR_RETURN(cuda::Device* const codec_device,
                         OpenCodecDevice(config.codec(), devices.get(), *Logger("publisher")));
  auto daemon = std::make_unique<PublisherDaemonImpl>();
  daemon->devices_ = std::move(devices);
  const std::string name = config.name().empty() ? HostName() : config.name();

  PublisherOptions options = CoreOptionsOf(config);
  options.persist_hook = StallPersistHook(*daemon->log_);
  options.device = codec_device;
  absl::StatusOr<std::unique_ptr<PublisherCore>> core = PublisherCore::Open(options);
  if (!core.ok()) {
    return Annotate(core.status(), "publisher.baseline.persist_dir ", Quoted(options.persist_dir));
  }
  daemon->core_ = std::move(*core);
  LogBaseline(*daemon->core_, *daemon->log_);

  REFIT_ASSIGN_OR_RETURN(
      daemon->metrics_,
      metrics::DaemonMetrics::Start(v1::ROLE_PUBLISHER, "publisher.metrics", config.metrics()));
  DataPlaneOptions data_plane_options = DataPlaneOptionsOf(config, name);
  data_plane_options.metrics = daemon->metrics_.refit();
  daemon->data_plane_ =
      std::make_unique<DataPlaneService>(daemon->core_.get(), std::move(data_plane_options));
  MakeQueueAndControl(config, name, options, started, *daemon);
  REFIT_RETURN_IF_ERROR(StartServers(config, *daemon));
  REFIT_RETURN_IF_ERROR(AnnounceServing(config, name, options, *daemon));
  return std::unique_ptr<PublisherDaemon>(std::move(daemon));
}

}  // namespace refit::publisher
