#include "daemon/config/config.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/safe_file.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/utf8.h"
#include "daemon/config/address.h"
#include "daemon/config/tls_material.h"

namespace refit::config {
namespace {

// Builds one-line errors "<file>:<line>:<col>: <path>: <problem>".
class Checker {
 public:
  explicit Checker(const SourceMap* map) : map_(map) {}

  absl::Status Fail(const std::string& path, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(map_ != nullptr ? map_->Prefix(path) : "",
                                                   OneLine(absl::StrCat(path, ": ", what))));
  }
  // The field was written in the source (not a default filled in by the loader); false without
  // a source map.
  bool Given(const std::string& path) const { return map_ != nullptr && map_->Find(path) != nullptr; }

 private:
  const SourceMap* map_;
};

// Why a non-loopback address that looks local is not (appended to "is not a loopback address").
std::string NotLoopbackWhy(const Address& a) {
  return a.kind == AddressKind::kUnixAbstract
             ? " (abstract unix sockets have no file permissions: anyone in the network "
               "namespace can connect)"
             : "";
}

bool Configured(const v1::ServerTls& tls) {
  return !tls.cert().empty() || !tls.key().empty() || !tls.ca().empty() ||
         tls.allowed_identities_size() > 0 || tls.insecure();
}

// Validates a listener address and its TLS block; returns the parsed address.
// Sorts the names of a TLS block's cert, key and ca into those set and those missing.
void SplitTlsFiles(const std::string& cert, const std::string& key, const std::string& ca,
                   std::vector<std::string>& present, std::vector<std::string>& missing) {
  for (const auto& [name, value] :
       {std::pair<const char*, const std::string*>{"cert", &cert}, {"key", &key}, {"ca", &ca}}) {
    (value->empty() ? missing : present).push_back(name);
  }
}

absl::StatusOr<Address> CheckListener(const Checker& c, const std::string& addr_path,
                                      const std::string& addr_text, const std::string& tls_path,
                                      const v1::ServerTls& tls) {
  auto addr = ParseAddress(addr_text, AddressUse::kListen);
  if (!addr.ok())
    return c.Fail(addr_path, absl::StrCat(Quoted(addr_text), ": ", addr.status().message()));
  const bool any_file = !tls.cert().empty() || !tls.key().empty() || !tls.ca().empty();
  if (tls.insecure()) {
    if (any_file || tls.allowed_identities_size() > 0) {
      return c.Fail(absl::StrCat(tls_path, ".insecure"),
                    "true cannot be combined with cert, key, ca or allowed_identities: choose TLS "
                    "or plaintext");
    }
    return addr;
  }
  if (any_file) {
    std::vector<std::string> present, missing;
    SplitTlsFiles(tls.cert(), tls.key(), tls.ca(), present, missing);
    if (!missing.empty()) {
      return c.Fail(absl::StrCat(tls_path, ".", missing[0]),
                    absl::StrCat("required together with ", absl::StrJoin(present, " and "),
                                 " (TLS listeners are mTLS: cert, key and ca go together)"));
    }
  } else {
    if (tls.allowed_identities_size() > 0) {
      return c.Fail(absl::StrCat(tls_path, ".allowed_identities"),
                    "needs TLS: set cert, key and ca too");
    }
    if (!addr->loopback) {
      return c.Fail(addr_path, absl::StrCat(Quoted(addr_text), " is not a loopback address",
                                            NotLoopbackWhy(*addr), ", so ", tls_path,
                                            " needs cert, key and ca (mTLS), or set ", tls_path,
                                            ".insecure: true explicitly"));
    }
  }
  for (int i = 0; i < tls.allowed_identities_size(); ++i) {
    if (tls.allowed_identities(i).empty()) {
      return c.Fail(absl::StrCat(tls_path, ".allowed_identities[", i, "]"), "must not be empty");
    }
  }
  return addr;
}

// A TLS block whose address is not set must be empty.
absl::Status CheckUnusedTls(const Checker& c, const std::string& tls_path, const v1::ServerTls& tls,
                            const std::string& why) {
  if (Configured(tls)) return c.Fail(tls_path, absl::StrCat("is set, but ", why));
  return absl::OkStatus();
}

absl::Status CheckLocalSocket(const Checker& c, const std::string& path,
                              const std::string& socket) {
  if (socket.empty()) return absl::OkStatus();
  if (absl::StartsWith(socket, "unix:")) {
    return c.Fail(path, absl::StrCat(Quoted(socket),
                                     ": give a filesystem path, not a gRPC address (drop "
                                     "\"unix:\")"));
  }
  if (socket[0] != '/') {
    return c.Fail(path, absl::StrCat(Quoted(socket),
                                     " is relative: give an absolute path; a relative one "
                                     "depends on the daemon's working directory"));
  }
  if (socket.size() > kMaxUnixPathBytes) {
    return c.Fail(path, absl::StrCat("unix socket path is ", socket.size(), " bytes; the limit is ",
                                     kMaxUnixPathBytes));
  }
  return absl::OkStatus();
}

// Two endpoints of one daemon must not collide.
struct Endpoint {
  std::string path;  // field path
  std::string key;   // "tcp:host:port" or "unix:/path"; "" = none or port 0
};

Endpoint EndpointOf(const std::string& path, const Address& a) {
  switch (a.kind) {
    case AddressKind::kTcp:
      return {path, a.port == 0 ? "" : absl::StrCat("tcp:", a.host, ":", a.port)};
    case AddressKind::kUnix: return {path, absl::StrCat("unix:", a.path)};
    case AddressKind::kUnixAbstract: return {path, absl::StrCat("abstract:", a.path)};
  }
  return {path, ""};
}

absl::Status CheckDistinct(const Checker& c, const std::vector<Endpoint>& endpoints) {
  for (size_t i = 0; i < endpoints.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (!endpoints[i].key.empty() && endpoints[i].key == endpoints[j].key) {
        return c.Fail(endpoints[i].path,
                      absl::StrCat("uses the same address as ", endpoints[j].path));
      }
    }
  }
  return absl::OkStatus();
}

// The control listener (or, when it is empty, the absence of its TLS block) and the local API
// socket of a daemon section, then that no two of the section's endpoints coincide.
absl::Status CheckControlAndLocal(const Checker& c, const std::string& role,
                                  const std::string& control_listen,
                                  const v1::ServerTls& control_tls,
                                  const std::string& local_socket,
                                  std::vector<Endpoint>& endpoints) {
  if (!control_listen.empty()) {
    REFIT_ASSIGN_OR_RETURN(const Address control,
                           CheckListener(c, role + ".control_listen", control_listen,
                                         role + ".control_tls", control_tls));
    endpoints.push_back(EndpointOf(role + ".control_listen", control));
  } else {
    REFIT_RETURN_IF_ERROR(
        CheckUnusedTls(c, role + ".control_tls", control_tls,
                       "control_listen is empty (Control is served on listen, with "
                       "tls)"));
  }
  REFIT_RETURN_IF_ERROR(CheckLocalSocket(c, role + ".local_socket", local_socket));
  if (!local_socket.empty()) {
    endpoints.push_back({role + ".local_socket", absl::StrCat("unix:", local_socket)});
  }
  return CheckDistinct(c, endpoints);
}

// The metrics endpoint (MetricsConfig): TCP only, and loopback unless `insecure: true` (the
// endpoint has no TLS); then that it does not collide with the section's other endpoints.
absl::Status CheckMetrics(const Checker& c, const std::string& role,
                          const v1::MetricsConfig& metrics, std::vector<Endpoint>& endpoints) {
  const std::string path = role + ".metrics.listen";
  if (metrics.listen().empty()) {
    if (metrics.insecure()) {
      return c.Fail(role + ".metrics.insecure", "is true, but metrics.listen is empty");
    }
    return absl::OkStatus();
  }
  auto addr = ParseAddress(metrics.listen(), AddressUse::kListen);
  if (!addr.ok()) {
    return c.Fail(path, absl::StrCat(Quoted(metrics.listen()), ": ", addr.status().message()));
  }
  if (addr->kind != AddressKind::kTcp) {
    return c.Fail(path, absl::StrCat(Quoted(metrics.listen()),
                                     ": the metrics endpoint is HTTP over TCP (host:port), not a "
                                     "unix socket"));
  }
  if (!addr->loopback && !metrics.insecure()) {
    return c.Fail(path, absl::StrCat(Quoted(metrics.listen()), " is not a loopback address",
                                     NotLoopbackWhy(*addr),
                                     ", and the metrics endpoint has no "
                                     "TLS: use a loopback address, or set ",
                                     role, ".metrics.insecure: true explicitly"));
  }
  endpoints.push_back(EndpointOf(path, *addr));
  return CheckDistinct(c, endpoints);
}

absl::Status CheckClientTls(const Checker& c, const std::string& tls_path, const v1::ClientTls& tls,
                            const std::vector<std::pair<std::string, std::string>>& addresses) {
  const bool any =
      !tls.cert().empty() || !tls.key().empty() || !tls.ca().empty() || !tls.server_name().empty();
  if (tls.insecure()) {
    if (any) {
      return c.Fail(absl::StrCat(tls_path, ".insecure"),
                    "true cannot be combined with cert, key, ca or server_name: choose TLS or "
                    "plaintext");
    }
    return absl::OkStatus();
  }
  if (any) {
    std::vector<std::string> present, missing;
    SplitTlsFiles(tls.cert(), tls.key(), tls.ca(), present, missing);
    if (!missing.empty()) {
      return c.Fail(absl::StrCat(tls_path, ".", missing[0]),
                    absl::StrCat("required for TLS connections", present.empty() ? "" : " with ",
                                 absl::StrJoin(present, " and "),
                                 " (subscribers present a client certificate: cert, key and ca "
                                 "go together)"));
    }
    return absl::OkStatus();
  }
  for (const auto& [path, text] : addresses) {
    auto addr = ParseAddress(text, AddressUse::kConnect);
    if (addr.ok() && !addr->loopback) {
      return c.Fail(
          path, absl::StrCat(Quoted(text), " is not a loopback address", NotLoopbackWhy(*addr),
                             ", so ", tls_path, " needs cert, key and ca (mTLS), or set ", tls_path,
                             ".insecure: true explicitly"));
    }
  }
  return absl::OkStatus();
}

// The block's files: read, parsed and the key matched to the certificate (tls_material.h).
absl::Status CheckTlsFiles(const std::string& tls_path, const std::string& cert,
                           const std::string& key, const std::string& ca) {
  if (cert.empty() && key.empty() && ca.empty()) return absl::OkStatus();
  return LoadTlsMaterial(TlsFiles{tls_path, cert, key, ca}).status();
}

absl::Status CheckServerTlsFiles(const std::string& tls_path, const v1::ServerTls& tls) {
  return CheckTlsFiles(tls_path, tls.cert(), tls.key(), tls.ca());
}

absl::Status CheckClientTlsFiles(const std::string& tls_path, const v1::ClientTls& tls) {
  return CheckTlsFiles(tls_path, tls.cert(), tls.key(), tls.ca());
}

// Parses `text` into a ConfigFile with defaults filled in the sections present.
absl::StatusOr<v1::ConfigFile> ParseConfigFile(const std::string& text, SourceMap* map) {
  v1::ConfigFile file;
  REFIT_RETURN_IF_ERROR(ParseYamlInto(text, &file, map));
  if (!file.has_publisher() && !file.has_subscriber()) {
    return absl::InvalidArgumentError(
        absl::StrCat(map->source_name(), ": expected a 'publisher:' or 'subscriber:' section"));
  }
  if (file.has_publisher()) REFIT_RETURN_IF_ERROR(ApplyDefaults(file.mutable_publisher()));
  if (file.has_subscriber()) {
    REFIT_RETURN_IF_ERROR(ApplyDefaults(file.mutable_subscriber()));
    // With store.slots 1 the scrub is off unless given (it repairs into a second slot): the
    // loaded config says so, so that the config written out (ConfigToYaml) loads back the same.
    v1::StoreConfig* store = file.mutable_subscriber()->mutable_store();
    if (store->slots() == 1 && !Checker(map).Given("subscriber.store.scrub_bytes_per_second")) {
      store->set_scrub_bytes_per_second(0);
    }
  }
  return file;
}

// A cuda_device_uuid field: not together with cuda_device. (Its syntax, a GPU UUID, is checked
// where the daemon assembles its config: daemon/runtime/daemon_config.h.)
absl::Status CheckGpuUuidNotWithOrdinal(const Checker& c, absl::string_view section,
                                        bool has_ordinal) {
  if (has_ordinal) {
    return c.Fail(absl::StrCat(section, ".cuda_device_uuid"),
                  absl::StrCat("is set together with ", section,
                               ".cuda_device: name the GPU by ordinal or by UUID, not both"));
  }
  return absl::OkStatus();
}

// `name`: printable UTF-8 of at most kMaxNameBytes (it appears in logs, Status and peers' logs).
absl::Status CheckName(const Checker& c, const std::string& path, const std::string& name) {
  if (name.size() > kMaxNameBytes) {
    return c.Fail(path, absl::StrCat("is ", name.size(), " bytes; the limit is ", kMaxNameBytes));
  }
  for (size_t i = 0; i < name.size();) {
    uint32_t cp = 0;
    const size_t n = Utf8CharLength(name, i, &cp);
    if (n == 0) return c.Fail(path, absl::StrCat("is not valid UTF-8 (byte ", i, ")"));
    if (IsControlCodePoint(cp)) {
      return c.Fail(path, absl::StrCat("contains a control character (byte ", i,
                                       "): use printable characters"));
    }
    i += n;
  }
  return absl::OkStatus();
}

// A shard set's name (publisher.shard.set, subscriber.upstream.shard_set): 1 .. 128 bytes of
// [A-Za-z0-9._-].
absl::Status CheckShardSet(const Checker& c, const std::string& path, const std::string& set) {
  if (set.empty() || set.size() > 128) {
    return c.Fail(path, absl::StrCat("is ", set.size(), " bytes; a shard set is named by 1 .. "
                                     "128 letters, digits, '.', '_' or '-'"));
  }
  for (size_t i = 0; i < set.size(); ++i) {
    const char ch = set[i];
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_' &&
        ch != '-') {
      return c.Fail(path, absl::StrCat(Quoted(set), ": byte ", i,
                                       " is not a letter, digit, '.', "
                                       "'_' or '-'"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPublisherShard(const Checker& c, const v1::ShardConfig& shard) {
  if (shard.count() == 0) {
    if (!shard.set().empty() || shard.index() != 0) {
      return c.Fail("publisher.shard.count", "is 0 (not sharded) but shard.set or shard.index "
                                             "is set: give the number of shards");
    }
    return absl::OkStatus();
  }
  REFIT_RETURN_IF_ERROR(CheckShardSet(c, "publisher.shard.set", shard.set()));
  if (shard.index() >= shard.count()) {
    return c.Fail("publisher.shard.index", absl::StrCat(shard.index(), " is not below shard.count (",
                                                        shard.count(), ")"));
  }
  return absl::OkStatus();
}

// publisher.cut: with parts > 0 at least one pattern; every pattern non-empty printable UTF-8
// (CheckName), none twice in one list; no patterns without parts; not with shard.count > 0 (a
// shard publisher's tensors already are parts).
absl::Status CheckPublisherCut(const Checker& c, const v1::CutConfig& cut,
                               const v1::ShardConfig& shard) {
  const int patterns = cut.rows_size() + cut.columns_size();
  if (cut.parts() == 0) {
    if (patterns > 0) {
      return c.Fail("publisher.cut.parts",
                    "is 0 (no cuts) but cut.rows or cut.columns lists "
                    "patterns: give the number of parts");
    }
    return absl::OkStatus();
  }
  if (shard.count() > 0) {
    return c.Fail("publisher.cut.parts",
                  "is set together with publisher.shard.count: a shard "
                  "publisher's tensors are parts already and are not cut");
  }
  if (patterns == 0) {
    return c.Fail("publisher.cut.parts", absl::StrCat("is ", cut.parts(),
                                                      " but cut.rows and cut.columns are empty: "
                                                      "list the tensors to cut"));
  }
  for (const auto& [field, list] :
       {std::pair<std::string, const google::protobuf::RepeatedPtrField<std::string>*>{
            "publisher.cut.rows", &cut.rows()},
        {"publisher.cut.columns", &cut.columns()}}) {
    for (int i = 0; i < list->size(); ++i) {
      const std::string path = absl::StrCat(field, "[", i, "]");
      const std::string& pattern = list->Get(i);
      if (pattern.empty()) return c.Fail(path, "is empty: give a tensor name or glob");
      REFIT_RETURN_IF_ERROR(CheckName(c, path, pattern));
      for (int j = 0; j < i; ++j) {
        if (list->Get(j) == pattern) {
          return c.Fail(path,
                        absl::StrCat(Quoted(pattern), " is listed twice (also at index ", j, ")"));
        }
      }
    }
  }
  for (int i = 0; i < cut.columns_size(); ++i) {
    if (std::find(cut.rows().begin(), cut.rows().end(), cut.columns(i)) != cut.rows().end()) {
      return c.Fail(absl::StrCat("publisher.cut.columns[", i, "]"),
                    absl::StrCat(Quoted(cut.columns(i)),
                                 " is also in cut.rows: a tensor is cut along one dim"));
    }
  }
  return absl::OkStatus();
}

// A directory of publisher/subscriber.files: absolute, no "." or ".." components, not "/".
absl::Status CheckFilesDir(const Checker& c, const std::string& field, const std::string& dir) {
  if (dir.empty() || dir[0] != '/') {
    return c.Fail(field, absl::StrCat(Quoted(dir), " must be an absolute directory path"));
  }
  const std::string normal = std::filesystem::path(dir).lexically_normal().string();
  for (const auto& part : std::filesystem::path(dir)) {
    if (part == "." || part == "..") {
      return c.Fail(field, absl::StrCat(Quoted(dir), " has a \"", part.string(),
                                        "\" component (write the directory plainly)"));
    }
  }
  if (normal == "/") return c.Fail(field, "\"/\" would give access to every file");
  return absl::OkStatus();
}

// Whether `inner` is `outer` or lies beneath it (lexically, both absolute).
bool PathWithin(const std::string& inner, const std::string& outer) {
  auto norm = [](const std::string& p) {
    std::string s = std::filesystem::path(p).lexically_normal().string();
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    return s;
  };
  const std::string i = norm(inner), o = norm(outer);
  return i == o || (i.size() > o.size() && i.compare(0, o.size(), o) == 0 && i[o.size()] == '/');
}

// `role`.files; `persist_dir` (publisher only, "" when none) must not overlap export_dir.
absl::Status CheckFileAccess(const Checker& c, const std::string& role, const v1::FileAccess& f,
                             const std::string& persist_dir) {
  const std::string prefix = absl::StrCat(role, ".files.");
  for (int i = 0; i < f.publish_dirs_size(); ++i) {
    const std::string field = absl::StrCat(prefix, "publish_dirs[", i, "]");
    if (role != "publisher") {
      return c.Fail(field, "a subscriber publishes nothing (leave it empty)");
    }
    REFIT_RETURN_IF_ERROR(CheckFilesDir(c, field, f.publish_dirs(i)));
  }
  const absl::StatusOr<unsigned> mode = ParseFileMode(f.export_mode(), prefix + "export_mode");
  if (!mode.ok() || (*mode & ~0666u) != 0) {
    return c.Fail(prefix + "export_mode",
                  absl::StrCat(Quoted(f.export_mode()),
                               " is not an octal file mode up to 0666 (e.g. \"0600\", \"0640\")"));
  }
  if (f.export_dir().empty()) return absl::OkStatus();
  REFIT_RETURN_IF_ERROR(CheckFilesDir(c, prefix + "export_dir", f.export_dir()));
  if (persist_dir.empty()) return absl::OkStatus();
  std::error_code ec;  // the non-throwing overload (no exceptions); on error compare as given
  std::string persist = std::filesystem::absolute(persist_dir, ec).string();
  if (ec) persist = persist_dir;
  if (PathWithin(persist, f.export_dir()) || PathWithin(f.export_dir(), persist)) {
    return c.Fail(prefix + "export_dir",
                  absl::StrCat(Quoted(f.export_dir()), " overlaps publisher.baseline.persist_dir ",
                               Quoted(persist_dir), " (the persisted baseline is never an export ",
                               "target: use separate directories)"));
  }
  return absl::OkStatus();
}

absl::Status MissingSection(const SourceMap& map, const v1::ConfigFile& file, const char* role) {
  const char* other = file.has_publisher() ? "publisher" : "subscriber";
  return absl::InvalidArgumentError(absl::StrCat(map.source_name(), ": no '", role,
                                                 ":' section (the file configures a ", other, ")"));
}

// control_access / local_access: every grant names someone and grants something; modes parse.
absl::Status CheckAccess(const Checker& c, const std::string& role, const v1::ControlAccess& control,
                         const v1::LocalAccess& local) {
  const std::string field = role + ".control_access";
  for (int i = 0; i < control.grants_size(); ++i) {
    const v1::ControlGrant& g = control.grants(i);
    const std::string path = absl::StrCat(field, ".grants[", i, "]");
    if (g.role() == v1::CONTROL_ROLE_NONE || g.role() == v1::CONTROL_ROLE_UNSPECIFIED) {
      return c.Fail(path + ".role", "must be read, operate or write (none grants nothing)");
    }
    if (g.identities_size() == 0 && g.uids_size() == 0 && g.gids_size() == 0) {
      return c.Fail(path, "names nobody: give identities, uids or gids");
    }
    for (int j = 0; j < g.identities_size(); ++j) {
      if (g.identities(j).empty()) {
        return c.Fail(absl::StrCat(path, ".identities[", j, "]"), "must not be empty");
      }
    }
  }
  for (const auto& [path, text] :
       {std::pair<std::string, const std::string*>{field + ".socket_mode", &control.socket_mode()},
        {role + ".local_access.socket_mode", &local.socket_mode()}}) {
    if (!ParseFileMode(*text, path).ok()) {
      return c.Fail(path, absl::StrCat(Quoted(*text),
                                       " is not an octal file mode up to 0777 (e.g. \"0660\")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePublisherConfig(const v1::PublisherConfig& p, const SourceMap* map) {
  const Checker c(map);
  REFIT_RETURN_IF_ERROR(CheckName(c, "publisher.name", p.name()));
  std::vector<Endpoint> endpoints;
  REFIT_ASSIGN_OR_RETURN(const Address listen, CheckListener(c, "publisher.listen", p.listen(),
                                                             "publisher.tls", p.tls()));
  endpoints.push_back(EndpointOf("publisher.listen", listen));
  REFIT_RETURN_IF_ERROR(CheckControlAndLocal(c, "publisher", p.control_listen(), p.control_tls(),
                                             p.local_socket(), endpoints));
  REFIT_RETURN_IF_ERROR(CheckMetrics(c, "publisher", p.metrics(), endpoints));
  REFIT_RETURN_IF_ERROR(CheckAccess(c, "publisher", p.control_access(), p.local_access()));
  if (p.codec().has_cuda_device() && p.codec().device() == v1::DEVICE_CPU) {
    return c.Fail("publisher.codec.cuda_device", "is set, but codec.device is cpu");
  }
  if (p.codec().has_cuda_device_uuid()) {
    if (p.codec().device() == v1::DEVICE_CPU) {
      return c.Fail("publisher.codec.cuda_device_uuid", "is set, but codec.device is cpu");
    }
    REFIT_RETURN_IF_ERROR(
        CheckGpuUuidNotWithOrdinal(c, "publisher.codec", p.codec().has_cuda_device()));
  }
  REFIT_RETURN_IF_ERROR(CheckFileAccess(c, "publisher", p.files(), p.baseline().persist_dir()));
  REFIT_RETURN_IF_ERROR(CheckPublisherShard(c, p.shard()));
  REFIT_RETURN_IF_ERROR(CheckPublisherCut(c, p.cut(), p.shard()));
  return absl::OkStatus();
}

namespace {

// subscriber.upstream.addresses, or shards with shard_set: every address with its key path.
absl::Status CollectUpstreamAddresses(const Checker& c, const v1::UpstreamConfig& up,
                                      std::vector<std::pair<std::string, std::string>>& out) {
  if (up.addresses_size() == 0 && up.shards_size() == 0) {
    return c.Fail("subscriber.upstream.addresses",
                  "at least one address is required (or upstream.shards)");
  }
  if (up.addresses_size() > 0 && up.shards_size() > 0) {
    return c.Fail("subscriber.upstream.shards",
                  "is set together with upstream.addresses: list the publishers either as "
                  "addresses (unsharded) or as shards, not both");
  }
  for (int i = 0; i < up.addresses_size(); ++i) {
    out.emplace_back(absl::StrCat("subscriber.upstream.addresses[", i, "]"), up.addresses(i));
  }
  if (up.shards_size() == 0) {
    if (!up.shard_set().empty()) {
      return c.Fail("subscriber.upstream.shard_set", "is set but upstream.shards is empty");
    }
    return absl::OkStatus();
  }
  REFIT_RETURN_IF_ERROR(CheckShardSet(c, "subscriber.upstream.shard_set", up.shard_set()));
  if (up.shards_size() > 1024) {
    return c.Fail("subscriber.upstream.shards", absl::StrCat("lists ", up.shards_size(),
                                                             " shards; at most 1024"));
  }
  if (up.bootstrap_peers_size() > 0) {
    return c.Fail("subscriber.upstream.bootstrap_peers",
                  "is not supported with upstream.shards (bootstrap from the shards' publishers)");
  }
  for (int k = 0; k < up.shards_size(); ++k) {
    for (int i = 0; i < up.shards(k).addresses_size(); ++i) {
      out.emplace_back(absl::StrCat("subscriber.upstream.shards[", k, "].addresses[", i, "]"),
                       up.shards(k).addresses(i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// store.slots 1, a single copy updated in place: what it needs and what it cannot be combined
// with (docs/ARCHITECTURE.md "Single-copy store").
absl::Status CheckSingleCopy(const Checker& c, const v1::SubscriberConfig& s) {
  const v1::StoreConfig& store = s.store();
  if (store.slots() != 1) return absl::OkStatus();
  if (!store.digest_v2()) {
    return c.Fail("subscriber.store.slots",
                  "1 (a single copy, updated in place) verifies every version from tensor digest "
                  "v2 before writing it: store.digest_v2 must be true (its default)");
  }
  if (s.serve_peers()) {
    return c.Fail("subscriber.serve_peers",
                  "true cannot be combined with store.slots 1: peers and relayed transfers are "
                  "served from leases on the held version, which would hold every in-place update "
                  "back; serve peers from a subscriber with 2 or more slots");
  }
  if (c.Given("subscriber.store.scrub_bytes_per_second") && store.scrub_bytes_per_second() > 0) {
    return c.Fail("subscriber.store.scrub_bytes_per_second",
                  "the scrub repairs a damaged version into a second slot, which store.slots 1 "
                  "does not have: set 0 (with store.slots 1 the scrub is off by default)");
  }
  return absl::OkStatus();
}

// upstream.slice, a tensor-parallel rank (docs/ARCHITECTURE.md "Tensor-parallel slices").
absl::Status CheckSlice(const Checker& c, const v1::SubscriberConfig& s) {
  const v1::SliceConfig& slice = s.upstream().slice();
  if (slice.ranks() == 0) {
    if (slice.rank() > 0) {
      return c.Fail("subscriber.upstream.slice.rank",
                    absl::StrCat(slice.rank(), " is given without slice.ranks"));
    }
    return absl::OkStatus();
  }
  if (slice.rank() >= slice.ranks()) {
    return c.Fail("subscriber.upstream.slice.rank",
                  absl::StrCat(slice.rank(), " is not below slice.ranks (", slice.ranks(), ")"));
  }
  if (s.upstream().shards_size() > 0) {
    return c.Fail("subscriber.upstream.slice",
                  "is not supported with upstream.shards yet (a shard publisher's parts are its "
                  "rows, not tensor-parallel shares)");
  }
  if (s.serve_peers()) {
    return c.Fail("subscriber.upstream.slice",
                  "cannot be combined with serve_peers: a relay republishes whole tensors, and a "
                  "tensor-parallel subscriber holds one share of each; relay from a subscriber "
                  "without a slice");
  }
  return absl::OkStatus();
}

absl::Status ValidateSubscriberConfig(const v1::SubscriberConfig& s, const SourceMap* map) {
  const Checker c(map);
  REFIT_RETURN_IF_ERROR(CheckName(c, "subscriber.name", s.name()));
  const v1::UpstreamConfig& up = s.upstream();
  std::vector<std::pair<std::string, std::string>> upstream_addresses;
  REFIT_RETURN_IF_ERROR(CollectUpstreamAddresses(c, up, upstream_addresses));
  for (int i = 0; i < up.bootstrap_peers_size(); ++i) {
    upstream_addresses.emplace_back(absl::StrCat("subscriber.upstream.bootstrap_peers[", i, "]"),
                                    up.bootstrap_peers(i));
  }
  for (size_t i = 0; i < upstream_addresses.size(); ++i) {
    const auto& [path, text] = upstream_addresses[i];
    auto addr = ParseAddress(text, AddressUse::kConnect);
    if (!addr.ok()) return c.Fail(path, absl::StrCat(Quoted(text), ": ", addr.status().message()));
    for (size_t j = 0; j < i; ++j) {
      if (upstream_addresses[j].second == text) {
        return c.Fail(path, absl::StrCat(Quoted(text), " is listed twice (also ",
                                         upstream_addresses[j].first, ")"));
      }
    }
  }
  REFIT_RETURN_IF_ERROR(CheckClientTls(c, "subscriber.upstream.tls", up.tls(), upstream_addresses));
  if (up.backoff().initial_ms() > up.backoff().max_ms()) {
    return c.Fail("subscriber.upstream.backoff.initial_ms",
                  absl::StrCat(up.backoff().initial_ms(), " exceeds backoff.max_ms (",
                               up.backoff().max_ms(), ")"));
  }

  std::vector<Endpoint> endpoints;
  if (s.listen().empty() && s.control_listen().empty()) {
    return c.Fail("subscriber.listen",
                  "set listen or control_listen: refitctl needs an address to reach the "
                  "subscriber");
  }
  if (!s.listen().empty()) {
    REFIT_ASSIGN_OR_RETURN(const Address listen, CheckListener(c, "subscriber.listen", s.listen(),
                                                               "subscriber.tls", s.tls()));
    endpoints.push_back(EndpointOf("subscriber.listen", listen));
  } else {
    REFIT_RETURN_IF_ERROR(CheckUnusedTls(c, "subscriber.tls", s.tls(), "listen is empty"));
    if (s.serve_peers()) {
      return c.Fail("subscriber.serve_peers", "true needs a listen address to serve peers on");
    }
  }
  REFIT_RETURN_IF_ERROR(CheckControlAndLocal(c, "subscriber", s.control_listen(), s.control_tls(),
                                             s.local_socket(), endpoints));
  REFIT_RETURN_IF_ERROR(CheckMetrics(c, "subscriber", s.metrics(), endpoints));
  REFIT_RETURN_IF_ERROR(CheckAccess(c, "subscriber", s.control_access(), s.local_access()));

  const v1::StoreConfig& store = s.store();
  const std::string& prefix = store.shm_prefix();
  if (prefix.size() < 2 || prefix[0] != '/' || prefix.find('/', 1) != std::string::npos ||
      prefix.size() > 200) {
    return c.Fail("subscriber.store.shm_prefix",
                  absl::StrCat(Quoted(prefix),
                               ": a POSIX shm name prefix starts with '/', has no other '/' and "
                               "is 2..200 bytes"));
  }
  if (store.has_cuda_device() && store.kind() != v1::STORE_KIND_CUDA) {
    return c.Fail("subscriber.store.cuda_device", "is set, but store.kind is not cuda");
  }
  if (store.has_cuda_device_uuid()) {
    if (store.kind() != v1::STORE_KIND_CUDA) {
      return c.Fail("subscriber.store.cuda_device_uuid", "is set, but store.kind is not cuda");
    }
    REFIT_RETURN_IF_ERROR(
        CheckGpuUuidNotWithOrdinal(c, "subscriber.store", store.has_cuda_device()));
  }
  REFIT_RETURN_IF_ERROR(CheckSingleCopy(c, s));
  REFIT_RETURN_IF_ERROR(CheckSlice(c, s));
  if (s.leases().default_ttl_ms() > s.leases().max_ttl_ms()) {
    return c.Fail("subscriber.leases.default_ttl_ms",
                  absl::StrCat(s.leases().default_ttl_ms(), " exceeds leases.max_ttl_ms (",
                               s.leases().max_ttl_ms(), ")"));
  }
  REFIT_RETURN_IF_ERROR(CheckFileAccess(c, "subscriber", s.files(), ""));
  return absl::OkStatus();
}

namespace {

// `s` (from safe_file.h, which names the path itself) as "<where>: <reason>", the path said once.
absl::Status WithoutPath(const absl::Status& s, const std::string& where, const std::string& path) {
  absl::string_view m = s.message();
  for (const std::string& prefix :
       {absl::StrCat("open ", Quoted(path), ": "), absl::StrCat("read ", Quoted(path), ": "),
        absl::StrCat(Quoted(path), " ")}) {
    if (absl::StartsWith(m, prefix)) {
      m.remove_prefix(prefix.size());
      break;
    }
  }
  return absl::Status(s.code(), absl::StrCat(where, ": ", m));
}

}  // namespace

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const std::string& what,
                                          size_t max_bytes) {
  const std::string where = absl::StrCat("cannot read ", what, " ", Quoted(path));
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": empty path"));
  // A FIFO or device is refused without blocking in open() (safe_file.h).
  absl::StatusOr<UniqueFd> fd = OpenRegularFile(path);
  if (!fd.ok()) return WithoutPath(fd.status(), where, path);
  absl::StatusOr<std::vector<uint8_t>> bytes = ReadWholeFile(fd->get(), path, max_bytes);
  if (!bytes.ok()) return WithoutPath(bytes.status(), where, path);
  return std::string(bytes->begin(), bytes->end());
}

absl::Status FieldError(const SourceMap* source_map, const std::string& path,
                        absl::string_view problem) {
  return Checker(source_map).Fail(path, problem);
}

absl::StatusOr<LoadedSection<v1::ConfigFile>> LoadConfigFileSections(
    const std::string& yaml_text, const std::string& source_name) {
  LoadedSection<v1::ConfigFile> loaded{.section = {}, .source_map = SourceMap(source_name)};
  SourceMap& map = loaded.source_map;
  REFIT_ASSIGN_OR_RETURN(loaded.section, ParseConfigFile(yaml_text, &map));
  const v1::ConfigFile& file = loaded.section;
  if (file.has_publisher()) REFIT_RETURN_IF_ERROR(ValidatePublisherConfig(file.publisher(), &map));
  if (file.has_subscriber())
    REFIT_RETURN_IF_ERROR(ValidateSubscriberConfig(file.subscriber(), &map));
  return loaded;
}

absl::StatusOr<LoadedSection<v1::PublisherConfig>> LoadPublisherSection(
    const std::string& yaml_text, const std::string& source_name) {
  LoadedSection<v1::PublisherConfig> loaded{.section = {}, .source_map = SourceMap(source_name)};
  SourceMap& map = loaded.source_map;
  REFIT_ASSIGN_OR_RETURN(v1::ConfigFile file, ParseConfigFile(yaml_text, &map));
  if (!file.has_publisher()) return MissingSection(map, file, "publisher");
  REFIT_RETURN_IF_ERROR(ValidatePublisherConfig(file.publisher(), &map));
  loaded.section = std::move(*file.mutable_publisher());
  return loaded;
}

absl::StatusOr<LoadedSection<v1::SubscriberConfig>> LoadSubscriberSection(
    const std::string& yaml_text, const std::string& source_name) {
  LoadedSection<v1::SubscriberConfig> loaded{.section = {}, .source_map = SourceMap(source_name)};
  SourceMap& map = loaded.source_map;
  REFIT_ASSIGN_OR_RETURN(v1::ConfigFile file, ParseConfigFile(yaml_text, &map));
  if (!file.has_subscriber()) return MissingSection(map, file, "subscriber");
  REFIT_RETURN_IF_ERROR(ValidateSubscriberConfig(file.subscriber(), &map));
  loaded.section = std::move(*file.mutable_subscriber());
  return loaded;
}

absl::StatusOr<v1::ConfigFile> LoadConfigFileFromString(const std::string& yaml_text,
                                                        const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(LoadedSection<v1::ConfigFile> loaded,
                         LoadConfigFileSections(yaml_text, source_name));
  return std::move(loaded.section);
}

absl::StatusOr<v1::PublisherConfig> LoadPublisherConfigFromString(const std::string& yaml_text,
                                                                  const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(LoadedSection<v1::PublisherConfig> loaded,
                         LoadPublisherSection(yaml_text, source_name));
  return std::move(loaded.section);
}

absl::StatusOr<v1::SubscriberConfig> LoadSubscriberConfigFromString(
    const std::string& yaml_text, const std::string& source_name) {
  REFIT_ASSIGN_OR_RETURN(LoadedSection<v1::SubscriberConfig> loaded,
                         LoadSubscriberSection(yaml_text, source_name));
  return std::move(loaded.section);
}

absl::StatusOr<v1::ConfigFile> LoadConfigFile(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, "config"));
  return LoadConfigFileFromString(text, path);
}

absl::StatusOr<v1::PublisherConfig> LoadPublisherConfig(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, "config"));
  return LoadPublisherConfigFromString(text, path);
}

absl::StatusOr<v1::SubscriberConfig> LoadSubscriberConfig(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, "config"));
  return LoadSubscriberConfigFromString(text, path);
}

absl::Status CheckConfigFiles(const v1::PublisherConfig& config) {
  REFIT_RETURN_IF_ERROR(CheckServerTlsFiles("publisher.tls", config.tls()));
  return CheckServerTlsFiles("publisher.control_tls", config.control_tls());
}

absl::Status CheckConfigFiles(const v1::SubscriberConfig& config) {
  REFIT_RETURN_IF_ERROR(CheckClientTlsFiles("subscriber.upstream.tls", config.upstream().tls()));
  REFIT_RETURN_IF_ERROR(CheckServerTlsFiles("subscriber.tls", config.tls()));
  return CheckServerTlsFiles("subscriber.control_tls", config.control_tls());
}

std::string ConfigToYaml(const v1::PublisherConfig& config) {
  v1::ConfigFile file;
  *file.mutable_publisher() = config;
  return MessageToYaml(file);
}

std::string ConfigToYaml(const v1::SubscriberConfig& config) {
  v1::ConfigFile file;
  *file.mutable_subscriber() = config;
  return MessageToYaml(file);
}

absl::StatusOr<unsigned> ParseFileMode(const std::string& text, const std::string& field) {
  unsigned mode = 0;
  bool ok = !text.empty() && text.size() <= 4;
  for (const char ch : text) {
    if (ch < '0' || ch > '7') ok = false;
    mode = mode * 8 + static_cast<unsigned>(ch - '0');
  }
  if (!ok || mode > 0777) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", Quoted(text), " is not an octal file mode up to 0777 (e.g. \"0660\")"));
  }
  return mode;
}

unsigned FileModeOr(const std::string& text, unsigned fallback) {
  return ParseFileMode(text, "mode").value_or(fallback);
}

}  // namespace refit::config
