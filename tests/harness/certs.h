// Test PKI made with the openssl CLI: a CA, a server certificate for 127.0.0.1 / localhost and
// client certificates, plus a second, unrelated CA for "wrong CA" cases. EC P-256 keys, valid
// for two days.
#ifndef REFIT_TESTS_HARNESS_CERTS_H_
#define REFIT_TESTS_HARNESS_CERTS_H_

#include <string>

#include "absl/status/statusor.h"

namespace refit::e2e {

struct CertPair {
  std::string cert;  // PEM certificate path
  std::string key;   // PEM private key path
};

struct TestPki {
  std::string ca;            // CA certificate (PEM) that signed server and client
  CertPair server;           // CN=refit-e2e-server, SAN IP:127.0.0.1, DNS:localhost
  CertPair client;           // CN=<client_name>, SAN DNS:<client_name>
  std::string other_ca;      // an unrelated CA
  CertPair other_client;     // CN=<client_name>, signed by other_ca
};

// Writes everything under `dir` (must exist). Errors carry openssl's output.
absl::StatusOr<TestPki> MakeTestPki(const std::string& dir,
                                    const std::string& client_name = "refit-e2e-subscriber");

// One more server certificate (SAN IP:127.0.0.1, DNS:localhost; CN `cn`) signed by the CA in
// `dir` (after MakeTestPki), files <dir>/<stem>.crt / .key: a rotated-in certificate.
absl::StatusOr<CertPair> MakeServerCert(const std::string& dir, const std::string& stem,
                                        const std::string& cn);

// One more client certificate signed by the CA in `dir` (after MakeTestPki).
absl::StatusOr<CertPair> MakeClientCert(const std::string& dir, const std::string& name,
                                        bool other_ca = false);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_CERTS_H_
