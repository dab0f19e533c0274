#include "daemon/config/tls_material.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/config.h"

namespace refit::config {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// Never prompts for a passphrase: an encrypted key is an error, not a hang.
int NoPassphrase(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) { return -1; }

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

size_t CountOccurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

std::vector<X509Ptr> ParseCertificates(const std::string& pem) {
  std::vector<X509Ptr> certs;
  BioPtr bio = MemBio(pem);
  if (bio == nullptr) return certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr)) {
    certs.emplace_back(x);
  }
  ERR_clear_error();  // the loop ends on "no start line"
  return certs;
}

std::string SubjectOf(X509* cert) {
  BioPtr out(BIO_new(BIO_s_mem()));
  if (out == nullptr) return "";
  X509_NAME_print_ex(out.get(), X509_get_subject_name(cert), 0, XN_FLAG_RFC2253);
  char* data = nullptr;
  const long n = BIO_get_mem_data(out.get(), &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string();
}

int64_t NotAfterOf(X509* cert) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert), &tm) != 1) return 0;
  return static_cast<int64_t>(timegm(&tm));
}

std::string FingerprintOf(X509* cert) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (X509_digest(cert, EVP_sha256(), md, &n) != 1) return "";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) {
    if (i > 0) out.push_back(':');
    absl::StrAppendFormat(&out, "%02X", md[i]);
  }
  return out;
}

CertSummary Summarize(X509* cert) {
  return CertSummary{SubjectOf(cert), NotAfterOf(cert), FingerprintOf(cert)};
}

// The certificates of `pem`; InvalidArgument naming `what` when there are none or a block does
// not parse.
absl::StatusOr<std::vector<X509Ptr>> CertificatesOf(const std::string& pem,
                                                    const std::string& what) {
  std::vector<X509Ptr> certs = ParseCertificates(pem);
  const size_t blocks = CountOccurrences(pem, "-----BEGIN CERTIFICATE-----");
  if (certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not a PEM certificate: ",
        blocks == 0 ? "no \"-----BEGIN CERTIFICATE-----\" block"
                    : "its \"-----BEGIN CERTIFICATE-----\" block does not parse"));
  }
  if (certs.size() < blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a valid PEM certificate file: certificate ", certs.size() + 1,
                     " of ", blocks, " does not parse"));
  }
  return certs;
}

absl::StatusOr<PkeyPtr> PrivateKeyOf(const std::string& pem, const std::string& what) {
  BioPtr bio = MemBio(pem);
  PkeyPtr key(bio == nullptr
                  ? nullptr
                  : PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    const bool has_block = pem.find("-----BEGIN ") != std::string::npos &&
                           pem.find("PRIVATE KEY-----") != std::string::npos;
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not a PEM private key: ",
        has_block ? "its \"PRIVATE KEY\" block does not parse (or is encrypted)"
                  : "no \"-----BEGIN ... PRIVATE KEY-----\" block"));
  }
  return key;
}

std::string What(const TlsFiles& f, const char* which, const std::string& path) {
  return absl::StrCat(f.field, ".", which, " ", Quoted(path));
}

}  // namespace

absl::StatusOr<CertSummary> CheckPemCertificates(const std::string& pem, const std::string& what) {
  REFIT_ASSIGN_OR_RETURN(std::vector<X509Ptr> certs, CertificatesOf(pem, what));
  return Summarize(certs.front().get());
}

absl::Status CheckPemPrivateKey(const std::string& pem, const std::string& what) {
  return PrivateKeyOf(pem, what).status();
}

absl::StatusOr<CertSummary> CheckTlsMaterial(const TlsFiles& files, const std::string& cert_pem,
                                             const std::string& key_pem,
                                             const std::string& ca_pem) {
  return CheckTlsMaterialNamed(cert_pem, key_pem, ca_pem, What(files, "cert", files.cert),
                               What(files, "key", files.key), What(files, "ca", files.ca));
}

absl::StatusOr<CertSummary> CheckTlsMaterialNamed(const std::string& cert_pem,
                                                  const std::string& key_pem,
                                                  const std::string& ca_pem,
                                                  const std::string& cert_what,
                                                  const std::string& key_what,
                                                  const std::string& ca_what) {
  REFIT_ASSIGN_OR_RETURN(std::vector<X509Ptr> certs, CertificatesOf(cert_pem, cert_what));
  REFIT_ASSIGN_OR_RETURN(PkeyPtr key, PrivateKeyOf(key_pem, key_what));
  if (X509_check_private_key(certs.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_what, " does not match the certificate ", cert_what));
  }
  ERR_clear_error();
  REFIT_RETURN_IF_ERROR(CertificatesOf(ca_pem, ca_what).status());
  return Summarize(certs.front().get());
}

absl::StatusOr<TlsMaterial> ReadTlsFiles(const TlsFiles& files) {
  TlsMaterial m;
  REFIT_ASSIGN_OR_RETURN(m.cert_pem, ReadSmallFile(files.cert, absl::StrCat(files.field, ".cert")));
  REFIT_ASSIGN_OR_RETURN(m.key_pem, ReadSmallFile(files.key, absl::StrCat(files.field, ".key")));
  REFIT_ASSIGN_OR_RETURN(m.ca_pem, ReadSmallFile(files.ca, absl::StrCat(files.field, ".ca")));
  return m;
}

absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files) {
  REFIT_ASSIGN_OR_RETURN(TlsMaterial m, ReadTlsFiles(files));
  REFIT_ASSIGN_OR_RETURN(m.leaf, CheckTlsMaterial(files, m.cert_pem, m.key_pem, m.ca_pem));
  return m;
}

}  // namespace refit::config
