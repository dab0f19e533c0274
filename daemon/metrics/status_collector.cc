#include "daemon/metrics/status_collector.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "daemon/common/unix_time.h"

namespace refit::metrics {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

double Nanos(uint64_t ns) { return static_cast<double>(ns) / 1e9; }
double D(uint64_t v) { return static_cast<double>(v); }

// "SESSION_STATE_TRANSFERRING" -> "transferring".
std::string EnumLabel(const std::string& name, absl::string_view prefix) {
  absl::string_view n = name;
  if (absl::StartsWith(n, prefix)) n.remove_prefix(prefix.size());
  return absl::AsciiStrToLower(n);
}

// Families in the order first added; samples appended.
class Families {
 public:
  void Gauge(const std::string& name, const std::string& help, double value, Labels labels = {}) {
    ClientMetric& m = Add(name, help, MetricType::Gauge, std::move(labels));
    m.gauge.value = value;
  }
  void Counter(const std::string& name, const std::string& help, double value,
               Labels labels = {}) {
    ClientMetric& m = Add(name, help, MetricType::Counter, std::move(labels));
    m.counter.value = value;
  }
  // A family that may have no sample (declared, so dashboards and rules find its name).
  void Declare(const std::string& name, const std::string& help, MetricType type) {
    if (index_.try_emplace(name, out_.size()).second) {
      out_.push_back(MetricFamily{name, help, type, {}});
    }
  }
  std::vector<MetricFamily> Take() { return std::move(out_); }

 private:
  ClientMetric& Add(const std::string& name, const std::string& help, MetricType type,
                    Labels labels) {
    auto [it, inserted] = index_.try_emplace(name, out_.size());
    if (inserted) out_.push_back(MetricFamily{name, help, type, {}});
    MetricFamily& f = out_[it->second];
    f.metric.emplace_back();
    f.metric.back().label = std::move(labels);
    return f.metric.back();
  }

  std::vector<MetricFamily> out_;
  absl::flat_hash_map<std::string, size_t> index_;
};

void Common(const v1::StatusResponse& s, Families& f) {
  const std::string role = s.role() == v1::ROLE_PUBLISHER ? "publisher" : "subscriber";
  f.Gauge("refitd_build_info", "Always 1: the build version, role and config name of the daemon.",
          1, {{"name", s.name()}, {"role", role}, {"version", s.build_version()}});
  f.Gauge("refitd_uptime_seconds", "Seconds since the daemon started.",
          static_cast<double>(s.uptime_ms()) / 1e3);
  f.Gauge("refitd_current_version",
          "Publisher: newest published version. Subscriber: version applied in the store.",
          D(s.version()));
  f.Gauge("refitd_model_tensors", "Tensors of the current version.", D(s.tensors()));
  f.Gauge("refitd_model_bytes", "Bytes of the current version's tensors.", D(s.model_bytes()));
  f.Counter("refitd_data_plane_sent_bytes_total",
            "Payload bytes sent on the data plane since start.", D(s.bytes_sent()));
  f.Counter("refitd_data_plane_received_bytes_total",
            "Payload bytes received on the data plane since start.", D(s.bytes_received()));
  const v1::RefitStats& r = s.last_refit();
  f.Gauge("refitd_last_refit_version", "Version of the last refit (0 = none yet).",
          D(r.version()));
  f.Gauge("refitd_last_refit_change_ratio",
          "Changed elements over all elements in the last refit (the change rate).",
          r.change_rate());
  f.Gauge("refitd_last_refit_wire_bytes", "Payload bytes on the wire of the last refit.",
          D(r.wire_bytes()));
  f.Gauge("refitd_last_refit_dense_bytes", "Dense size of the last refit's version.",
          D(r.dense_bytes()));
  f.Gauge("refitd_last_refit_keyframe_tensors", "Tensors that went as keyframes in the last refit.",
          D(r.keyframe_tensors()));
  f.Gauge("refitd_last_refit_duration_seconds",
          "Latency of the last refit (publisher: snapshot -> every subscriber acked; subscriber: "
          "VersionHeader -> announced).",
          static_cast<double>(r.latency_micros()) / 1e6);
  f.Gauge("refitd_last_refit_timestamp_seconds", "When the last refit finished (Unix time).",
          Nanos(r.finished_unix_nanos()));
}

// Publisher: its subscribers; subscriber: the peers it serves.
void Sessions(const v1::StatusResponse& s, size_t cap, Families& f) {
  absl::flat_hash_map<int, int> by_state;
  for (const v1::SessionStatus& x : s.sessions()) ++by_state[x.state()];
  for (int st : {v1::SESSION_STATE_CONNECTING, v1::SESSION_STATE_IDLE,
                 v1::SESSION_STATE_TRANSFERRING, v1::SESSION_STATE_BACKOFF}) {
    f.Gauge("refitd_sessions",
            "Data-plane sessions by state (publisher: subscribers; subscriber: peers served).",
            by_state[st],
            {{"state", EnumLabel(v1::SessionState_Name(st), "SESSION_STATE_")}});
  }
  std::vector<const v1::SessionStatus*> order;
  for (const v1::SessionStatus& x : s.sessions()) order.push_back(&x);
  std::sort(order.begin(), order.end(), [](const v1::SessionStatus* a, const v1::SessionStatus* b) {
    if (a->lag_versions() != b->lag_versions()) return a->lag_versions() > b->lag_versions();
    return a->name() < b->name();
  });
  absl::flat_hash_map<std::string, int> seen;  // a name twice: "name#2"
  uint64_t other_lag = 0, other_sent = 0, other_received = 0;
  size_t other = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const v1::SessionStatus& x = *order[i];
    if (i >= cap) {
      ++other;
      other_lag = std::max(other_lag, x.lag_versions());
      other_sent += x.bytes_sent();
      other_received += x.bytes_received();
      continue;
    }
    const int n = ++seen[x.name()];
    const std::string label = n == 1 ? x.name() : absl::StrCat(x.name(), "#", n);
    f.Gauge("refitd_session_lag_versions",
            "Versions a session's subscriber is behind the publisher's newest (top sessions by "
            "lag; session=\"_other\": the maximum of the rest).",
            D(x.lag_versions()), {{"session", label}});
    f.Gauge("refitd_session_acked_version", "Version a session's subscriber holds.",
            D(x.acked_version()), {{"session", label}});
    f.Gauge("refitd_session_sent_bytes",
            "Payload bytes sent on a session since it connected (session=\"_other\": the sum "
            "of the sessions beyond the cap).",
            D(x.bytes_sent()), {{"session", label}});
    f.Gauge("refitd_session_received_bytes", "Payload bytes received on a session since it "
            "connected.", D(x.bytes_received()), {{"session", label}});
  }
  if (other > 0) {
    f.Gauge("refitd_session_lag_versions", "", D(other_lag), {{"session", kOtherSessions}});
    f.Gauge("refitd_session_sent_bytes", "", D(other_sent), {{"session", kOtherSessions}});
    f.Gauge("refitd_session_received_bytes", "", D(other_received),
            {{"session", kOtherSessions}});
  }
  f.Gauge("refitd_session_series_aggregated",
          "Sessions beyond metrics.max_session_series, folded into session=\"_other\".",
          D(other));
}

void Publisher(const v1::StatusResponse& s, Families& f) {
  const v1::HistoryStatus& h = s.history();
  f.Gauge("refitd_publisher_history_versions", "Versions whose patches the history holds.",
          h.versions());
  f.Gauge("refitd_publisher_history_bytes", "Bytes of the history's patches.", D(h.bytes()));
  f.Gauge("refitd_publisher_history_budget_bytes", "The history's byte budget.",
          D(h.budget_bytes()));
  const v1::PublishQueueStatus& q = s.publish_queue();
  f.Gauge("refitd_publisher_publish_queue_pending", "Publishes queued or running.", q.pending());
  f.Gauge("refitd_publisher_publish_queue_max_pending", "The publish queue's limit.",
          q.max_pending());
  f.Counter("refitd_publisher_publish_queue_refused_total",
            "Publishes refused because the queue was full.", D(q.refused_full()));
  f.Counter("refitd_publisher_publish_queue_dropped_total",
            "Queued publishes dropped (deadline passed or client gone before they started).",
            D(q.dropped_expired()));
  const v1::BaselineStatus& b = s.baseline();
  for (int st = v1::BASELINE_STATE_DISABLED; st <= v1::BASELINE_STATE_MOVED_ASIDE; ++st) {
    f.Gauge("refitd_publisher_baseline_state",
            "1 for the persisted baseline's state (persist_failed: the last persist failed).",
            b.state() == st ? 1 : 0,
            {{"state", EnumLabel(v1::BaselineState_Name(st), "BASELINE_STATE_")}});
  }
  f.Gauge("refitd_publisher_baseline_persisted_version",
          "Newest version the persist dir holds (what a restart loads).",
          D(b.persisted_version()));
  f.Gauge("refitd_publisher_baseline_log_bytes", "Bytes of patches.log after the baseline.",
          D(b.log_bytes()));
  f.Gauge("refitd_publisher_baseline_last_persist_error_timestamp_seconds",
          "When the last persist failed (Unix time; 0 = the last persist succeeded).",
          b.last_persist_error().empty() ? 0.0 : Nanos(b.last_persist_error_unix_nanos()));
  f.Gauge("refitd_publisher_patch_format", "Patch format of the last published version.",
          s.patch_format().last());
}

void Subscriber(const v1::StatusResponse& s, Families& f) {
  const v1::SessionStatus& up = s.upstream();
  for (int st : {v1::SESSION_STATE_CONNECTING, v1::SESSION_STATE_IDLE,
                 v1::SESSION_STATE_TRANSFERRING, v1::SESSION_STATE_BACKOFF}) {
    f.Gauge("refitd_subscriber_upstream_state", "1 for the upstream session's state.",
            up.state() == st ? 1 : 0,
            {{"state", EnumLabel(v1::SessionState_Name(st), "SESSION_STATE_")}});
  }
  f.Gauge("refitd_subscriber_upstream_received_bytes",
          "Payload bytes received on the upstream session since it connected.",
          D(up.bytes_received()));
  f.Gauge("refitd_subscriber_leases", "Read leases held by local consumers.", s.leases_size());
  const uint64_t blocked_since = s.blocked_on_leases().since_unix_nanos();
  const uint64_t now = NowUnixNanos();
  f.Gauge("refitd_subscriber_blocked_on_leases_seconds",
          "How long a received version has waited for a slot that leases hold (0 = none).",
          blocked_since == 0 || blocked_since > now ? 0.0 : Nanos(now - blocked_since));
  f.Counter("refitd_subscriber_scrub_passes_total",
            "Scrub passes completed over the committed version.", D(s.scrub_passes()));
  f.Counter("refitd_subscriber_scrub_mismatches_total",
            "Tensors whose bytes no longer matched their verified digest (each healed by a "
            "keyframe).",
            D(s.scrub_mismatches()));
  const v1::RelayStatus& r = s.relay();
  f.Counter("refitd_subscriber_relay_transfers_total",
            "Upstream transfers relayed to peers (serve_peers).", D(r.transfers()));
  f.Counter("refitd_subscriber_relay_failed_total", "Relayed transfers that failed.",
            D(r.failed()));
  const v1::ShardsStatus& sh = s.shards();
  f.Counter("refitd_subscriber_shard_joined_versions_total",
            "Sharded versions joined and committed (upstream.shards).", D(sh.joined_versions()));
  f.Counter("refitd_subscriber_shard_failed_transfers_total", "Joined transfers that failed.",
            D(sh.failed_transfers()));
}

// Per TLS block of the config (a handful: listen, control, upstream).
// No series without TLS, but the families are always there.
void Tls(const v1::StatusResponse& s, Families& f) {
  constexpr char kExpiry[] = "refitd_tls_certificate_expiry_timestamp_seconds";
  constexpr char kExpiryHelp[] =
      "End of validity of the certificate a TLS block serves (Unix time).";
  constexpr char kReloads[] = "refitd_tls_reloads_total";
  constexpr char kReloadsHelp[] = "Times new TLS material replaced the loaded one.";
  constexpr char kError[] = "refitd_tls_reload_error";
  constexpr char kErrorHelp[] = "1 while the TLS files hold material that was refused.";
  f.Declare(kExpiry, kExpiryHelp, MetricType::Gauge);
  f.Declare(kReloads, kReloadsHelp, MetricType::Counter);
  f.Declare(kError, kErrorHelp, MetricType::Gauge);
  for (const v1::TlsMaterialStatus& t : s.tls()) {
    Labels field = {{"field", t.field()}};
    f.Gauge(kExpiry, kExpiryHelp, static_cast<double>(t.not_after_unix_seconds()), field);
    f.Counter(kReloads, kReloadsHelp, t.reloads(), field);
    f.Gauge(kError, kErrorHelp, t.last_reload_error().empty() ? 0 : 1, field);
  }
}

}  // namespace

std::vector<MetricFamily> StatusFamilies(const v1::StatusResponse& status,
                                         size_t max_session_series) {
  Families f;
  Common(status, f);
  Sessions(status, max_session_series, f);
  if (status.role() == v1::ROLE_PUBLISHER) {
    Publisher(status, f);
  } else {
    Subscriber(status, f);
  }
  Tls(status, f);
  return f.Take();
}

StatusCollector::StatusCollector(std::function<v1::StatusResponse()> status,
                                 size_t max_session_series)
    : status_(std::move(status)), max_session_series_(max_session_series) {}

std::vector<MetricFamily> StatusCollector::Collect() const {
  return StatusFamilies(status_(), max_session_series_);
}

}  // namespace refit::metrics
