#include "daemon/subscriber/subscriber_daemon.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cuda/device.h"
#include "daemon/auth/authorized_services.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/common/unix_time.h"
#include "daemon/config/address.h"
#include "daemon/config/config.h"
#include "daemon/config/credentials.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/runtime/daemon_runtime.h"
#include "daemon/runtime/daemon_servers.h"
#include "daemon/store/cuda_store.h"
#include "daemon/store/shm_store.h"
#include "daemon/subscriber/consumer_api.h"
#include "daemon/subscriber/peer_server.h"
#include "daemon/subscriber/scrubber.h"
#include "daemon/subscriber/shard_join.h"
#include "daemon/subscriber/subscriber_control.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/upstream.h"
#include "daemon/sync/selection.h"

namespace refit::subscriber {
namespace {

// Largest frame a subscriber serving peers accepts from them (their Hello.max_frame_bytes is at
// most the config maximum, 64 MiB) plus envelope room.
constexpr int64_t kPeerMaxReceiveBytes = (64 << 20) + (1 << 20);
constexpr char kSelfConsumer[] = "refitd-subscriber";

// Config of the in-place staging machinery: refresh_standby, refresh_wait_ms,
// refresh_copy_density, refresh_copy_lines.
void ApplyRefreshConfig(const v1::SubscriberConfig& c, SubscriberOptions& o) {
  o.refresh_standby = c.refresh_standby();
  o.refresh_wait = absl::Milliseconds(c.refresh_wait_ms());
  o.refresh_copy_density = c.refresh_copy_density();
  o.refresh_copy_lines = c.refresh_copy_lines();
  o.background_nice = static_cast<int>(c.background_nice());
}

// store.scrub_bytes_per_second, store.scrub_interval_ms.
ScrubberOptions ScrubberOptionsOf(const v1::StoreConfig& store) {
  ScrubberOptions o;
  // A single-copy store has no second slot to repair into: no scrub (the config refuses one
  // asked for explicitly).
  o.bytes_per_second = store.slots() == 1 ? 0 : store.scrub_bytes_per_second();
  o.interval = absl::Milliseconds(store.scrub_interval_ms());
  return o;
}

// Status fields 27..29.
void ScrubStatus(const Scrubber& scrub, v1::StatusResponse& r) {
  const ScrubStats s = scrub.stats();
  r.set_scrub_passes(s.passes);
  r.set_scrub_mismatches(s.mismatches);
  if (s.last_pass_end != absl::InfinitePast()) {
    r.set_last_scrub_unix_nanos(UnixNanos(s.last_pass_end));
  }
}

// "next_version", "catch_up", ... (VersionHeader.reason, lower case without the prefix).
std::string ReasonName(v1::TransferReason reason) {
  std::string name = v1::TransferReason_Name(reason);
  constexpr absl::string_view kPrefix = "TRANSFER_REASON_";
  if (absl::StartsWith(name, kPrefix)) name = name.substr(kPrefix.size());
  return absl::AsciiStrToLower(name);
}

absl::StatusOr<std::vector<std::string>> Targets(
    const google::protobuf::RepeatedPtrField<std::string>& addresses, const std::string& field) {
  std::vector<std::string> out;
  for (int i = 0; i < addresses.size(); ++i) {
    auto a = config::ParseAddress(addresses[i], config::AddressUse::kConnect);
    if (!a.ok()) {
      return AnnotateAs(absl::StatusCode::kInvalidArgument, a.status(), field, "[", i, "] ",
                        Quoted(addresses[i]));
    }
    out.push_back(a->grpc_target);
  }
  return out;
}

class SubscriberDaemonImpl final : public SubscriberDaemon {
 public:
  explicit SubscriberDaemonImpl(const v1::SubscriberConfig& config)
      : config_(config),
        name_(config.name().empty() ? HostName() : config.name()),
        log_(Logger("subscriber")),
        start_time_(absl::Now()) {}

  ~SubscriberDaemonImpl() override { Shutdown(); }

  absl::Status Init(const cuda::DeviceOpener& open_device);
  absl::Status StartServers(const v1::SubscriberConfig& c);
  void Shutdown() override;

  std::string listen_address() const override { return servers_.listen.bound_address; }
  std::string control_address() const override { return servers_.control.bound_address; }
  std::string local_address() const override { return servers_.local.bound_address; }
  absl::Status ReloadTls() override { return tls_->Reload(); }
  absl::Status CheckProgress() override {
    v1::StatusRequest request;
    v1::StatusResponse response;  // Status reads no context: blocks while a lock it takes is held
    return FromGrpcStatus(control_->Status(nullptr, &request, &response));
  }

 private:
  // Init's steps, in order.
  absl::Status OpenDevice(const cuda::DeviceOpener& open_device);
  absl::Status MakeUpstream();
  // upstream.shards: the join and one Upstream per shard (upstreams_[k] feeds port k).
  absl::Status MakeShardUpstreams(UpstreamOptions base);
  absl::Status MakePeers();
  void MakeServices();
  absl::Status AnnounceStarted();

  void OnApplied(const AppliedEvent& ev);
  // The background scrub (store.scrub_*): mismatches become repair requests upstream.
  std::unique_ptr<Scrubber> MakeScrubber(const v1::StoreConfig& store);
  v1::ShardsStatus ShardsStatusOf() const;
  v1::RefitStats LastRefit() const;
  uint64_t BytesReceived() const;

  const v1::SubscriberConfig config_;
  const std::string name_;
  std::shared_ptr<spdlog::logger> log_;
  const absl::Time start_time_;
  // TLS material of the upstream and the listeners (rotation); outlives what reads it.
  std::unique_ptr<config::TlsReloader> tls_ = std::make_unique<config::TlsReloader>();
  // The metrics endpoint and what the upstreams report to; outlives them.
  metrics::DaemonMetrics metrics_;

  std::unique_ptr<cuda::Device> device_;  // store.kind cuda; outlives core_ (declared first)
  std::unique_ptr<SubscriberCore> core_;
  VersionBoard board_;

  // serve_peers: every applied version republished, served on `listen` (and the relay).
  std::unique_ptr<PeerServer> peers_;

  // upstream.shards: joins the shards' parts into one transfer of core_ (before upstreams_:
  // destroyed after them).
  std::unique_ptr<ShardJoin> shards_;
  // The one upstream, or one per shard.
  std::vector<std::unique_ptr<Upstream>> upstreams_;
  std::unique_ptr<Scrubber> scrubber_;  // after upstreams_ and core_: destroyed first
  std::unique_ptr<ConsumerApiService> consumer_;
  std::unique_ptr<SubscriberControlService> control_;
  // What the servers register: the services behind their authorization (daemon/auth).
  std::unique_ptr<auth::AuthorizedControl> authorized_control_;
  std::unique_ptr<auth::AuthorizedConsumerApi> authorized_consumer_;
  DaemonServers servers_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

// The servers (daemon_servers.h): Control behind its authorization (on listen or control_listen),
// the ConsumerApi behind its peer check on local_socket, the peers' DataPlane on listen.
absl::Status SubscriberDaemonImpl::StartServers(const v1::SubscriberConfig& c) {
  authorized_control_ = std::make_unique<auth::AuthorizedControl>(
      control_.get(), auth::ControlAuthorizer(c.control_access(), "subscriber.control_access"));
  authorized_consumer_ = std::make_unique<auth::AuthorizedConsumerApi>(
      consumer_.get(),
      auth::LocalAuthorizer(c.local_access(), "subscriber.local_access", "ConsumerApi"));
  DaemonServersSpec spec;
  spec.role = "subscriber";
  spec.tls = tls_.get();
  spec.listen = c.listen();
  spec.listen_tls = c.tls();
  if (peers_ != nullptr) {
    spec.data_plane = {peers_->service()};
    spec.listen_max_receive_bytes = kPeerMaxReceiveBytes;
  }
  spec.control = authorized_control_.get();
  spec.control_listen = c.control_listen();
  spec.control_tls = c.control_tls();
  spec.control_socket_mode = config::FileModeOr(c.control_access().socket_mode(), 0660);
  spec.local = authorized_consumer_.get();
  spec.local_socket = c.local_socket();
  spec.local_socket_mode = config::FileModeOr(c.local_access().socket_mode(), 0660);
  REFIT_ASSIGN_OR_RETURN(servers_, StartDaemonServers(spec));
  return absl::OkStatus();
}

// The core's options from the config (store, leases, staging): host-memory stores; a GPU store's
// factory is set once OpenDevice has the device.
SubscriberOptions CoreOptionsOf(const v1::SubscriberConfig& c) {
  SubscriberOptions o;
  o.store.slots = static_cast<int>(c.store().slots());
  o.store.default_ttl = absl::Milliseconds(c.leases().default_ttl_ms());
  o.store.max_ttl = absl::Milliseconds(c.leases().max_ttl_ms());
  o.store.max_leases = static_cast<int>(c.leases().max_leases());
  o.store.max_leases_per_consumer = static_cast<int>(
      std::min(c.leases().max_leases_per_consumer(), c.leases().max_leases()));
  store::ShmStoreOptions host;
  host.shm_prefix = c.store().shm_prefix();
  host.allow_unsealed = c.store().allow_unsealed();
  host.prefault = c.store().prefault();
  o.make_store = store::HostStoreFactory(std::move(host));
  o.retained_patch_bytes = c.store().retained_patch_bytes();
  o.single_copy_staging_bytes = c.store().single_copy_staging_bytes();
  o.pause_wait = absl::Milliseconds(c.store().pause_wait_ms());
  o.change_set_bytes = c.store().change_set_bytes();
  o.threads = static_cast<int>(c.staging().threads());
  if (c.staging().max_bytes() > 0) o.max_slot_bytes = c.staging().max_bytes();
  o.max_frame_bytes = c.upstream().max_frame_bytes();
  o.self_consumer = kSelfConsumer;
  // upstream.slice, validated by the config (CheckSlice) before the daemon starts.
  absl::StatusOr<sync::TensorSelection> slice = sync::TensorSelection().WithSlice(
      c.upstream().slice().rank(), c.upstream().slice().ranks(), "upstream.slice");
  if (c.upstream().slice().ranks() > 0 && slice.ok()) o.slice = *std::move(slice);
  ApplyRefreshConfig(c, o);
  return o;
}

// The upstream's options from the config except the credentials and the channel args.
UpstreamOptions UpstreamTimingOf(const v1::UpstreamConfig& u) {
  UpstreamOptions up;
  up.connections = u.connections();
  up.max_frame_bytes = u.max_frame_bytes();
  up.connect_timeout = absl::Milliseconds(u.connect_timeout_ms());
  up.keepalive_time = absl::Milliseconds(u.keepalive_time_ms());
  up.keepalive_timeout = absl::Milliseconds(u.keepalive_timeout_ms());
  up.backoff_initial = absl::Milliseconds(u.backoff().initial_ms());
  up.backoff_max = absl::Milliseconds(u.backoff().max_ms());
  up.backoff_multiplier = u.backoff().multiplier();
  up.backoff_jitter = u.backoff().jitter();
  up.stream_progress = u.stream_progress();
  up.streamed_transfers = u.streamed_transfers();
  return up;
}

// store.kind cuda: opens the selected GPU into device_; other kinds need none.
absl::Status SubscriberDaemonImpl::OpenDevice(const cuda::DeviceOpener& open_device) {
  const v1::StoreConfig& store = config_.store();
  if (store.kind() != v1::STORE_KIND_CUDA) return absl::OkStatus();
  cuda::DeviceSelector selector;
  if (store.has_cuda_device()) selector.ordinal = static_cast<int>(store.cuda_device());
  if (store.has_cuda_device_uuid()) {
    REFIT_ASSIGN_OR_RETURN(selector.uuid, cuda::ParseUuid(store.cuda_device_uuid()));
  }
  absl::StatusOr<std::unique_ptr<cuda::Device>> device =
      open_device != nullptr
          ? open_device(selector)
          : absl::UnavailableError(absl::StrCat("no CUDA device for ", selector.ToString(),
                                                ": this process has no GPU support"));
  if (!device.ok()) {
    return Annotate(device.status(), "subscriber.store.kind: cuda needs a usable GPU");
  }
  device_ = std::move(*device);
  log_->info("tensor store on {} (CUDA IPC)", device_->Describe());
  return absl::OkStatus();
}

absl::Status SubscriberDaemonImpl::MakeUpstream() {
  const v1::UpstreamConfig& u = config_.upstream();
  UpstreamOptions up = UpstreamTimingOf(u);
  up.metrics = metrics_.refit();
  up.name = name_;
  REFIT_ASSIGN_OR_RETURN(up.credentials,
                         tls_->ChannelCredentials(u.tls(), "subscriber.upstream.tls"));
  config::ApplyClientTlsArgs(u.tls(), &up.channel_args);
  up.digest_v2 = config_.store().digest_v2();
  up.tensors.assign(u.tensors().begin(), u.tensors().end());
  up.slice_rank = u.slice().rank();
  up.slice_ranks = u.slice().ranks();
  scrubber_ = MakeScrubber(config_.store());
  if (u.shards_size() > 0) return MakeShardUpstreams(std::move(up));
  REFIT_ASSIGN_OR_RETURN(up.addresses, Targets(u.addresses(), "subscriber.upstream.addresses"));
  REFIT_ASSIGN_OR_RETURN(up.bootstrap_peers,
                         Targets(u.bootstrap_peers(), "subscriber.upstream.bootstrap_peers"));
  up.tap = peers_ != nullptr ? peers_->relay() : nullptr;
  upstreams_.push_back(std::make_unique<Upstream>(
      core_.get(), std::move(up), [this](const AppliedEvent& ev) { OnApplied(ev); }));
  return absl::OkStatus();
}

absl::Status SubscriberDaemonImpl::MakeShardUpstreams(UpstreamOptions base) {
  const v1::UpstreamConfig& u = config_.upstream();
  ShardJoinOptions jo;
  jo.set = u.shard_set();
  jo.count = static_cast<uint32_t>(u.shards_size());
  jo.tap = peers_ != nullptr ? peers_->relay() : nullptr;
  jo.on_applied = [this](const AppliedEvent& ev) { OnApplied(ev); };
  REFIT_ASSIGN_OR_RETURN(jo.selection,
                         sync::TensorSelection::Make(base.tensors, "subscriber.upstream.tensors"));
  shards_ = std::make_unique<ShardJoin>(core_.get(), std::move(jo));
  base.tensors_partial = true;  // each shard's publisher holds a part of the selection
  for (int k = 0; k < u.shards_size(); ++k) {
    UpstreamOptions up = base;
    REFIT_ASSIGN_OR_RETURN(up.addresses,
                           Targets(u.shards(k).addresses(),
                                   absl::StrCat("subscriber.upstream.shards[", k, "].addresses")));
    upstreams_.push_back(std::make_unique<Upstream>(
        shards_->port(static_cast<uint32_t>(k)), std::move(up), Upstream::AppliedCallback()));
  }
  return absl::OkStatus();
}

// serve_peers: a PeerServer (peer_server.h) republishing every applied version on `listen`.
absl::Status SubscriberDaemonImpl::MakePeers() {
  if (!config_.serve_peers()) return absl::OkStatus();
  REFIT_ASSIGN_OR_RETURN(
      peers_, PeerServer::Create(
                  core_.get(),
                  PeerServerOptions{.name = name_,
                                    .threads = static_cast<int>(config_.staging().threads()),
                                    .cut_through = config_.relay_cut_through(),
                                    .max_frame_bytes = config_.upstream().max_frame_bytes(),
                                    .background_nice = static_cast<int>(config_.background_nice()),
                                    .consumer = absl::StrCat(kSelfConsumer, "/peers")}));
  return absl::OkStatus();
}

// The ConsumerApi and the Control service (with its hooks into the upstream, TLS and peers).
void SubscriberDaemonImpl::MakeServices() {
  const v1::SubscriberConfig& c = config_;
  consumer_ = std::make_unique<ConsumerApiService>(
      core_.get(), &board_, ConsumerApiOptions{.layout_consumer = absl::StrCat(kSelfConsumer, "/layout")});
  SubscriberControlHooks hooks;
  Upstream* upstream = upstreams_[0].get();
  hooks.upstream_status = [upstream] { return upstream->Status(); };
  hooks.last_refit = [this] { return LastRefit(); };
  hooks.bytes_received = [this] { return BytesReceived(); };
  hooks.resync = [this](const std::vector<std::string>& t) {
    uint32_t asked = 0;
    for (const auto& up : upstreams_) asked += up->RequestResync(t);
    return asked;
  };
  if (shards_ != nullptr) hooks.shards = [this] { return ShardsStatusOf(); };
  hooks.tls_status = [tls = tls_.get()] { return tls->Status(); };
  hooks.scrub_status = [scrub = scrubber_.get()](v1::StatusResponse& r) { ScrubStatus(*scrub, r); };
  if (peers_ != nullptr) {
    PeerServer* peers = peers_.get();
    hooks.peer_sessions = [peers] { return peers->service()->Sessions(); };
    hooks.bytes_sent = [peers] { return peers->service()->bytes_sent(); };
    hooks.relay = [peers] { return peers->RelayStatus(); };
  }
  SubscriberControlOptions co;
  co.name = name_;
  co.self_consumer = kSelfConsumer;
  co.start_time = start_time_;
  co.export_dir = c.files().export_dir();
  co.export_mode = config::FileModeOr(c.files().export_mode(), 0600);
  co.metrics_address = metrics_.address();
  control_ = std::make_unique<SubscriberControlService>(core_.get(), &board_, std::move(hooks),
                                                        std::move(co));
  metrics_.Serve([control = control_.get()] { return control->GetStatus(); });
}

// The "started" log line and the ready file (once every server is bound).
absl::Status SubscriberDaemonImpl::AnnounceStarted() {
  const v1::SubscriberConfig& c = config_;
  log_->info(
      "subscriber {} started: listen {}, control {}, local {}, store {} slots, serve_peers "
      "{}, upstream {}{}{}",
      name_, servers_.listen.bound_address.empty() ? "-" : servers_.listen.bound_address,
      servers_.control.bound_address.empty() ? "(on listen)" : servers_.control.bound_address,
      servers_.local.bound_address.empty() ? "-" : servers_.local.bound_address, c.store().slots(),
      c.serve_peers(),
      c.upstream().shards_size() > 0
          ? absl::StrCat(c.upstream().shards_size(), " shards of set ", c.upstream().shard_set())
          : absl::StrJoin(c.upstream().addresses(), ","),
      c.upstream().bootstrap_peers().empty()
          ? std::string()
          : absl::StrCat(" (bootstrap peers ", absl::StrJoin(c.upstream().bootstrap_peers(), ","),
                         ")"),
      metrics_.address().empty()
          ? std::string()
          : absl::StrCat(", metrics on http://", metrics_.address(), "/metrics"));
  if (c.ready_file().empty()) return absl::OkStatus();
  return WriteServersReadyFile(c.ready_file(), "subscriber.ready_file", servers_,
                               metrics_.address());
}

absl::Status SubscriberDaemonImpl::Init(const cuda::DeviceOpener& open_device) {
  // Two malloc arenas instead of glibc's 8 per core: the gRPC and staging threads' transient
  // buffers then fall back to the system at each trim instead of staying spread over one arena
  // per thread (about 3% of a 254 MB model's node memory; bench/memory). The subscriber's hot
  // paths allocate per transfer, not per element, so the arenas are not contended.
  mallopt(M_ARENA_MAX, 2);
  SubscriberOptions core_options = CoreOptionsOf(config_);
  REFIT_ASSIGN_OR_RETURN(
      metrics_,
      metrics::DaemonMetrics::Start(v1::ROLE_SUBSCRIBER, "subscriber.metrics", config_.metrics()));
  REFIT_RETURN_IF_ERROR(OpenDevice(open_device));
  if (device_ != nullptr) core_options.make_store = store::DeviceStoreFactory(device_.get());
  // A single-copy store's verified version waits for the consumers: WatchVersions tells them.
  core_options.on_pause_pending = [this](uint64_t version, uint64_t digest) {
    board_.AnnouncePending(version, digest);
  };
  core_ = std::make_unique<SubscriberCore>(core_options);
  REFIT_RETURN_IF_ERROR(MakePeers());
  REFIT_RETURN_IF_ERROR(MakeUpstream());
  MakeServices();
  REFIT_RETURN_IF_ERROR(StartServers(config_));
  if (peers_ != nullptr) peers_->Start();
  for (const auto& up : upstreams_) up->Start();
  scrubber_->Start();
  return AnnounceStarted();
}

std::unique_ptr<Scrubber> SubscriberDaemonImpl::MakeScrubber(const v1::StoreConfig& store) {
  ScrubberOptions o = ScrubberOptionsOf(store);
  o.background_nice = static_cast<int>(config_.background_nice());
  o.consumer = absl::StrCat(kSelfConsumer, "/scrub");
  o.on_mismatch = [this](const ScrubMismatch& m) {
    // False: a newer version came (or shards: repairs are not joined; the tensor's next patch
    // then fails its digest and it comes as a keyframe).
    (void)upstreams_[0]->RequestRepair(m.version, {m.tensor});
  };
  return std::make_unique<Scrubber>(core_.get(), std::move(o));
}

void SubscriberDaemonImpl::OnApplied(const AppliedEvent& ev) {
  // The transfer's buffers (frames, patches, change sets) are freed by now: hand the memory
  // back to the system, so that the node holds the store, not the allocator's free lists (a
  // single-copy store's point; measured by bench/memory).
  malloc_trim(0);
  const v1::RefitStats& s = ev.stats;
  const v1::TransferTimings& t = ev.ack.timings();
  const double wire_pct =
      s.dense_bytes() > 0 ? 100.0 * static_cast<double>(s.wire_bytes()) / s.dense_bytes() : 0.0;
  const std::string text = fmt::format(
      "version {} applied (base {}, {}): change {:.2f}%, wire {} vs dense {} ({:.2f}%), latency "
      "{} (receive {}, stage {}, verify {}, apply {}), cpu {} (receive {}, stage {}, verify {}, "
      "apply {}), {}",
      s.version(), s.base_version(), ReasonName(ev.reason), 100.0 * s.change_rate(),
      FormatBytes(s.wire_bytes()), FormatBytes(s.dense_bytes()), wire_pct,
      FormatMicros(s.latency_micros()), FormatMicros(t.receive_micros()),
      FormatMicros(t.stage_micros()), FormatMicros(t.verify_micros()),
      FormatMicros(t.apply_micros()), FormatMicros(t.total_cpu_micros()),
      FormatMicros(t.receive_cpu_micros()), FormatMicros(t.stage_cpu_micros()),
      FormatMicros(t.verify_cpu_micros()), FormatMicros(t.apply_cpu_micros()),
      s.digests_verified() ? absl::StrCat("digests verified (", ev.tensors, " tensors)")
                           : std::string("digests NOT verified"));
  auto ms = [](uint64_t micros) { return static_cast<double>(micros) / 1000.0; };
  // A single-copy store's in-place write: the pause it took (StageStats of this version).
  const StageStats stage = core_->last_stage();
  const bool in_place = stage.version == s.version() && stage.in_place_update;
  std::vector<LogField> fields = {{"event", std::string("applied")},
                                  {"version", s.version()},
                                  {"base_version", s.base_version()},
                                  {"reason", std::string(ReasonName(ev.reason))},
                                  {"upstream", ev.upstream},
                                  {"change_rate", s.change_rate()},
                                  {"wire_bytes", s.wire_bytes()},
                                  {"dense_bytes", s.dense_bytes()},
                                  {"keyframe_tensors", static_cast<uint64_t>(s.keyframe_tensors())},
                                  {"tensors", static_cast<uint64_t>(ev.tensors)},
                                  {"latency_ms", ms(s.latency_micros())},
                                  {"receive_ms", ms(t.receive_micros())},
                                  {"stage_ms", ms(t.stage_micros())},
                                  {"verify_ms", ms(t.verify_micros())},
                                  {"apply_ms", ms(t.apply_micros())},
                                  {"cpu_ms", ms(t.total_cpu_micros())},
                                  {"receive_cpu_ms", ms(t.receive_cpu_micros())},
                                  {"stage_cpu_ms", ms(t.stage_cpu_micros())},
                                  {"verify_cpu_ms", ms(t.verify_cpu_micros())},
                                  {"apply_cpu_ms", ms(t.apply_cpu_micros())},
                                  {"digests_verified", s.digests_verified()},
                                  {"in_place", in_place}};
  if (in_place) {
    fields.push_back({"pause_wait_ms", ms(stage.pause_wait_micros)});
    fields.push_back({"pause_ms", ms(stage.pause_micros)});
    fields.push_back({"change_set_bytes", stage.change_set_bytes});
    fields.push_back({"changed_elements", stage.changed_elements});
  }
  LogEvent(*log_, spdlog::level::info,
           in_place ? absl::StrCat(text, ", written in place (pause ", ms(stage.pause_micros),
                                   " ms after waiting ", ms(stage.pause_wait_micros), " ms)")
                    : text,
           fields);

  if (metrics::RefitMetrics* m = metrics_.refit(); m != nullptr) {
    const metrics::ApplyStages stages{.receive = absl::Microseconds(t.receive_micros()),
                                      .stage = absl::Microseconds(t.stage_micros()),
                                      .verify = absl::Microseconds(t.verify_micros()),
                                      .apply = absl::Microseconds(t.apply_micros()),
                                      .receive_cpu = absl::Microseconds(t.receive_cpu_micros()),
                                      .stage_cpu = absl::Microseconds(t.stage_cpu_micros()),
                                      .verify_cpu = absl::Microseconds(t.verify_cpu_micros()),
                                      .apply_cpu = absl::Microseconds(t.apply_cpu_micros())};
    m->TransferApplied(ev.reason, s, &stages);
    if (in_place) {
      m->InPlaceUpdate(absl::Microseconds(stage.pause_wait_micros),
                       absl::Microseconds(stage.pause_micros));
    }
  }

  AppliedVersion applied;
  applied.version = s.version();
  applied.version_digest = ev.ack.applied_version_digest();
  applied.applied_unix_nanos =
      s.finished_unix_nanos() != 0 ? s.finished_unix_nanos() : NowUnixNanos();
  applied.generation = core_->generations().generation();
  applied.layout_changed = ev.layout_changed;
  board_.Announce(applied);

  if (peers_ != nullptr) peers_->OnApplied();
}

v1::RefitStats SubscriberDaemonImpl::LastRefit() const {
  return shards_ != nullptr ? shards_->last_refit() : upstreams_[0]->last_refit();
}

uint64_t SubscriberDaemonImpl::BytesReceived() const {
  uint64_t sum = 0;
  for (const auto& up : upstreams_) sum += up->bytes_received();
  return sum;
}

v1::ShardsStatus SubscriberDaemonImpl::ShardsStatusOf() const {
  const ShardJoinStatus s = shards_->Status();
  v1::ShardsStatus out;
  out.set_set(s.set);
  out.set_count(shards_->count());
  out.set_joined_versions(s.joined_versions);
  out.set_failed_transfers(s.failed_transfers);
  out.set_superseded(s.superseded);
  out.set_waiting_version(s.waiting_version);
  for (uint32_t k : s.waiting_for) out.add_waiting_for(k);
  for (const ShardState& st : s.shards) {
    v1::ShardStatus* o = out.add_shards();
    o->set_index(st.index);
    *o->mutable_session() = upstreams_[st.index]->Status();
    o->set_offered_version(st.offered_version);
    o->set_joined(st.joined);
    o->set_lineage(st.lineage);
    o->set_tensors(st.tensors);
    o->set_bytes(st.bytes);
    o->set_wire_bytes(st.wire_bytes);
    o->set_last_error(st.last_error);
  }
  return out;
}

void SubscriberDaemonImpl::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  metrics_.Stop();  // no scrape reads the services below while they stop
  board_.Close();  // ends WatchVersions streams and WaitVersion calls
  if (scrubber_ != nullptr) scrubber_->Stop();
  for (const auto& up : upstreams_) up->Stop();
  if (peers_ != nullptr) peers_->Stop();
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(1);
  servers_.Shutdown(deadline);
  servers_.Wait();
  log_->info("subscriber {} stopped at version {}", name_,
             core_ != nullptr ? core_->applied_version() : 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SubscriberDaemon>> SubscriberDaemon::Start(
    const v1::SubscriberConfig& config, const cuda::DeviceOpener& open_device) {
  auto daemon = std::make_unique<SubscriberDaemonImpl>(config);
  if (absl::Status st = daemon->Init(open_device); !st.ok()) {
    daemon->Shutdown();
    return st;
  }
  return std::unique_ptr<SubscriberDaemon>(std::move(daemon));
}

}  // namespace refit::subscriber
