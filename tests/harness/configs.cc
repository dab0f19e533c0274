#include "tests/harness/configs.h"

#include <unistd.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace refit::e2e {
namespace {

std::string Q(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  out.push_back('"');
  return out;
}

std::string ServerTlsYaml(const char* key, const ServerTlsSpec& tls) {
  if (tls.cert.empty() && tls.key.empty() && tls.ca.empty()) return "";
  std::string y = absl::StrCat("  ", key, ":\n");
  if (!tls.cert.empty()) absl::StrAppend(&y, "    cert: ", Q(tls.cert), "\n");
  if (!tls.key.empty()) absl::StrAppend(&y, "    key: ", Q(tls.key), "\n");
  if (!tls.ca.empty()) absl::StrAppend(&y, "    ca: ", Q(tls.ca), "\n");
  if (!tls.allowed_identities.empty()) {
    absl::StrAppend(&y, "    allowed_identities: [");
    for (size_t i = 0; i < tls.allowed_identities.size(); ++i) {
      absl::StrAppend(&y, i ? ", " : "", Q(tls.allowed_identities[i]));
    }
    absl::StrAppend(&y, "]\n");
  }
  if (tls.reload_interval_ms.has_value()) {
    absl::StrAppend(&y, "    reload_interval_ms: ", *tls.reload_interval_ms, "\n");
  }
  return y;
}

// The `files:` block: publish_dirs (publisher only) and export_dir / export_mode.
std::string FilesYaml(const std::string& dir, const std::vector<std::string>* publish_dirs,
                      const std::optional<std::string>& export_dir,
                      const std::optional<uint32_t>& export_mode) {
  std::string y = "  files:\n";
  if (publish_dirs != nullptr) {
    absl::StrAppend(&y, "    publish_dirs: [");
    for (size_t i = 0; i < publish_dirs->size(); ++i) {
      absl::StrAppend(&y, i ? ", " : "", Q((*publish_dirs)[i]));
    }
    absl::StrAppend(&y, "]\n");
  }
  absl::StrAppend(&y, "    export_dir: ", Q(export_dir.value_or(DefaultExportDir(dir))), "\n");
  if (export_mode) absl::StrAppend(&y, "    export_mode: \"", absl::StrFormat("%04o", *export_mode), "\"\n");
  return y;
}

}  // namespace

std::string DefaultExportDir(const std::string& dir) { return absl::StrCat(dir, "/export"); }

std::string UniqueShmPrefix(const std::string& name) {
  static std::atomic<int> counter{0};
  return absl::StrCat("/refit-e2e-", getpid(), "-", counter.fetch_add(1), "-", name, "-");
}

std::string PublisherYaml(const PublisherSpec& s, const std::string& dir,
                          const std::string& ready_file) {
  std::string y = "publisher:\n";
  absl::StrAppend(&y, "  name: ", Q(s.name), "\n");
  absl::StrAppend(&y, "  log_level: ", s.log_level, "\n");
  absl::StrAppend(&y, "  listen: ", Q(s.listen), "\n");
  absl::StrAppend(&y, ServerTlsYaml("tls", s.tls));
  if (!s.control_listen.empty()) absl::StrAppend(&y, "  control_listen: ", Q(s.control_listen), "\n");
  if (s.local_socket) {
    absl::StrAppend(&y, "  local_socket: ", Q(absl::StrCat(dir, "/", s.name, "-local.sock")), "\n");
  }
  absl::StrAppend(&y, "  ready_file: ", Q(ready_file), "\n");
  if (s.frame_bytes != 0 || s.max_streams != 0) {
    absl::StrAppend(&y, "  transport:\n");
    if (s.frame_bytes != 0) absl::StrAppend(&y, "    frame_bytes: ", s.frame_bytes, "\n");
    if (s.max_streams != 0) absl::StrAppend(&y, "    max_streams_per_subscriber: ", s.max_streams, "\n");
  }
  if (s.history_budget_bytes || s.history_max_versions) {
    absl::StrAppend(&y, "  history:\n");
    if (s.history_budget_bytes) {
      absl::StrAppend(&y, "    memory_budget_bytes: ", *s.history_budget_bytes, "\n");
    }
    if (s.history_max_versions) absl::StrAppend(&y, "    max_versions: ", *s.history_max_versions, "\n");
  }
  if (!s.persist_dir.empty()) {
    absl::StrAppend(&y, "  baseline:\n    persist_dir: ", Q(s.persist_dir), "\n    fsync: false\n");
  }
  if (!s.control_access.empty()) absl::StrAppend(&y, "  control_access: ", s.control_access, "\n");
  absl::StrAppend(&y, "  codec:\n    device: ", s.codec_device, "\n    threads: ", s.codec_threads,
                  "\n");
  const std::vector<std::string> publish_dirs = s.publish_dirs.value_or(std::vector{dir});
  absl::StrAppend(&y, s.extra);  // may continue the codec block: files after it
  absl::StrAppend(&y, FilesYaml(dir, &publish_dirs, s.export_dir, s.export_mode));
  return y;
}

std::string SubscriberYaml(const SubscriberSpec& s, const std::string& dir,
                           const std::string& ready_file) {
  std::string y = "subscriber:\n";
  absl::StrAppend(&y, "  name: ", Q(s.name), "\n");
  absl::StrAppend(&y, "  log_level: ", s.log_level, "\n");
  absl::StrAppend(&y, "  upstream:\n");
  auto list = [](const std::vector<std::string>& addresses) {
    std::string out = "[";
    for (size_t i = 0; i < addresses.size(); ++i) absl::StrAppend(&out, i ? ", " : "", Q(addresses[i]));
    return out + "]";
  };
  if (s.shards.empty()) {
    absl::StrAppend(&y, "    addresses: ", list(s.upstream), "\n");
  } else {
    absl::StrAppend(&y, "    shard_set: ", Q(s.shard_set), "\n    shards:\n");
    for (const auto& shard : s.shards) absl::StrAppend(&y, "    - addresses: ", list(shard), "\n");
  }
  if (!s.bootstrap_peers.empty()) {
    absl::StrAppend(&y, "    bootstrap_peers: ", list(s.bootstrap_peers), "\n");
  }
  if (!s.tensors.empty()) absl::StrAppend(&y, "    tensors: ", list(s.tensors), "\n");
  if (s.slice_ranks > 0) {
    absl::StrAppend(&y, "    slice: {rank: ", s.slice_rank, ", ranks: ", s.slice_ranks, "}\n");
  }
  const ClientTlsSpec& t = s.tls;
  if (!t.cert.empty() || !t.key.empty() || !t.ca.empty() || !t.server_name.empty()) {
    absl::StrAppend(&y, "    tls:\n");
    if (!t.cert.empty()) absl::StrAppend(&y, "      cert: ", Q(t.cert), "\n");
    if (!t.key.empty()) absl::StrAppend(&y, "      key: ", Q(t.key), "\n");
    if (!t.ca.empty()) absl::StrAppend(&y, "      ca: ", Q(t.ca), "\n");
    if (!t.server_name.empty()) absl::StrAppend(&y, "      server_name: ", Q(t.server_name), "\n");
    if (t.reload_interval_ms.has_value()) {
      absl::StrAppend(&y, "      reload_interval_ms: ", *t.reload_interval_ms, "\n");
    }
  }
  absl::StrAppend(&y, "    connections: ", s.connections, "\n");
  if (!s.streamed_transfers) absl::StrAppend(&y, "    streamed_transfers: false\n");
  if (s.connect_timeout_ms != 0) {
    absl::StrAppend(&y, "    connect_timeout_ms: ", s.connect_timeout_ms, "\n");
  }
  absl::StrAppend(&y, "    backoff:\n      initial_ms: ", s.backoff_initial_ms,
                  "\n      max_ms: ", s.backoff_max_ms, "\n");
  if (!s.listen.empty()) absl::StrAppend(&y, "  listen: ", Q(s.listen), "\n");
  if (s.serve_peers) absl::StrAppend(&y, "  serve_peers: true\n");
  if (!s.control_listen.empty()) absl::StrAppend(&y, "  control_listen: ", Q(s.control_listen), "\n");
  if (s.local_socket) {
    absl::StrAppend(&y, "  local_socket: ", Q(absl::StrCat(dir, "/", s.name, "-local.sock")), "\n");
  }
  absl::StrAppend(&y, "  ready_file: ", Q(ready_file), "\n");
  absl::StrAppend(&y, "  store:\n    kind: ", s.store_kind, "\n    shm_prefix: ",
                  Q(UniqueShmPrefix(s.name)),
                  "\n    slots: ", s.slots, "\n", s.store_extra);
  if (!s.digest_v2) absl::StrAppend(&y, "    digest_v2: false\n");
  absl::StrAppend(&y, "  staging:\n    threads: ", s.staging_threads, "\n");
  if (!s.control_access.empty()) absl::StrAppend(&y, "  control_access: ", s.control_access, "\n");
  if (s.lease_default_ttl_ms != 0) {
    absl::StrAppend(&y, "  leases:\n    default_ttl_ms: ", s.lease_default_ttl_ms, "\n");
  }
  absl::StrAppend(&y, s.extra);
  absl::StrAppend(&y, FilesYaml(dir, nullptr, s.export_dir, s.export_mode));
  return y;
}

}  // namespace refit::e2e
