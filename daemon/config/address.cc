#include "daemon/config/address.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

#include "daemon/common/printable.h"

namespace refit::config {
namespace {

bool ParseIpv4(const std::string& host, in_addr* out) {
  return inet_pton(AF_INET, host.c_str(), out) == 1;
}

bool ParseIpv6(const std::string& host, in6_addr* out) {
  return inet_pton(AF_INET6, host.c_str(), out) == 1;
}

// RFC 1123 host name: dot-separated labels of letters, digits and hyphens (not at a label's
// ends), each 1..63 bytes, 253 bytes in all; one trailing dot allowed.
bool IsHostName(absl::string_view name) {
  if (absl::EndsWith(name, ".")) name.remove_suffix(1);
  if (name.empty() || name.size() > 253) return false;
  size_t label = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    if (i == name.size() || name[i] == '.') {
      if (label == 0 || label > 63 || name[i - 1] == '-') return false;
      label = 0;
      continue;
    }
    const char c = name[i];
    if (!(absl::ascii_isalnum(c) || c == '-')) return false;
    if (label == 0 && c == '-') return false;
    ++label;
  }
  return true;
}

absl::StatusOr<uint16_t> ParsePort(absl::string_view text, AddressUse use) {
  if (text.empty()) return absl::InvalidArgumentError("missing port number after ':'");
  if (text.size() > 5 || !std::all_of(text.begin(), text.end(), absl::ascii_isdigit)) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", Quoted(text), " is not a number in 0..65535"));
  }
  const int port = std::stoi(std::string(text));
  const int min_port = use == AddressUse::kListen ? 0 : 1;
  if (port < min_port || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", port, " is out of range (", min_port, "..65535",
                     use == AddressUse::kConnect ? "; 0 is only for listening" : "", ")"));
  }
  return static_cast<uint16_t>(port);
}

// "host:port" or "[v6]:port"; `require_kind`: 0 any, 4 IPv4 literal, 6 IPv6 literal.
absl::StatusOr<Address> ParseHostPort(absl::string_view text, AddressUse use, int require_kind) {
  Address a;
  a.kind = AddressKind::kTcp;
  absl::string_view host, port;
  bool bracketed = false;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError("missing ']' after an IPv6 address");
    }
    host = text.substr(1, close - 1);
    absl::string_view rest = text.substr(close + 1);
    if (!absl::StartsWith(rest, ":")) {
      return absl::InvalidArgumentError("expected ':port' after ']'");
    }
    port = rest.substr(1);
    bracketed = true;
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          "missing ':port' (write host:port, [ipv6]:port or unix:/path)");
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("an IPv6 address needs brackets: [", host, "]:", port));
    }
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(use == AddressUse::kListen
                                          ? "missing host (use 0.0.0.0 or [::] for all interfaces)"
                                          : "missing host");
  }
  a.host = std::string(host);
  in_addr v4;
  in6_addr v6;
  if (bracketed) {
    if (!ParseIpv6(a.host, &v6)) {
      return absl::InvalidArgumentError(absl::StrCat(Quoted(host), " is not an IPv6 address"));
    }
    a.loopback = IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  } else if (ParseIpv4(a.host, &v4)) {
    a.loopback = (ntohl(v4.s_addr) >> 24) == 127;
  } else if (require_kind == 4) {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(host), " is not an IPv4 address"));
  } else if (IsHostName(host)) {
    a.loopback = IsLoopbackHost(a.host);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(Quoted(host), " is not an IP address or host name"));
  }
  if (require_kind == 6 && !bracketed) {
    return absl::InvalidArgumentError("ipv6: addresses are written ipv6:[addr]:port");
  }
  auto p = ParsePort(port, use);
  if (!p.ok()) return p.status();
  a.port = *p;
  return a;
}

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  absl::string_view h = host;
  if (absl::EndsWith(h, ".")) h.remove_suffix(1);
  if (absl::EqualsIgnoreCase(h, "localhost")) return true;
  in_addr v4;
  if (ParseIpv4(host, &v4)) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (ParseIpv6(host, &v6)) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

absl::StatusOr<Address> ParseAddress(const std::string& text, AddressUse use) {
  if (text.empty()) return absl::InvalidArgumentError("empty address");
  for (unsigned char c : text) {
    if (c <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError("address contains whitespace or control characters");
    }
  }
  absl::string_view t = text;
  if (absl::ConsumePrefix(&t, "unix:")) {
    Address a;
    a.kind = AddressKind::kUnix;
    if (absl::StartsWith(t, "//")) {
      // URI form: an empty authority then an absolute path.
      if (!absl::StartsWith(t, "///")) {
        return absl::InvalidArgumentError(
            "unix:// must be followed by an absolute path (unix:///run/x.sock)");
      }
      t.remove_prefix(2);
    }
    if (t.empty()) return absl::InvalidArgumentError("missing socket path after 'unix:'");
    if (t[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("unix socket path ", Quoted(t),
                       " is relative: give an absolute path (unix:/run/x.sock); "
                       "a relative one depends on the daemon's working directory"));
    }
    if (t.size() > kMaxUnixPathBytes) {
      return absl::InvalidArgumentError(absl::StrCat("unix socket path is ", t.size(),
                                                     " bytes; the limit is ", kMaxUnixPathBytes));
    }
    a.path = std::string(t);
    a.loopback = true;
    a.grpc_target = absl::StrCat("unix:", a.path);
    return a;
  }
  if (absl::ConsumePrefix(&t, "unix-abstract:")) {
    if (t.empty()) return absl::InvalidArgumentError("missing name after 'unix-abstract:'");
    if (t.size() > kMaxUnixPathBytes - 1) {
      return absl::InvalidArgumentError("abstract unix socket name is too long");
    }
    Address a;
    a.kind = AddressKind::kUnixAbstract;
    a.path = std::string(t);
    a.loopback = false;  // no file permissions: anyone in the network namespace can connect
    a.grpc_target = text;
    return a;
  }
  int require_kind = 0;
  bool scheme = false;
  if (absl::ConsumePrefix(&t, "dns:")) {
    scheme = true;
    if (absl::StartsWith(t, "//")) {
      if (!absl::ConsumePrefix(&t, "///")) {
        return absl::InvalidArgumentError(
            "dns:// with an authority (DNS server) is not supported; write dns:///host:port");
      }
    }
  } else if (absl::ConsumePrefix(&t, "ipv4:")) {
    scheme = true;
    require_kind = 4;
  } else if (absl::ConsumePrefix(&t, "ipv6:")) {
    scheme = true;
    require_kind = 6;
  }
  if (scheme && use == AddressUse::kListen) {
    return absl::InvalidArgumentError(
        "scheme prefixes (dns:, ipv4:, ipv6:) are for connections; listen on host:port");
  }
  if (t.find(',') != absl::string_view::npos) {
    return absl::InvalidArgumentError("one address per entry (no comma-separated lists)");
  }
  if (t.find('/') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        "unexpected '/' (write host:port; unix sockets are unix:/path)");
  }
  auto a = ParseHostPort(t, use, require_kind);
  if (!a.ok()) return a.status();
  a->grpc_target = text;
  return a;
}

std::string UnixSocketDirectoryProblem(const Address& address) {
  if (address.kind != AddressKind::kUnix) return "";
  const size_t slash = address.path.rfind('/');
  if (slash == std::string::npos) return "";
  const std::string dir = slash == 0 ? "/" : address.path.substr(0, slash);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    return absl::StrCat("directory ", dir,
                        errno == ENOENT ? " does not exist" : absl::StrCat(": ", strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) return absl::StrCat(dir, " is not a directory");
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::StrCat("directory ", dir, " is not writable by this user (uid ", geteuid(), ")");
  }
  return "";
}

}  // namespace refit::config
