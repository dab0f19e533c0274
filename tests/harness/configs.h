// Config files (YAML, proto/refit/v1/config.proto) for daemons started by the e2e tests: every
// address is 127.0.0.1:0 or a unix socket in the test's directory, the ready file is the
// DaemonProcess's, shm prefixes are unique per process and daemon name.
#ifndef REFIT_TESTS_HARNESS_CONFIGS_H_
#define REFIT_TESTS_HARNESS_CONFIGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace refit::e2e {

struct ServerTlsSpec {
  std::string cert, key, ca;
  std::vector<std::string> allowed_identities;
  std::optional<uint32_t> reload_interval_ms = std::nullopt;  // absent = the default
};

struct ClientTlsSpec {
  std::string cert, key, ca, server_name;
  std::optional<uint32_t> reload_interval_ms = std::nullopt;
};

struct PublisherSpec {
  std::string name = "pub";
  std::string listen = "127.0.0.1:0";
  std::string control_listen;  // "" = Control on listen
  bool local_socket = false;   // TrainerApi on <dir>/<name>-local.sock
  ServerTlsSpec tls;
  std::optional<uint64_t> history_budget_bytes;
  std::optional<uint32_t> history_max_versions;
  std::string persist_dir;       // baseline.persist_dir ("" = none)
  uint32_t frame_bytes = 0;      // 0 = default
  uint32_t max_streams = 0;      // transport.max_streams_per_subscriber, 0 = default
  uint32_t codec_threads = 2;
  std::string codec_device = "cpu";  // codec.device: cpu | cuda | auto
  std::string log_level = "info";
  // control_access as a YAML flow mapping ("" = none: the daemon's defaults). Tests drive
  // Control over loopback TCP, which needs an explicit grant.
  std::string control_access = "{unauthenticated_tcp_role: write}";
  // files.publish_dirs: nullopt = {the test directory}; files.export_dir: nullopt =
  // <dir>/export (E2ETest creates it and exports there), "" = export disabled.
  std::optional<std::vector<std::string>> publish_dirs;
  std::optional<std::string> export_dir;
  std::optional<uint32_t> export_mode;  // files.export_mode (e.g. 0640), nullopt = default
  std::string extra;  // YAML lines appended under `publisher:` (indented by the caller)
};

struct SubscriberSpec {
  std::string name = "sub";
  std::vector<std::string> upstream;  // addresses
  // upstream.shards (each shard's addresses, in index order) and shard_set, instead of
  // `upstream` when not empty.
  std::vector<std::vector<std::string>> shards;
  std::string shard_set;
  bool streamed_transfers = true;     // upstream.streamed_transfers (written only when false)
  std::vector<std::string> bootstrap_peers;
  std::vector<std::string> tensors;  // upstream.tensors (names and globs; empty = every tensor)
  uint32_t slice_rank = 0;           // upstream.slice (written when slice_ranks > 0)
  uint32_t slice_ranks = 0;
  bool serve_peers = false;
  uint32_t connections = 2;
  uint32_t backoff_initial_ms = 20;
  uint32_t backoff_max_ms = 300;
  uint32_t connect_timeout_ms = 0;  // 0 = default
  std::string listen = "127.0.0.1:0";
  std::string control_listen;
  bool local_socket = true;  // ConsumerApi on <dir>/<name>-local.sock
  uint32_t slots = 2;
  std::string store_kind = "shm";  // store.kind: shm | cuda
  std::string store_extra;  // more store fields, each line "    key: value\n"
  bool digest_v2 = true;    // store.digest_v2 (false: ask the upstream for v1)
  ClientTlsSpec tls;
  uint32_t staging_threads = 2;
  uint32_t lease_default_ttl_ms = 0;  // 0 = default
  std::string log_level = "info";
  std::string control_access = "{unauthenticated_tcp_role: write}";  // as in PublisherSpec
  // files.export_dir / export_mode, as in PublisherSpec.
  std::optional<std::string> export_dir;
  std::optional<uint32_t> export_mode;
  std::string extra;
};

// The export directory of a test directory: <dir>/export.
std::string DefaultExportDir(const std::string& dir);

// `dir`: the test directory; `ready_file`: the DaemonProcess's ready_path().
std::string PublisherYaml(const PublisherSpec& spec, const std::string& dir,
                          const std::string& ready_file);
std::string SubscriberYaml(const SubscriberSpec& spec, const std::string& dir,
                           const std::string& ready_file);

// "/refit-e2e-<pid>-<n>-<name>-": unique per call within this process and across processes.
std::string UniqueShmPrefix(const std::string& name);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_CONFIGS_H_
