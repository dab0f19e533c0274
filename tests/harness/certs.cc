#include "tests/harness/certs.h"

#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/harness/process.h"

namespace refit::e2e {
namespace {

absl::Status Openssl(std::vector<std::string> args) {
  args.insert(args.begin(), "/usr/bin/openssl");
  CommandResult r = RunCommand(args, absl::Seconds(60));
  if (r.exit_code != 0) {
    std::string cmd;
    for (const std::string& a : args) absl::StrAppend(&cmd, a, " ");
    return absl::InternalError(absl::StrCat("openssl failed: ", cmd, "-> ", r.Describe()));
  }
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status MakeCa(const std::string& dir, const std::string& stem, const std::string& cn) {
  return Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                  "-nodes", "-keyout", absl::StrCat(dir, "/", stem, ".key"), "-out",
                  absl::StrCat(dir, "/", stem, ".crt"), "-days", "2", "-subj",
                  absl::StrCat("/CN=", cn), "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign"});
}

// Key + CSR + certificate signed by CA `ca_stem` with the extensions in `ext`.
absl::StatusOr<CertPair> MakeLeaf(const std::string& dir, const std::string& ca_stem,
                                  const std::string& stem, const std::string& cn,
                                  const std::string& ext) {
  CertPair p{absl::StrCat(dir, "/", stem, ".crt"), absl::StrCat(dir, "/", stem, ".key")};
  const std::string csr = absl::StrCat(dir, "/", stem, ".csr");
  const std::string ext_file = absl::StrCat(dir, "/", stem, ".ext");
  if (absl::Status s = WriteFile(ext_file, ext); !s.ok()) return s;
  if (absl::Status s = Openssl({"req", "-new", "-newkey", "ec", "-pkeyopt",
                                "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", p.key, "-out",
                                csr, "-subj", absl::StrCat("/CN=", cn)});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Openssl({"x509", "-req", "-in", csr, "-CA",
                                absl::StrCat(dir, "/", ca_stem, ".crt"), "-CAkey",
                                absl::StrCat(dir, "/", ca_stem, ".key"), "-CAcreateserial", "-out",
                                p.cert, "-days", "2", "-extfile", ext_file});
      !s.ok()) {
    return s;
  }
  return p;
}

std::string ClientExt(const std::string& name) {
  return absl::StrCat("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n",
                      "extendedKeyUsage=clientAuth\nsubjectAltName=DNS:", name, "\n");
}

constexpr char kServerExt[] =
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    "extendedKeyUsage=serverAuth,clientAuth\n"
    "subjectAltName=IP:127.0.0.1,DNS:localhost\n";

}  // namespace

absl::StatusOr<CertPair> MakeServerCert(const std::string& dir, const std::string& stem,
                                        const std::string& cn) {
  return MakeLeaf(dir, "ca", stem, cn, kServerExt);
}

absl::StatusOr<CertPair> MakeClientCert(const std::string& dir, const std::string& name,
                                        bool other_ca) {
  return MakeLeaf(dir, other_ca ? "other-ca" : "ca",
                  absl::StrCat(other_ca ? "other-" : "", "client-", name), name, ClientExt(name));
}

absl::StatusOr<TestPki> MakeTestPki(const std::string& dir, const std::string& client_name) {
  TestPki pki;
  if (absl::Status s = MakeCa(dir, "ca", "refit-e2e-ca"); !s.ok()) return s;
  if (absl::Status s = MakeCa(dir, "other-ca", "refit-e2e-other-ca"); !s.ok()) return s;
  pki.ca = absl::StrCat(dir, "/ca.crt");
  pki.other_ca = absl::StrCat(dir, "/other-ca.crt");
  absl::StatusOr<CertPair> server =
      MakeLeaf(dir, "ca", "server", "refit-e2e-server",
               "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
               "extendedKeyUsage=serverAuth,clientAuth\n"
               "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
  if (!server.ok()) return server.status();
  pki.server = *server;
  absl::StatusOr<CertPair> client = MakeClientCert(dir, client_name, false);
  if (!client.ok()) return client.status();
  pki.client = *client;
  absl::StatusOr<CertPair> other = MakeClientCert(dir, client_name, true);
  if (!other.ok()) return other.status();
  pki.other_client = *other;
  return pki;
}

}  // namespace refit::e2e
