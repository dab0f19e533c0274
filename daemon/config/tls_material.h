// TLS material of one config block (ServerTls / ClientTls): the PEM files read and checked with
// OpenSSL before anything hands them to gRPC, so that a bad file is reported by refitd with the
// field and the path, not by gRPC's internal log or a failed bind.
//
//   REFIT_ASSIGN_OR_RETURN(TlsMaterial m, LoadTlsMaterial({"publisher.tls", cert, key, ca}));
//   m.leaf.subject  // "CN=refit-e2e-server"
//
// Checks: cert holds one or more parsable PEM certificates (every "BEGIN CERTIFICATE" block
// parses), key holds an unencrypted PEM private key that matches the first certificate, ca holds
// one or more parsable PEM certificates. Errors never quote file contents.
#ifndef REFIT_DAEMON_CONFIG_TLS_MATERIAL_H_
#define REFIT_DAEMON_CONFIG_TLS_MATERIAL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::config {

// Where a block's files are: `field` is its config path ("publisher.tls"); the files' fields
// are field + ".cert" / ".key" / ".ca".
struct TlsFiles {
  std::string field;
  std::string cert;
  std::string key;
  std::string ca;
};

// What Status reports about a certificate.
struct CertSummary {
  std::string subject;             // RFC 2253, e.g. "CN=refit-e2e-server,O=refit"
  int64_t not_after_unix = 0;      // end of validity, Unix seconds
  std::string sha256_fingerprint;  // of the DER certificate, "AB:CD:..." like `openssl x509
                                   // -fingerprint -sha256`
};

struct TlsMaterial {
  std::string cert_pem;
  std::string key_pem;
  std::string ca_pem;
  CertSummary leaf;  // the first certificate of cert_pem
};

// Reads and checks the three files. NotFound / PermissionDenied when a file cannot be read,
// InvalidArgument when one holds the wrong thing, e.g.
//   publisher.tls.key "/p/k.pem" does not match the certificate publisher.tls.cert "/p/c.pem"
absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files);
// The three files' contents only (regular files, errors naming field and path); `leaf` empty.
absl::StatusOr<TlsMaterial> ReadTlsFiles(const TlsFiles& files);

// The same checks on text already read (the paths only name the files in errors).
absl::StatusOr<CertSummary> CheckTlsMaterial(const TlsFiles& files, const std::string& cert_pem,
                                             const std::string& key_pem,
                                             const std::string& ca_pem);

// The same, the files named by `*_what` in errors ("--tls-cert \"/x.pem\"").
absl::StatusOr<CertSummary> CheckTlsMaterialNamed(const std::string& cert_pem,
                                                  const std::string& key_pem,
                                                  const std::string& ca_pem,
                                                  const std::string& cert_what,
                                                  const std::string& key_what,
                                                  const std::string& ca_what);

// One check at a time: `what` names the field and file in errors ("tls.cert \"/x.pem\"").
// The first certificate of a PEM certificate file (or CA bundle).
absl::StatusOr<CertSummary> CheckPemCertificates(const std::string& pem, const std::string& what);
absl::Status CheckPemPrivateKey(const std::string& pem, const std::string& what);

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_TLS_MATERIAL_H_
