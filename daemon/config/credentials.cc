#include "daemon/config/credentials.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/config/config.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace refit::config {
namespace {

// Rejects calls from peers whose certificate names no allowed identity.
class IdentityAuthorizer final : public grpc::AuthMetadataProcessor {
 public:
  IdentityAuthorizer(absl::flat_hash_set<std::string> allowed, std::string field_path)
      : allowed_(std::move(allowed)), field_path_(std::move(field_path)) {}

  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& /*auth_metadata*/, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    const std::vector<std::string> ids = PeerIdentities(*context);
    for (const std::string& id : ids) {
      if (allowed_.contains(id)) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("client certificate identity [", absl::StrJoin(ids, ", "),
                                     "] is not in ", field_path_, ".allowed_identities"));
  }

 private:
  const absl::flat_hash_set<std::string> allowed_;
  const std::string field_path_;
};

void AuthorizeIdentities(const v1::ServerTls& tls, const std::string& field_path,
                         grpc::ServerCredentials* creds) {
  if (tls.allowed_identities_size() == 0) return;
  absl::flat_hash_set<std::string> allowed(tls.allowed_identities().begin(),
                                           tls.allowed_identities().end());
  creds->SetAuthMetadataProcessor(
      std::make_shared<IdentityAuthorizer>(std::move(allowed), field_path));
}

// An anonymous in-memory file (memfd) at a fixed descriptor, reachable by path as
// /proc/self/fd/N; Replace swaps its contents atomically (dup3 of a new memfd onto N).
class MemFile {
 public:
  static absl::StatusOr<std::unique_ptr<MemFile>> Create(const std::string& data, time_t mtime) {
    REFIT_ASSIGN_OR_RETURN(const int fd, NewMemfd(data, mtime));
    return std::unique_ptr<MemFile>(new MemFile(fd));
  }
  ~MemFile() { close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  absl::Status Replace(const std::string& data, time_t mtime) {
    REFIT_ASSIGN_OR_RETURN(const int fd, NewMemfd(data, mtime));
    const int rc = dup3(fd, fd_, O_CLOEXEC);
    const int err = errno;
    close(fd);
    if (rc < 0) return absl::ErrnoToStatus(err, "tls: dup3 of a memory file failed");
    return absl::OkStatus();
  }

  std::string path() const { return absl::StrCat("/proc/self/fd/", fd_); }

 private:
  explicit MemFile(int fd) : fd_(fd) {}

  // gRPC's file watcher re-reads a key/cert pair whose modification time changed while it read
  // them, so every generation gets a distinct mtime (seconds).
  static absl::StatusOr<int> NewMemfd(const std::string& data, time_t mtime) {
    const int fd = memfd_create("refit-tls", MFD_CLOEXEC);
    if (fd < 0) return absl::ErrnoToStatus(errno, "tls: memfd_create failed");
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = write(fd, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        close(fd);
        return absl::ErrnoToStatus(err, "tls: writing a memory file failed");
      }
      done += static_cast<size_t>(n);
    }
    const timespec times[2] = {{mtime, 0}, {mtime, 0}};
    if (futimens(fd, times) != 0) {
      const int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, "tls: futimens on a memory file failed");
    }
    return fd;
  }

  const int fd_;
};

}  // namespace

// One TLS block: the files, the material loaded from them, its memory-file copies that gRPC's
// file watcher serves, and what Status reports.
class ReloadableTls {
 public:
  ReloadableTls(TlsFiles files, uint32_t interval_ms)
      : files_(std::move(files)), interval_(absl::Milliseconds(interval_ms)),
        log_(Logger("tls")) {}

  absl::Status Init() {
    REFIT_ASSIGN_OR_RETURN(TlsMaterial m, LoadTlsMaterial(files_));
    absl::MutexLock lock(&mu_);
    mtime_ = time(nullptr);
    REFIT_ASSIGN_OR_RETURN(key_, MemFile::Create(m.key_pem, mtime_));
    REFIT_ASSIGN_OR_RETURN(cert_, MemFile::Create(m.cert_pem, mtime_));
    REFIT_ASSIGN_OR_RETURN(ca_, MemFile::Create(m.ca_pem, mtime_));
    if (access(key_->path().c_str(), R_OK) != 0) {  // gRPC reads them by these paths
      return absl::FailedPreconditionError(
          absl::StrCat(files_.field, ": cannot hand TLS material to gRPC: ", key_->path(),
                       " is not readable (is /proc mounted?)"));
    }
    provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        key_->path(), cert_->path(), ca_->path(), /*refresh_interval_sec=*/1);
    SetLoaded(std::move(m), /*reload=*/false);
    return absl::OkStatus();
  }

  // Reads the files; installs new valid material, keeps the old one otherwise.
  absl::Status Check() {
    absl::StatusOr<TlsMaterial> m = ReadChanged();
    absl::MutexLock lock(&mu_);
    if (!m.ok()) return Refuse(m.status());
    if (m->cert_pem.empty()) {  // unchanged
      status_.clear_last_reload_error();
      status_.clear_last_reload_error_unix_nanos();
      return absl::OkStatus();
    }
    mtime_ = std::max(time(nullptr), mtime_ + 1);
    for (const auto& [file, data] : {std::pair{key_.get(), &m->key_pem},
                                     {cert_.get(), &m->cert_pem}, {ca_.get(), &m->ca_pem}}) {
      absl::Status st = file->Replace(*data, mtime_);
      if (!st.ok()) return Refuse(st);
    }
    SetLoaded(*std::move(m), /*reload=*/true);
    return absl::OkStatus();
  }

  v1::TlsMaterialStatus Status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider() const {
    absl::MutexLock lock(&mu_);
    return provider_;
  }

  absl::Duration interval() const { return interval_; }
  absl::Time next_check;  // TlsReloader's thread only (under its mutex)

 private:
  // The files' material when it differs from the loaded one; empty material when unchanged.
  absl::StatusOr<TlsMaterial> ReadChanged() {
    REFIT_ASSIGN_OR_RETURN(TlsMaterial m, ReadTlsFiles(files_));
    {
      absl::MutexLock lock(&mu_);
      if (m.cert_pem == loaded_.cert_pem && m.key_pem == loaded_.key_pem &&
          m.ca_pem == loaded_.ca_pem) {
        return TlsMaterial{};
      }
    }
    REFIT_ASSIGN_OR_RETURN(m.leaf, CheckTlsMaterial(files_, m.cert_pem, m.key_pem, m.ca_pem));
    return m;
  }

  void SetLoaded(TlsMaterial m, bool reload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    status_.set_field(files_.field);
    status_.set_subject(m.leaf.subject);
    status_.set_not_after_unix_seconds(m.leaf.not_after_unix);
    status_.set_sha256_fingerprint(m.leaf.sha256_fingerprint);
    status_.set_loaded_unix_nanos(UnixNanos(now));
    status_.clear_last_reload_error();
    status_.clear_last_reload_error_unix_nanos();
    if (reload) status_.set_reloads(status_.reloads() + 1);
    log_->info("{}: {} certificate \"{}\" (not after {}, sha256 {}) from {}", files_.field,
               reload ? "reloaded: new connections use" : "loaded", m.leaf.subject,
               absl::FormatTime(absl::FromUnixSeconds(m.leaf.not_after_unix), absl::UTCTimeZone()),
               m.leaf.sha256_fingerprint, files_.cert);
    loaded_ = std::move(m);
  }

  // Keeps the loaded material; logs a new refusal once.
  absl::Status Refuse(const absl::Status& st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string why(st.message());
    if (status_.last_reload_error() != why) {
      log_->error("{}: new TLS material refused, still serving certificate \"{}\" (sha256 {}): {}",
                  files_.field, status_.subject(), status_.sha256_fingerprint(), why);
    }
    status_.set_last_reload_error(why);
    status_.set_last_reload_error_unix_nanos(NowUnixNanos());
    return st;
  }

  const TlsFiles files_;
  const absl::Duration interval_;
  const std::shared_ptr<spdlog::logger> log_;
  mutable absl::Mutex mu_;
  TlsMaterial loaded_ ABSL_GUARDED_BY(mu_);
  v1::TlsMaterialStatus status_ ABSL_GUARDED_BY(mu_);
  time_t mtime_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<MemFile> key_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<MemFile> cert_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<MemFile> ca_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider_
      ABSL_GUARDED_BY(mu_);
};

TlsReloader::TlsReloader() = default;

TlsReloader::~TlsReloader() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<ReloadableTls*> TlsReloader::Add(const TlsFiles& files, uint32_t interval_ms) {
  auto block = std::make_unique<ReloadableTls>(files, interval_ms);
  REFIT_RETURN_IF_ERROR(block->Init());
  absl::MutexLock lock(&mu_);
  block->next_check = absl::Now() + block->interval();
  ReloadableTls* raw = block.get();
  blocks_.push_back(std::move(block));
  if (interval_ms > 0 && !thread_.joinable()) thread_ = std::thread([this] { Run(); });
  return raw;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsReloader::ServerCredentials(
    const v1::ServerTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureServerCredentials();
  REFIT_ASSIGN_OR_RETURN(
      ReloadableTls* const block,
      Add({field_path, tls.cert(), tls.key(), tls.ca()}, tls.reload_interval_ms()));
  grpc::experimental::TlsServerCredentialsOptions options(block->provider());
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::experimental::TlsServerCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  AuthorizeIdentities(tls, field_path, creds.get());
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsReloader::ChannelCredentials(
    const v1::ClientTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureChannelCredentials();
  REFIT_ASSIGN_OR_RETURN(
      ReloadableTls* const block,
      Add({field_path, tls.cert(), tls.key(), tls.ca()}, tls.reload_interval_ms()));
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(block->provider());
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::experimental::TlsCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  return creds;
}

absl::Status TlsReloader::Reload() {
  std::vector<ReloadableTls*> blocks;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& b : blocks_) blocks.push_back(b.get());
  }
  absl::Status first;
  for (ReloadableTls* b : blocks) first.Update(b->Check());
  return first;
}

std::vector<v1::TlsMaterialStatus> TlsReloader::Status() const {
  std::vector<ReloadableTls*> blocks;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& b : blocks_) blocks.push_back(b.get());
  }
  std::vector<v1::TlsMaterialStatus> out;
  out.reserve(blocks.size());
  for (ReloadableTls* b : blocks) out.push_back(b->Status());
  return out;
}

// Checks each block with an interval when it is due.
void TlsReloader::Run() {
  mu_.Lock();
  while (!stop_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& b : blocks_) {
      if (b->interval() > absl::ZeroDuration()) next = std::min(next, b->next_check);
    }
    if (mu_.AwaitWithDeadline(absl::Condition(&stop_), next)) break;
    std::vector<ReloadableTls*> due;
    const absl::Time now = absl::Now();
    for (const auto& b : blocks_) {
      if (b->interval() > absl::ZeroDuration() && b->next_check <= now) {
        due.push_back(b.get());
        b->next_check = now + b->interval();
      }
    }
    mu_.Unlock();
    for (ReloadableTls* b : due) b->Check().IgnoreError();  // logged and in Status
    mu_.Lock();
  }
  mu_.Unlock();
}

bool UsesTls(const v1::ServerTls& tls) {
  return !tls.insecure() && !tls.cert().empty() && !tls.key().empty() && !tls.ca().empty();
}

bool UsesTls(const v1::ClientTls& tls) {
  return !tls.insecure() && !tls.cert().empty() && !tls.key().empty() && !tls.ca().empty();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const v1::ServerTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureServerCredentials();
  REFIT_ASSIGN_OR_RETURN(TlsMaterial m,
                         LoadTlsMaterial({field_path, tls.cert(), tls.key(), tls.ca()}));
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = std::move(m.ca_pem);
  options.pem_key_cert_pairs.push_back({std::move(m.key_pem), std::move(m.cert_pem)});
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  AuthorizeIdentities(tls, field_path, creds.get());
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const v1::ClientTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureChannelCredentials();
  REFIT_ASSIGN_OR_RETURN(TlsMaterial m,
                         LoadTlsMaterial({field_path, tls.cert(), tls.key(), tls.ca()}));
  grpc::SslCredentialsOptions options;
  options.pem_cert_chain = std::move(m.cert_pem);
  options.pem_private_key = std::move(m.key_pem);
  options.pem_root_certs = std::move(m.ca_pem);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  return creds;
}

void ApplyClientTlsArgs(const v1::ClientTls& tls, grpc::ChannelArguments* args) {
  if (UsesTls(tls) && !tls.server_name().empty()) {
    args->SetSslTargetNameOverride(tls.server_name());
  }
}

std::vector<std::string> PeerIdentities(const grpc::AuthContext& context) {
  std::vector<std::string> ids;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : context.FindPropertyValues(property)) {
      std::string id(value.data(), value.size());
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(std::move(id));
    }
  }
  return ids;
}

std::string PeerIdentity(const grpc::AuthContext& context) {
  std::vector<std::string> ids = PeerIdentities(context);
  return ids.empty() ? std::string() : std::move(ids.front());
}

}  // namespace refit::config
